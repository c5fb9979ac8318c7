"""The bodies of the POST routes as msgspec structs, with a bound on every field: each body is
decoded once from the raw bytes into one of these (protocol.decode), so a value the rest of the
API was not written for is a 400 here. The same structs make /openapi.json (`openapi`).

The numeric bounds mirror SamplingParams.validate, which still runs on every request
(check_request); the limits that are server flags (--max-n, --max-prompts-per-request) and the
nesting depth are checked right after decoding (protocol)."""
from __future__ import annotations

import re
from typing import Annotated, Any, Literal

import msgspec
from msgspec import UNSET, Meta, Struct, UnsetType

from xinfer.sampling_params import INT64_MAX, INT64_MIN

MAX_MESSAGES = 4096
MAX_TOOLS = 128  # also tool calls per history message
MAX_STOP = 16
MAX_TOKEN_MAP = 1024  # logit_bias keys, stop_token_ids

I64_MIN, I64_MAX = INT64_MIN, INT64_MAX

Int64 = Annotated[int, Meta(ge=I64_MIN, le=I64_MAX)]
Count = Annotated[int, Meta(ge=0, le=I64_MAX)]
TokenId = Annotated[int, Meta(ge=0, le=I64_MAX)]  # the vocabulary bound comes with check_request
TopN = Annotated[int, Meta(ge=0, le=20)]
Penalty = Annotated[float, Meta(ge=-2, le=2)]
Probability = Annotated[float, Meta(ge=0, le=1)]
LogitBias = Annotated[
    dict[TokenId, Annotated[float, Meta(ge=-100, le=100)]],
    Meta(max_length=MAX_TOKEN_MAP, extra_json_schema={"propertyNames": {"pattern": "^(0|[1-9][0-9]{0,17})$"}})]
Stop = str | Annotated[list[str], Meta(max_length=MAX_STOP)]
StopTokenIds = Annotated[list[TokenId], Meta(max_length=MAX_TOKEN_MAP)]


class Body(Struct, kw_only=True):
    """Fields every body may carry."""
    model: str | None = None


# ---- messages and tools: what a chat template sees ----
# Fields only passed through to the template are UNSET when absent, so the template sees the
# message as sent (to_builtins leaves UNSET out).

class ImageUrl(Struct, kw_only=True):
    url: str
    detail: str | None = None  # taken and ignored: the processor decides the resolution


class ContentPart(Struct, kw_only=True):
    type: str  # "text"; "image_url" and "image_base64" for a vision model (xinfer/api/media.py); else a 400
    text: str | None = None
    image_url: str | ImageUrl | None = None  # OpenAI's object, or the URL as a string
    image_base64: str | None = None  # a data: URL


class FunctionCall(Struct, kw_only=True):
    name: str
    arguments: str | dict[str, Any] | None = None  # a JSON string (OpenAI) or already an object


class ToolCall(Struct, kw_only=True):
    function: FunctionCall
    id: str | None | UnsetType = UNSET
    type: str | UnsetType = UNSET


class Message(Struct, kw_only=True):
    role: str
    content: str | list[ContentPart] | None = None
    tool_calls: Annotated[list[ToolCall], Meta(max_length=MAX_TOOLS)] | None | UnsetType = UNSET
    name: str | None | UnsetType = UNSET
    tool_call_id: str | None | UnsetType = UNSET
    reasoning_content: str | None | UnsetType = UNSET


class Function(Struct, kw_only=True):
    name: str
    description: str | None | UnsetType = UNSET
    parameters: dict[str, Any] | None | UnsetType = UNSET
    strict: bool | None | UnsetType = UNSET


class Tool(Struct, kw_only=True):
    function: Function
    type: str = "function"


class NamedFunction(Struct, kw_only=True):
    name: str


class NamedToolChoice(Struct, kw_only=True):
    function: NamedFunction
    type: str = "function"


class ThinkingConfig(Struct, kw_only=True):
    type: str  # "enabled" | "disabled" (anything but "disabled" thinks)


Messages = Annotated[list[Message], Meta(min_length=1, max_length=MAX_MESSAGES)]
Tools = Annotated[list[Tool], Meta(max_length=MAX_TOOLS)]
ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice
Thinking = bool | ThinkingConfig
TemplateKwargs = dict[str, Any]  # keys are checked by protocol.chat_text
MAX_TEMPLATE = 64 << 10  # characters of a request's own chat template (chat_template_kwargs' one too)
ChatTemplate = Annotated[str, Meta(max_length=MAX_TEMPLATE)]


class StreamOptions(Struct, kw_only=True):
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None  # every chunk carries the usage so far (vLLM)


# ---- structured outputs (xinfer/api/constraints.py turns these into one StructuredOutput) ----

Spec = Annotated[str, Meta(max_length=1 << 20)]
Choices = Annotated[list[Annotated[str, Meta(max_length=4096)]], Meta(min_length=1, max_length=4096)]


class JsonSchemaSpec(Struct, kw_only=True):
    name: str | None = None
    schema: dict[str, Any] | bool | None = None  # None: any JSON object
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(Struct, kw_only=True):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaSpec | None = None


class StructuredOutputs(Struct, kw_only=True):
    """vLLM's structured_outputs: one of these."""
    json: dict[str, Any] | bool | Spec | None = None
    regex: Spec | None = None
    choice: Choices | None = None
    grammar: Spec | None = None
    structural_tag: dict[str, Any] | Spec | None = None
    json_object: bool | None = None


# ---- the route bodies ----

class Sampling(Body, kw_only=True):
    """The fields /v1/chat/completions and /v1/completions share."""
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Annotated[int, Meta(ge=1, le=I64_MAX)] | None = None  # and <= --max-n
    max_tokens: Count | None = None
    max_completion_tokens: Count | None = None
    min_tokens: Count | None = None
    temperature: Annotated[float, Meta(ge=0, le=100)] | None = None
    top_p: Annotated[float, Meta(gt=0, le=1)] | None = None
    top_k: Annotated[int, Meta(ge=-1, le=I64_MAX)] | None = None
    min_p: Probability | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: Annotated[float, Meta(gt=0, le=2)] | None = None
    logit_bias: LogitBias | None = None
    seed: Int64 | None = None
    stop: Stop | None = None
    stop_token_ids: StopTokenIds | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    allowed_token_ids: Annotated[list[TokenId], Meta(min_length=1, max_length=1 << 20)] | None = None
    bad_words: Annotated[list[Annotated[str, Meta(min_length=1, max_length=256)]], Meta(max_length=64)] | None = None
    prompt_logprobs: TopN | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | bool | Spec | None = None  # vLLM's older spellings
    guided_regex: Spec | None = None
    guided_choice: Choices | None = None
    guided_grammar: Spec | None = None
    guided_decoding_backend: str | None = None  # accepted, ignored: xgrammar serves them all
    json_schema: dict[str, Any] | bool | None = None  # llama-server's spellings
    grammar: Spec | None = None


class ChatRequest(Sampling, kw_only=True):
    messages: Messages
    tools: Tools | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None  # false: at most one call
    chat_template: ChatTemplate | None = None  # the request's own (with --trust-request-chat-template)
    chat_template_kwargs: TemplateKwargs | None = None
    thinking: Thinking | None = None
    enable_thinking: bool | None = None
    reasoning_effort: Annotated[str, Meta(max_length=32)] | None = None  # "none": no thinking
    add_generation_prompt: bool | None = None  # default true (false with continue_final_message)
    continue_final_message: bool = False  # the reply continues the last (assistant) message
    logprobs: bool | None = None
    top_logprobs: TopN | None = None  # needs logprobs: true


Prompt = str | list[str | TokenId | list[TokenId]]  # one list form per request (protocol); count <= the flag


class CompletionRequest(Sampling, kw_only=True):
    prompt: Prompt
    echo: bool | None = None
    logprobs: TopN | None = None
    suffix: str | None = None  # not supported: a 400 when set


class TokenizeRequest(Body, kw_only=True):
    prompt: str | None = None
    messages: Messages | None = None  # rendered as chat does
    tools: Tools | None = None
    tool_choice: ToolChoice | None = None
    chat_template: ChatTemplate | None = None  # the request's own (with --trust-request-chat-template)
    chat_template_kwargs: TemplateKwargs | None = None
    thinking: Thinking | None = None
    enable_thinking: bool | None = None
    reasoning_effort: Annotated[str, Meta(max_length=32)] | None = None
    add_generation_prompt: bool | None = None  # default true (false with continue_final_message)
    continue_final_message: bool = False  # the reply continues the last (assistant) message
    add_special_tokens: bool | None = None  # default: true for a prompt, false for messages
    return_token_strs: bool | None = None


class DetokenizeRequest(Body, kw_only=True):
    tokens: list[TokenId]
    skip_special_tokens: bool = True


class ErrorDetail(Struct, kw_only=True):
    message: str
    type: str
    param: str | None
    code: str | None


class Error(Struct, kw_only=True):
    error: ErrorDetail


# ---- /openapi.json ----

def openapi(routes, version: str, secured: bool) -> dict:
    """An OpenAPI 3.1 document of `routes`: (path, methods, body struct or None). Each request
    schema is written out whole (no $ref), so a JSON-schema tool can take it as it is."""
    bodies = sorted({b for _, _, b in routes if b is not None}, key=lambda t: t.__name__)
    _, components = msgspec.json.schema_components(bodies + [Error], ref_template="#/components/schemas/{name}")
    error = {"description": "an OpenAI-style error",
             "content": {"application/json": {"schema": _inline(components["Error"], components)}}}
    paths: dict = {}
    for path, methods, body in sorted(routes, key=lambda r: r[0]):
        path = re.sub(r"<(\w+)(?::[^>]*)?>", r"{\1}", path)
        for method in sorted(m.lower() for m in methods):
            op = {"operationId": method + re.sub(r"\W+", "_", path).rstrip("_"),
                  "responses": {"200": {"description": "OK"}, "default": error}}
            params = re.findall(r"{(\w+)}", path)
            if params:
                op["parameters"] = [{"name": p, "in": "path", "required": True, "schema": {"type": "string"}}
                                    for p in params]
            if body is not None:
                op["requestBody"] = {"required": True, "content": {"application/json": {
                    "schema": _inline(components[body.__name__], components)}}}
            paths.setdefault(path, {})[method] = op
    doc = {"openapi": "3.1.0", "info": {"title": "xinfer", "version": version}, "paths": paths,
           "components": {"schemas": components}}
    if secured:
        doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        doc["security"] = [{"bearer": []}]
    return doc


def _inline(schema, components):
    """`schema` with every $ref replaced by its component (the structs have no cycles)."""
    if isinstance(schema, dict):
        ref = schema.get("$ref")
        if ref is not None:
            return _inline(components[ref.rsplit("/", 1)[1]], components)
        return {k: _inline(v, components) for k, v in schema.items()}
    if isinstance(schema, list):
        return [_inline(v, components) for v in schema]
    return schema
