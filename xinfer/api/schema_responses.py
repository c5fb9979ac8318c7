"""The body of /v1/responses (OpenAI's Responses API), bounded like the chat one in schema.py;
xinfer/api/responses_api.py turns it into a ChatRequest."""
from __future__ import annotations

from typing import Annotated, Any, Literal

from msgspec import Meta, Struct

from xinfer.api.schema import MAX_MESSAGES, MAX_TOOLS, Body, Count


class Part(Struct, kw_only=True):
    type: str  # input_text / output_text (input_image and files: a 400 on a text model)
    text: str | None = None


class Item(Struct, kw_only=True):
    """An input item: a message, a function_call, a function_call_output or a reasoning item."""
    type: str = "message"
    role: str | None = None  # message: user / assistant / system / developer
    content: str | Annotated[list[Part], Meta(max_length=MAX_MESSAGES)] | None = None
    call_id: str | None = None  # function_call, function_call_output
    name: str | None = None
    arguments: str | None = None
    output: str | Annotated[list[Part], Meta(max_length=MAX_MESSAGES)] | None = None
    id: str | None = None
    status: str | None = None
    summary: list[dict[str, Any]] | None = None  # reasoning: not fed back (the template drops it)


class FunctionTool(Struct, kw_only=True):
    type: str  # only "function" runs here
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunction(Struct, kw_only=True):
    type: Literal["function"]
    name: str


class TextFormat(Struct, kw_only=True):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema: dict[str, Any] | bool | None = None
    strict: bool | None = None
    description: str | None = None


class TextConfig(Struct, kw_only=True):
    format: TextFormat | None = None
    verbosity: str | None = None  # accepted, no effect


class Reasoning(Struct, kw_only=True):
    effort: Annotated[str, Meta(max_length=32)] | None = None  # "none"/"minimal": no thinking
    summary: str | None = None  # accepted; the reasoning is returned whole, as reasoning_text
    generate_summary: str | None = None


class ResponsesRequest(Body, kw_only=True):
    input: str | Annotated[list[Item], Meta(min_length=1, max_length=MAX_MESSAGES)]
    instructions: str | None = None
    tools: Annotated[list[FunctionTool], Meta(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: Count | None = None
    temperature: Annotated[float, Meta(ge=0, le=100)] | None = None
    top_p: Annotated[float, Meta(gt=0, le=1)] | None = None
    reasoning: Reasoning | None = None
    text: TextConfig | None = None
    stream: bool = False
    store: bool = True
    previous_response_id: Annotated[str, Meta(max_length=128)] | None = None
    metadata: dict[str, Any] | None = None
    user: str | None = None
    truncation: str | None = None  # accepted: a conversation over the context is a 400
    include: list[str] | None = None
