"""MCP tools in /v1/chat/completions: the MCP servers' tools are offered beside the request's own,
and the calls the model makes to them are run here, their results put in the conversation, and the
model asked again, until it answers without MCP calls (README "MCP tools").

Every round streams as it is made (a stream client sees each round's text as it comes); the MCP
calls' pieces are kept from the client, which could not run them, and an annotation chunk with the
calls and their results takes their place. Usage sums the rounds."""
from __future__ import annotations

import asyncio
import contextlib
import time
import uuid

import msgspec
from sanic import response

from xinfer import process
from xinfer.api.mcp_servers import Servers, function_tool
from xinfer.api.protocol import sampling_params, usage
from xinfer.api.responses import ChoiceState, chat_delta, chat_logprobs
from xinfer.api.schema import Message, Tool
from xinfer.api.state import ApiState
from xinfer.api.streaming import dumps, log_chat, merged, reasoning_tokens, stream_error
from xinfer.ipc.step import unpack_ids


def install(app, s: ApiState) -> None:
    """With --mcp-config / --mcp-command: the servers start before the API listens (one that does not
    start stops the launch with its message) and stop with it."""
    if not s.opts.mcp_servers:
        return

    @app.before_server_start
    async def start_mcp(app):
        s.mcp = Servers(s.opts.mcp_servers, s.opts.mcp_timeout)
        try:
            await s.mcp.start()
        except Exception as e:
            process.failed("xinfer::api", str(e))  # the supervisor shows it and stops
            raise SystemExit(1)

    @app.after_server_stop
    async def stop_mcp(app):
        if s.mcp is not None:
            await s.mcp.close()


def applies(s: ApiState, body) -> bool:
    """MCP tools join a request with one choice that does not turn tools off."""
    return s.mcp is not None and (body.n or 1) == 1 and body.tool_choice != "none" and bool(s.mcp.tools())


class Rounds:
    """One request's rounds: what each produced, and the MCP calls run between them."""

    def __init__(self, s: ApiState, body, prepare):
        self.s, self.body, self.prepare = s, body, prepare
        own = list(body.tools or [])
        taken = {t.function.name for t in own}
        # A name clash: the request's own tool wins (its client asked for it by that name).
        mcp = {name: t for name, (_, t) in s.mcp.tools().items() if name not in taken}
        self.mcp_names = set(mcp)
        self.tools = own + [msgspec.convert(function_tool(t), Tool) for t in mcp.values()]
        self.states: list[ChoiceState] = []
        self.prompt_tokens = 0
        self.calls: list[dict] = []  # every MCP call run: id, name, arguments, result, is_error
        self.held: set[int] = set()  # the latest round's MCP call indices, kept from the client

    async def round(self, messages, choice, first: bool):
        """(prompt ids, params, parse spec) of one round; a bad request fails here (a 400 when first)."""
        body = msgspec.structs.replace(self.body, messages=messages, tools=self.tools, tool_choice=choice)
        if not first:  # the conversation now ends with tool results: a new assistant turn answers them
            body = msgspec.structs.replace(body, continue_final_message=False, add_generation_prompt=None,
                                           prompt_logprobs=None)
        params = sampling_params(body, chat=True, max_n=self.s.opts.max_n)
        ids, spec = await self.s.offload(self.prepare, self.s, body, params)
        self.s.check([ids], params)
        return ids, params, spec

    async def events(self, rid: str, first):
        """The client's part of every round, in order: TextDeltas (MCP call pieces left out), None for a
        keep-alive, and after each round of MCP calls the list of them. The last state is the reply."""
        s, messages, choice = self.s, list(self.body.messages), self.body.tool_choice
        prepared = first
        for n in range(s.opts.mcp_max_rounds + 1):
            ids, params, spec = prepared or await self.round(messages, choice, False)
            st, self.held = ChoiceState(), set()
            self.states.append(st)
            self.prompt_tokens += len(ids)
            async for _, o in merged(s, f"{rid}.{n}", [ids], params, spec):
                if o is not None:
                    st.add(o)
                    self.held.update(c.index for c in o.tool_calls if c.name in self.mcp_names)
                    if self.held and o.tool_calls:
                        o = msgspec.structs.replace(o, tool_calls=[c for c in o.tool_calls if c.index not in self.held])
                yield o
            calls = st.tool_calls()
            ours = [c for c in calls if c["function"]["name"] in self.mcp_names]
            # The reply is returned as it is when it has no MCP call, calls one of the request's own
            # tools (its client runs those), was cut short, or came after the last round.
            if not ours or len(ours) < len(calls) or st.finish_reason != "tool_calls" or n == s.opts.mcp_max_rounds:
                return
            job = asyncio.ensure_future(asyncio.gather(*(
                s.mcp.call(c["function"]["name"], c["function"]["arguments"]) for c in ours)))
            try:
                while not job.done():
                    await asyncio.wait({job}, timeout=s.opts.keepalive_s or None)
                    if not job.done():
                        yield None
            finally:
                job.cancel()  # the client went away meanwhile
            done = [{"id": c["id"], "name": c["function"]["name"], "arguments": c["function"]["arguments"],
                     "result": text, "is_error": failed} for c, (text, failed) in zip(ours, job.result())]
            self.calls += done
            yield done
            messages.append(msgspec.convert({"role": "assistant", "content": "".join(st.content) or None,
                                             "tool_calls": ours}, Message))
            messages += [msgspec.convert({"role": "tool", "tool_call_id": d["id"], "name": d["name"],
                                          "content": d["result"]}, Message) for d in done]
            # A forced choice (a name, "required") was for the first round; after it the model answers.
            if choice not in (None, "auto"):
                choice = "none"
            prepared = None

    async def usage(self) -> dict:
        sts = self.states
        return usage(self.prompt_tokens, sum(st.tokens for st in sts), sum(st.cached for st in sts),
                     await reasoning_tokens(self.s, sts))

    def held_calls(self) -> list[dict]:
        """The last reply's MCP calls that were not run (it came after the last round), as stream deltas."""
        st = self.states[-1]
        return [{"index": i, **st.calls[i]} for i in sorted(self.held)]


async def respond(s: ApiState, request, body, prepare):
    """The answer to a chat request with MCP tools; `prepare`: chat.prepare."""
    rounds = Rounds(s, body, prepare)
    first = await rounds.round(list(body.messages), body.tool_choice, True)
    rid = "chatcmpl-" + uuid.uuid4().hex
    base = {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": s.model_name}
    if body.stream:
        return await _stream(s, request, body, rounds, rid, base, first)
    async with contextlib.aclosing(rounds.events(rid, first)) as events:
        async for _ in events:
            pass
    st, sts = rounds.states[-1], rounds.states
    # The text of every round, as a stream client reads it.
    msg = {"role": "assistant", "content": "".join(t for x in sts for t in x.content) or (None if st.calls else "")}
    reasoning = "".join(t for x in sts for t in x.reasoning)
    if reasoning:
        msg["reasoning_content"] = msg["reasoning"] = reasoning
    if st.calls:
        msg["tool_calls"] = st.tool_calls()
    if rounds.calls:
        msg["mcp_calls"] = rounds.calls
    lp = None
    if body.logprobs:
        lp = {"content": chat_logprobs(s.strs, [i for x in sts for i in x.logprob_ids],
                                       [e for x in sts for e in x.logprobs])}
    choice = {"index": 0, "message": msg, "logprobs": lp, "finish_reason": st.finish_reason}
    log_chat(s, body, [choice])
    return response.json({**base, "choices": [choice], "usage": await rounds.usage()})


async def _stream(s: ApiState, request, body, rounds: Rounds, rid, base, first):
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    resp = await request.respond(content_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def send(delta, finish=None, lp=None):
        payload = {**base, "object": "chat.completion.chunk",
                   "choices": [{"index": 0, "delta": delta, "logprobs": lp, "finish_reason": finish}]}
        if include_usage:
            payload["usage"] = None
        await resp.send("data: " + dumps(payload) + "\n\n")

    try:
        await send({"role": "assistant", "content": ""})
        seen: set = set()
        async with contextlib.aclosing(rounds.events(rid, first)) as events:
            async for ev in events:
                if ev is None:
                    await resp.send(": keep-alive\n\n")
                elif isinstance(ev, list):  # a round of MCP calls ran: the annotation chunk
                    await send({"mcp_calls": ev})
                    seen = set()
                else:
                    delta = chat_delta(ev, seen)
                    lp = {"content": chat_logprobs(s.strs, unpack_ids(ev.logprob_token_ids), ev.logprobs)} \
                        if ev.logprobs else None
                    if delta or lp:
                        await send(delta, lp=lp)
        held = rounds.held_calls()
        if held:
            await send({"tool_calls": held})
        st = rounds.states[-1]
        await send({}, st.finish_reason)
        if include_usage:
            await resp.send("data: " + dumps({**base, "object": "chat.completion.chunk", "choices": [],
                                               "usage": await rounds.usage()}) + "\n\n")
        log_chat(s, body, [{"index": 0, "message": {"content": "".join(t for x in rounds.states for t in x.content),
                                                     "tool_calls": st.tool_calls(), "mcp_calls": rounds.calls},
                             "finish_reason": st.finish_reason}])
    except Exception as e:  # the stream has started: report in-band, then end it
        await resp.send("data: " + dumps({"error": stream_error(rid, e).body()["error"]}) + "\n\n")
    await resp.send("data: [DONE]\n\n")
    await resp.eof()
