"""/v1/messages and /v1/messages/count_tokens: Anthropic's Messages API (what Claude Code and the
anthropic SDK speak). A body is turned into the ChatRequest it means and runs through the chat
route's own preparation (template, tools, their grammar, reasoning split); the output is shaped
into Anthropic's content blocks, whole or as its event stream."""
from __future__ import annotations

import json
import uuid

import msgspec
from sanic import Sanic, response

from xinfer.api.chat import prepare
from xinfer.api.protocol import ApiError, decode, sampling_params
from xinfer.api.responses import ChoiceState
from xinfer.api.schema import ChatRequest
from xinfer.api.schema_anthropic import AnthropicBase, CountTokensRequest, MessagesRequest
from xinfer.api.state import ApiState
from xinfer.api.streaming import merged, stream_error
from xinfer.sampling_params import SamplingParams

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}


def is_anthropic(path: str) -> bool:
    return path.startswith("/v1/messages")


def error_body(e: ApiError) -> dict:
    """Anthropic's error shape: {"type": "error", "error": {"type", "message"}}."""
    return {"type": "error", "error": {"type": _ERROR_TYPES.get(e.status, "api_error"), "message": str(e)}}


def register(app: Sanic, s: ApiState, protected) -> None:
    @app.post("/v1/messages", ctx_body=MessagesRequest)
    @protected
    async def messages(request):
        with s.admitted():
            body = s.read(request, MessagesRequest)
            chat = to_chat(body)
            params = sampling_params(chat, chat=True, max_n=1)
            ids, spec = await s.offload(prepare, s, chat, params)
            s.check([ids], params)
            rid = "msg_" + uuid.uuid4().hex
            head = {"id": rid, "type": "message", "role": "assistant", "model": body.model or s.model_name}
            if body.stream:
                return await _stream(s, request, rid, head, ids, params, spec)
            st = ChoiceState()
            async for _, o in merged(s, rid, [ids], params, spec):
                if o is not None:
                    st.add(o)
            return response.json({**head, "content": _blocks(st), **_stop(st), "usage": _usage(ids, st)})

    @app.post("/v1/messages/count_tokens", ctx_body=CountTokensRequest)
    @protected
    async def count_tokens(request):
        body = decode(request.body, CountTokensRequest)
        s.check_model(body.model)
        ids, _ = await s.offload(prepare, s, to_chat(body), SamplingParams())
        return response.json({"input_tokens": len(ids)})


# ---- the request ----

def to_chat(body: AnthropicBase) -> ChatRequest:
    """The ChatRequest an Anthropic body means: system first, tool_result blocks as tool
    messages, tool_use blocks as the assistant's tool_calls, thinking blocks as its reasoning."""
    msgs = [{"role": "system", "content": _text(body.system, "system")}] if body.system else []
    for i, m in enumerate(body.messages):
        if isinstance(m.content, str):
            msgs.append({"role": m.role, "content": m.content})
            continue
        parts, calls, reasoning, results = [], [], [], []
        for b in m.content:
            if b.type == "text":
                parts.append({"type": "text", "text": b.text or ""})
            elif b.type == "image":
                parts.append({"type": "image"})  # the chat route answers what a text model can't read
            elif b.type == "tool_use" and m.role == "assistant":
                calls.append({"id": b.id or f"toolu_{i}_{len(calls)}", "type": "function",
                              "function": {"name": b.name or "", "arguments": b.input or {}}})
            elif b.type == "tool_result" and m.role == "user":
                results.append({"role": "tool", "tool_call_id": b.tool_use_id or "",
                                "content": _text(b.content, f"messages[{i}]")})
            elif b.type in ("thinking", "redacted_thinking") and m.role == "assistant":
                reasoning.append(b.thinking or "")
            else:
                raise ApiError(f"messages[{i}]: content blocks of type {b.type!r} are not supported in a "
                               f"{m.role} message", param="messages")
        msgs.extend(results)  # a user turn's tool results answer the calls before it
        if parts or calls or not results:
            msg = {"role": m.role, "content": parts}
            if calls:
                msg["tool_calls"] = calls
            if reasoning:
                msg["reasoning_content"] = "".join(reasoning)
            msgs.append(msg)
    chat: dict = {"model": body.model, "messages": msgs}
    if body.tools:
        bad = next((t.type for t in body.tools if t.type not in (None, "custom")), None)
        if bad is not None:
            raise ApiError(f"tools of type {bad!r} (server tools) are not supported", param="tools")
        chat["tools"] = [{"type": "function", "function": {"name": t.name, "description": t.description or "",
                                                           "parameters": t.input_schema or {"type": "object"}}}
                         for t in body.tools]
    tc = body.tool_choice
    if tc is not None:
        if tc.type == "tool" and not tc.name:
            raise ApiError("tool_choice of type 'tool' needs 'name'", param="tool_choice")
        chat["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}.get(tc.type) or \
            {"type": "function", "function": {"name": tc.name}}
        if tc.disable_parallel_tool_use:
            chat["parallel_tool_calls"] = False
    if body.thinking is not None:
        chat["thinking"] = body.thinking.type != "disabled"
    if isinstance(body, MessagesRequest):
        fmt = body.output_config.format if body.output_config is not None else None
        if fmt is not None:
            chat["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt.schema}}
        chat.update({k: v for k, v in (("max_tokens", body.max_tokens), ("stop", body.stop_sequences),
                                       ("temperature", body.temperature), ("top_p", body.top_p),
                                       ("top_k", body.top_k), ("stream", body.stream)) if v is not None})
    try:
        return msgspec.convert(chat, ChatRequest)
    except msgspec.ValidationError as e:
        raise ApiError(f"invalid request: {e}") from None


def _text(content, where: str) -> str:
    """The text of a string or of text blocks (a system prompt, a tool result)."""
    if content is None or isinstance(content, str):
        return content or ""
    out = []
    for b in content:
        kind = b.type if not isinstance(b, dict) else b.get("type")
        if kind != "text":
            raise ApiError(f"{where}: blocks of type {kind!r} are not supported here (text only)", param="messages")
        out.append((b.text if not isinstance(b, dict) else b.get("text")) or "")
    return "\n".join(out)


# ---- the answer ----

def _blocks(st: ChoiceState) -> list[dict]:
    out = []
    reasoning, text = "".join(st.reasoning), "".join(st.content)
    if reasoning:
        out.append({"type": "thinking", "thinking": reasoning, "signature": ""})
    if text or not st.calls:
        out.append({"type": "text", "text": text})
    for c in st.tool_calls():
        out.append({"type": "tool_use", "id": c["id"], "name": c["function"]["name"],
                    "input": _input(c["function"]["arguments"])})
    return out


def _input(arguments: str) -> dict:
    try:
        value = json.loads(arguments) if arguments.strip() else {}
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def _stop(st: ChoiceState) -> dict:
    reason = "tool_use" if st.calls else "max_tokens" if st.finish_reason == "length" else \
        "stop_sequence" if st.stop_str is not None else "end_turn"
    return {"stop_reason": reason, "stop_sequence": st.stop_str if reason == "stop_sequence" else None}


def _usage(ids, st: ChoiceState) -> dict:
    """Anthropic counts prefix-cache reads apart from the input."""
    return {"input_tokens": len(ids) - st.cached, "output_tokens": st.tokens,
            "cache_read_input_tokens": st.cached, "cache_creation_input_tokens": 0}


async def _stream(s: ApiState, request, rid, head, ids, params, spec):
    resp = await request.respond(content_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def event(data: dict) -> None:
        await resp.send(f"event: {data['type']}\ndata: " + json.dumps(data, ensure_ascii=False) + "\n\n")

    st, block = ChoiceState(), None  # the open content block: (kind, index)
    count = 0

    async def open_block(kind: str, start: dict) -> None:
        nonlocal block, count
        await close_block()
        block, count = (kind, count), count + 1
        await event({"type": "content_block_start", "index": block[1], "content_block": start})

    async def close_block() -> None:
        nonlocal block
        if block is not None:
            if block[0] == "thinking":
                await event({"type": "content_block_delta", "index": block[1],
                             "delta": {"type": "signature_delta", "signature": ""}})
            await event({"type": "content_block_stop", "index": block[1]})
            block = None

    async def delta(kind: str, start: dict, d: dict) -> None:
        if block is None or block[0] != kind:
            await open_block(kind, start)
        await event({"type": "content_block_delta", "index": block[1], "delta": d})

    await event({"type": "message_start", "message": {**head, "content": [], "stop_reason": None,
                                                      "stop_sequence": None,
                                                      "usage": {"input_tokens": len(ids), "output_tokens": 0}}})
    try:
        async for _, o in merged(s, rid, [ids], params, spec):
            if o is None:
                await event({"type": "ping"})
                continue
            st.add(o)
            if o.reasoning:
                await delta("thinking", {"type": "thinking", "thinking": "", "signature": ""},
                            {"type": "thinking_delta", "thinking": o.reasoning})
            if o.text:
                await delta("text", {"type": "text", "text": ""}, {"type": "text_delta", "text": o.text})
            for c in o.tool_calls:
                if c.id is not None:  # a new call
                    await open_block("tool_use", {"type": "tool_use", "id": c.id, "name": c.name, "input": {}})
                if c.arguments:
                    await event({"type": "content_block_delta", "index": block[1],
                                 "delta": {"type": "input_json_delta", "partial_json": c.arguments}})
        if count == 0:  # an empty reply is still one (empty) text block
            await open_block("text", {"type": "text", "text": ""})
        await close_block()
        usage = _usage(ids, st)
        await event({"type": "message_delta", "delta": _stop(st), "usage": {
            "output_tokens": usage["output_tokens"], "input_tokens": usage["input_tokens"],
            "cache_read_input_tokens": usage["cache_read_input_tokens"]}})
        await event({"type": "message_stop"})
    except Exception as e:  # the stream has started: Anthropic's error event ends it
        await event(error_body(stream_error(rid, e)))
    await resp.eof()
