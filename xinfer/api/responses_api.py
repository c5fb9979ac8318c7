"""/v1/responses: OpenAI's Responses API (what the Agents SDK and Codex default to). A body is
turned into the ChatRequest it means and runs through the chat route's own preparation; the
output is shaped into Responses items (reasoning, message, function_call), whole or as the typed
event stream. `store` keeps the conversation in memory (RESPONSES_KEPT, for RESPONSES_TTL s) so a
later request can continue it with `previous_response_id`; GET / DELETE /v1/responses/{id}."""
from __future__ import annotations

import json
import time
import uuid
from collections import OrderedDict

import msgspec
from sanic import Sanic, response

from xinfer.api.chat import prepare
from xinfer.api.protocol import ApiError, sampling_params
from xinfer.api.responses import ChoiceState
from xinfer.api.schema import ChatRequest
from xinfer.api.schema_responses import ResponsesRequest
from xinfer.api.state import ApiState
from xinfer.api.streaming import merged, stream_error

RESPONSES_KEPT = 1024
RESPONSES_TTL = 3600.0


class Store:
    """Stored responses: id -> (time, conversation as chat messages, the response body)."""

    def __init__(self):
        self.items: OrderedDict[str, tuple[float, list[dict], dict]] = OrderedDict()

    def get(self, rid: str):
        now = time.time()
        while self.items and now - next(iter(self.items.values()))[0] > RESPONSES_TTL:
            self.items.popitem(last=False)
        entry = self.items.get(rid)
        if entry is None:
            raise ApiError(f"no stored response {rid!r} (responses are kept in memory, {RESPONSES_KEPT} at most, "
                           f"for {RESPONSES_TTL:g} s, and not across restarts)", status=404,
                           kind="not_found_error", param="previous_response_id")
        return entry

    def put(self, rid: str, messages: list[dict], body: dict) -> None:
        self.items[rid] = (time.time(), messages, body)
        while len(self.items) > RESPONSES_KEPT:
            self.items.popitem(last=False)


def register(app: Sanic, s: ApiState, protected) -> None:
    store = Store()

    @app.post("/v1/responses", ctx_body=ResponsesRequest)
    @protected
    async def create(request):
        with s.admitted():
            body = s.read(request, ResponsesRequest)
            history = store.get(body.previous_response_id)[1] if body.previous_response_id else []
            conversation = history + _messages(body)
            chat = to_chat(body, conversation)
            params = sampling_params(chat, chat=True, max_n=1)
            ids, spec = await s.offload(prepare, s, chat, params)
            s.check([ids], params)
            r = _Response(body, "resp_" + uuid.uuid4().hex, body.model or s.model_name)
            if body.stream:
                out = await _stream(s, request, r, ids, params, spec)
            else:
                st = ChoiceState()
                async for _, o in merged(s, r.id, [ids], params, spec):
                    if o is not None:
                        st.add(o)
                out = r.whole(st, ids)
            if body.store and out is not None:
                store.put(r.id, conversation + [r.reply_message()], out)
            return response.json(out) if not body.stream else None

    @app.get("/v1/responses/<rid>")
    @protected
    async def retrieve(request, rid: str):
        return response.json(store.get(rid)[2])

    @app.delete("/v1/responses/<rid>")
    @protected
    async def delete(request, rid: str):
        store.get(rid)
        del store.items[rid]
        return response.json({"id": rid, "object": "response", "deleted": True})


# ---- the request ----

def _messages(body: ResponsesRequest) -> list[dict]:
    """The request's input as chat messages (without its instructions: those are not carried on)."""
    if isinstance(body.input, str):
        return [{"role": "user", "content": body.input}]
    out: list[dict] = []
    for i, it in enumerate(body.input):
        if it.type == "message":
            role = {"developer": "system"}.get(it.role or "user", it.role or "user")
            if role not in ("user", "assistant", "system"):
                raise ApiError(f"input[{i}]: unknown role {it.role!r}", param="input")
            out.append({"role": role, "content": _text(it.content, i)})
        elif it.type == "function_call":
            call = {"id": it.call_id or it.id or f"call_{i}", "type": "function",
                    "function": {"name": it.name or "", "arguments": it.arguments or "{}"}}
            if out and out[-1]["role"] == "assistant":
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif it.type == "function_call_output":
            out.append({"role": "tool", "tool_call_id": it.call_id or "", "content": _text(it.output, i)})
        elif it.type != "reasoning":
            raise ApiError(f"input[{i}]: items of type {it.type!r} are not supported", param="input")
    return out


def _text(content, i: int) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    bad = next((p.type for p in content if p.type not in ("input_text", "output_text", "text")), None)
    if bad is not None:
        raise ApiError(f"input[{i}]: content of type {bad!r} is not supported by this model (text only)",
                       param="input")
    return "".join(p.text or "" for p in content)


def to_chat(body: ResponsesRequest, conversation: list[dict]) -> ChatRequest:
    msgs = ([{"role": "system", "content": body.instructions}] if body.instructions else []) + conversation
    chat: dict = {"model": body.model, "messages": msgs}
    if body.tools:
        bad = next((t.type for t in body.tools if t.type != "function"), None)
        if bad is not None:
            raise ApiError(f"tools of type {bad!r} are not supported (function tools only)", param="tools")
        chat["tools"] = [{"type": "function", "function": {"name": t.name or "", "description": t.description or "",
                                                           "parameters": t.parameters or {"type": "object"}}}
                         for t in body.tools]
    tc = body.tool_choice
    if tc is not None:
        chat["tool_choice"] = tc if isinstance(tc, str) else {"type": "function", "function": {"name": tc.name}}
    fmt = body.text.format if body.text is not None else None
    if fmt is not None and fmt.type != "text":
        chat["response_format"] = {"type": "json_object"} if fmt.type == "json_object" else {
            "type": "json_schema", "json_schema": {"name": fmt.name, "schema": fmt.schema, "strict": fmt.strict}}
    effort = body.reasoning.effort if body.reasoning is not None else None
    if effort is not None:
        chat["reasoning_effort"] = "none" if effort in ("none", "minimal") else effort
    for key, value in (("max_tokens", body.max_output_tokens), ("temperature", body.temperature),
                       ("top_p", body.top_p), ("parallel_tool_calls", body.parallel_tool_calls),
                       ("stream", body.stream)):
        if value is not None:
            chat[key] = value
    try:
        return msgspec.convert(chat, ChatRequest)
    except msgspec.ValidationError as e:
        raise ApiError(f"invalid request: {e}") from None


# ---- the answer ----

class _Response:
    """One response's items, built as the output arrives (in that order, streamed or not)."""

    def __init__(self, body: ResponsesRequest, rid: str, model: str):
        self.body, self.id, self.model, self.created = body, rid, model, int(time.time())
        self.output: list[dict] = []
        self.st = ChoiceState()

    def item(self, kind: str) -> tuple[dict, bool]:
        """The open item of `kind` (the last one, if it is of that kind), or a new one: (item, new)."""
        if self.output and self.output[-1]["type"] == kind and kind != "function_call":
            return self.output[-1], False
        tag = {"message": "msg", "reasoning": "rs", "function_call": "fc"}[kind]
        item = {"type": kind, "id": f"{tag}_{uuid.uuid4().hex}", "status": "in_progress"}
        if kind == "message":
            item.update(role="assistant", content=[{"type": "output_text", "text": "", "annotations": []}])
        elif kind == "reasoning":
            item.update(summary=[], content=[{"type": "reasoning_text", "text": ""}])
        self.output.append(item)
        return item, True

    def whole(self, st: ChoiceState, ids) -> dict:
        self.st = st
        if "".join(st.reasoning):
            self.item("reasoning")[0]["content"][0]["text"] = "".join(st.reasoning)
        if "".join(st.content) or not st.calls:
            self.item("message")[0]["content"][0]["text"] = "".join(st.content)
        for c in st.tool_calls():
            item, _ = self.item("function_call")
            item.update(call_id=c["id"], name=c["function"]["name"], arguments=c["function"]["arguments"])
        return self.body_of(ids)

    def body_of(self, ids, status: str | None = None) -> dict:
        st, b = self.st, self.body
        done = status is None
        if done:
            status = "incomplete" if st.finish_reason == "length" else "completed"
            for item in self.output:
                item["status"] = "completed"
        usage = {"input_tokens": len(ids), "input_tokens_details": {"cached_tokens": st.cached},
                 "output_tokens": st.tokens, "output_tokens_details": {"reasoning_tokens": 0},
                 "total_tokens": len(ids) + st.tokens} if done else None
        return {"id": self.id, "object": "response", "created_at": self.created, "status": status,
                "model": self.model, "output": self.output if done else [], "error": None,
                "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
                "instructions": b.instructions, "max_output_tokens": b.max_output_tokens,
                "parallel_tool_calls": b.parallel_tool_calls is not False,
                "previous_response_id": b.previous_response_id, "store": b.store,
                "temperature": b.temperature, "top_p": b.top_p, "tool_choice": msgspec.to_builtins(b.tool_choice)
                or "auto", "tools": msgspec.to_builtins(b.tools or []), "text": msgspec.to_builtins(b.text)
                or {"format": {"type": "text"}}, "reasoning": msgspec.to_builtins(b.reasoning),
                "metadata": b.metadata or {}, "usage": usage}

    def reply_message(self) -> dict:
        """The reply as a chat message, for a later previous_response_id."""
        msg = {"role": "assistant", "content": "".join(self.st.content)}
        if self.st.calls:
            msg["tool_calls"] = self.st.tool_calls()
        return msg


async def _stream(s: ApiState, request, r: _Response, ids, params, spec):
    resp = await request.respond(content_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    seq = 0

    async def event(kind: str, **data) -> None:
        nonlocal seq
        payload = {"type": kind, "sequence_number": seq, **data}
        seq += 1
        await resp.send(f"event: {kind}\ndata: " + json.dumps(payload, ensure_ascii=False) + "\n\n")

    async def opened(kind: str) -> dict:
        item, new = r.item(kind)
        if new:
            if len(r.output) > 1:
                await close(r.output[-2], len(r.output) - 2)
            await event("response.output_item.added", output_index=len(r.output) - 1,
                        item={**item, "content": []} if kind == "message" else item)
            if kind == "message":
                await event("response.content_part.added", item_id=item["id"], output_index=len(r.output) - 1,
                            content_index=0, part=item["content"][0])
        return item

    async def close(item: dict, i: int) -> None:
        item["status"] = "completed"
        if item["type"] == "message":
            part = item["content"][0]
            await event("response.output_text.done", item_id=item["id"], output_index=i, content_index=0,
                        text=part["text"])
            await event("response.content_part.done", item_id=item["id"], output_index=i, content_index=0, part=part)
        elif item["type"] == "reasoning":
            await event("response.reasoning_text.done", item_id=item["id"], output_index=i, content_index=0,
                        text=item["content"][0]["text"])
        else:
            await event("response.function_call_arguments.done", item_id=item["id"], output_index=i,
                        arguments=item["arguments"])
        await event("response.output_item.done", output_index=i, item=item)

    await event("response.created", response=r.body_of(ids, "in_progress"))
    await event("response.in_progress", response=r.body_of(ids, "in_progress"))
    try:
        async for _, o in merged(s, r.id, [ids], params, spec):
            if o is None:
                continue
            r.st.add(o)
            if o.reasoning:
                item = await opened("reasoning")
                item["content"][0]["text"] += o.reasoning
                await event("response.reasoning_text.delta", item_id=item["id"], output_index=len(r.output) - 1,
                            content_index=0, delta=o.reasoning)
            if o.text:
                item = await opened("message")
                item["content"][0]["text"] += o.text
                await event("response.output_text.delta", item_id=item["id"], output_index=len(r.output) - 1,
                            content_index=0, delta=o.text, logprobs=[])
            for c in o.tool_calls:
                if c.id is not None:  # a new call
                    item, _ = r.item("function_call")
                    item.update(call_id=c.id, name=c.name, arguments="")
                    if len(r.output) > 1:
                        await close(r.output[-2], len(r.output) - 2)
                    await event("response.output_item.added", output_index=len(r.output) - 1, item=item)
                item = r.output[-1]
                item["arguments"] += c.arguments
                if c.arguments:
                    await event("response.function_call_arguments.delta", item_id=item["id"],
                                output_index=len(r.output) - 1, delta=c.arguments)
        if not r.output:
            await opened("message")
        await close(r.output[-1], len(r.output) - 1)
        out = r.body_of(ids)
        await event("response.completed" if out["status"] == "completed" else "response.incomplete", response=out)
    except Exception as e:  # the stream has started: an error event ends it
        err = stream_error(r.id, e)
        await event("error", code=err.code or err.kind, message=str(err), param=err.param)
        out = None
    await resp.eof()
    return out
