"""The bodies of /v1/messages and /v1/messages/count_tokens (Anthropic's Messages API), bounded
like the OpenAI ones in schema.py; xinfer/api/anthropic.py turns them into a ChatRequest."""
from __future__ import annotations

from typing import Annotated, Any, Literal

from msgspec import Meta, Struct

from xinfer.api.schema import I64_MAX, MAX_MESSAGES, MAX_STOP, MAX_TOOLS, Body, Count

class Block(Struct, kw_only=True):
    """A content block: text, image, tool_use, tool_result, thinking (redacted_thinking, documents,
    server tools: a 400 with their type)."""
    type: str
    text: str | None = None
    id: str | None = None  # tool_use
    name: str | None = None
    input: dict[str, Any] | None = None
    tool_use_id: str | None = None  # tool_result
    content: str | list[dict[str, Any]] | None = None
    is_error: bool | None = None
    thinking: str | None = None  # thinking
    signature: str | None = None
    source: dict[str, Any] | None = None  # image
    cache_control: dict[str, Any] | None = None  # accepted, no effect: prefix caching is automatic


class AnthropicMessage(Struct, kw_only=True):
    role: Literal["user", "assistant"]
    content: str | Annotated[list[Block], Meta(max_length=MAX_MESSAGES)]


class AnthropicTool(Struct, kw_only=True):
    name: Annotated[str, Meta(min_length=1, max_length=256)]
    description: str | None = None
    input_schema: dict[str, Any] | None = None
    type: str | None = None  # "custom" or absent; server tools (web_search_...) are a 400
    cache_control: dict[str, Any] | None = None


class AnthropicToolChoice(Struct, kw_only=True):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class AnthropicThinking(Struct, kw_only=True):
    type: Annotated[str, Meta(max_length=32)]  # enabled, adaptive, between_tools...: all but "disabled" think
    budget_tokens: Count | None = None  # accepted; the template's switch has no budget


class OutputFormat(Struct, kw_only=True):
    type: Literal["json_schema"]
    schema: dict[str, Any]


class OutputConfig(Struct, kw_only=True):
    effort: Annotated[str, Meta(max_length=32)] | None = None  # accepted, no effect
    format: OutputFormat | None = None  # structured output


class AnthropicBase(Body, kw_only=True):
    messages: Annotated[list[AnthropicMessage], Meta(min_length=1, max_length=MAX_MESSAGES)]
    system: str | Annotated[list[Block], Meta(max_length=MAX_MESSAGES)] | None = None
    tools: Annotated[list[AnthropicTool], Meta(max_length=MAX_TOOLS)] | None = None
    tool_choice: AnthropicToolChoice | None = None
    thinking: AnthropicThinking | None = None


class MessagesRequest(AnthropicBase, kw_only=True):
    max_tokens: Annotated[int, Meta(ge=1, le=I64_MAX)]
    stream: bool = False
    stop_sequences: Annotated[list[str], Meta(max_length=MAX_STOP)] | None = None
    temperature: Annotated[float, Meta(ge=0, le=100)] | None = None
    top_p: Annotated[float, Meta(gt=0, le=1)] | None = None
    top_k: Annotated[int, Meta(ge=-1, le=I64_MAX)] | None = None
    metadata: dict[str, Any] | None = None
    output_config: OutputConfig | None = None


class CountTokensRequest(AnthropicBase, kw_only=True):
    pass
