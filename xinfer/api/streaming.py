"""The answers of /v1/chat/completions and /v1/completions, whole or streamed (SSE): the engine's
TextDeltas of every prompt and choice, merged and shaped into OpenAI's JSON."""
from __future__ import annotations

import asyncio
import json
import logging
import os
import time
import uuid

import msgspec

from sanic import response

from xinfer import envs
from xinfer.api.protocol import ApiError, usage
from xinfer.api.responses import (ChoiceState, chat_delta, chat_logprobs, completion_logprobs,
                                  merge_completion_logprobs, prompt_logprobs)
from xinfer.api.state import ApiState
from xinfer.errors import InvalidRequestError
from xinfer.ipc.step import unpack_ids

log = logging.getLogger("xinfer.api")


async def merged(s: ApiState, rid, prompts, params, spec):
    """Every prompt's choices: (global choice index, TextDelta or None for keep-alive). Many prompts
    are admitted to the engine in chunks of a running batch's worth, the next as one finishes: the
    engine's queue (and --max-queue-wait) only sees what can start soon, and results stream meanwhile."""
    q: asyncio.Queue = asyncio.Queue()
    chunk = asyncio.Semaphore(max(1, s.config.max_num_seqs // params.n))

    async def run(p_i, ids):
        try:
            async with chunk:
                async for o in s.client.generate(f"{rid}-{p_i}", ids, params, spec, s.opts.keepalive_s):
                    await q.put((p_i * params.n + o.index, o) if o is not None else (None, None))
        except Exception as e:
            await q.put((None, e))
        finally:
            await q.put((None, StopAsyncIteration()))

    loop = asyncio.get_running_loop()
    tasks = [loop.create_task(run(p_i, ids)) for p_i, ids in enumerate(prompts)]
    limit = s.opts.request_timeout
    # --request-timeout: past it the request is ended here and its choices aborted (the finally below)
    timer = loop.call_later(limit, q.put_nowait, (None, ApiError(
        f"the request did not finish within --request-timeout {limit:g}s; ask for fewer tokens or prompts",
        status=408, kind="timeout_error", code="request_timeout"))) if limit else None
    try:
        left = len(tasks)
        while left:
            idx, o = await q.get()
            if isinstance(o, StopAsyncIteration):
                left -= 1
            elif isinstance(o, Exception):
                raise o
            else:
                yield idx, o
    finally:
        if timer is not None:
            timer.cancel()
        for t in tasks:
            t.cancel()


async def reasoning_tokens(s: ApiState, states) -> int:
    texts = ["".join(st.reasoning) for st in states]
    if not any(texts):
        return 0
    return await s.offload(lambda: sum(len(s.tok.encode(t, add_special_tokens=False)) for t in texts if t))


async def _usage(s: ApiState, prompts, n, states) -> dict:
    return usage(sum(len(p) for p in prompts) * n, sum(st.tokens for st in states),
                 sum(st.cached for st in states), await reasoning_tokens(s, states))


def _scored(params, states, p_i) -> list:
    """Prompt p_i's logprobs entries: the prompt is scored by its first choice (n > 1 siblings
    share its KV blocks)."""
    return states[p_i * params.n].prompt_logprobs or []


def _echoed(s: ApiState, body, prompts, params, states, idx) -> tuple[str, dict | None]:
    """Echo: the prompt's text and, with logprobs, its scored tokens."""
    p_i = idx // params.n
    lp = None
    if params.logprobs is not None:
        lp = completion_logprobs(s.strs, prompts[p_i], _scored(params, states, p_i), 0)
    return _echo(s, body, prompts, p_i), lp


def _echo(s: ApiState, body, prompts, p_i) -> str:
    p = body.prompt
    if isinstance(p, str):
        return p
    if isinstance(p[0], str):
        return p[p_i]
    return s.tok.decode(prompts[p_i], skip_special_tokens=False)


async def respond(s: ApiState, request, body, prompts, params, spec, chat: bool):
    """The answer to a chat or completions request: one JSON body, or an SSE stream with `stream`."""
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
    base = {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": s.model_name}
    if body.stream:
        return await _stream(s, request, rid, base, prompts, params, spec, chat, body)
    n = params.n
    states = [ChoiceState() for _ in range(len(prompts) * n)]
    async for idx, o in merged(s, rid, prompts, params, spec):
        if o is not None:
            states[idx].add(o)
    choices, top = [], {}
    scored = params.prompt_logprobs is not None  # as vLLM: also when echo + logprobs asked for them
    for idx, st in enumerate(states):
        if chat:
            msg = {"role": "assistant", "content": "".join(st.content) or (None if st.calls else "")}
            reasoning = "".join(st.reasoning)
            if reasoning:
                msg["reasoning_content"] = msg["reasoning"] = reasoning  # as chat_delta
            if st.calls:
                msg["tool_calls"] = st.tool_calls()
            lp = {"content": chat_logprobs(s.strs, st.logprob_ids, st.logprobs)} if params.logprobs is not None \
                else None
            choices.append({"index": idx, "message": msg, "logprobs": lp, "finish_reason": st.finish_reason})
        else:
            text, lp = "".join(st.content), None
            if body.echo:
                prefix, lp = _echoed(s, body, prompts, params, states, idx)
                text = prefix + text
            if params.logprobs is not None:
                start = len(text) - len("".join(st.content))
                lp = merge_completion_logprobs(lp, completion_logprobs(s.strs, st.logprob_ids, st.logprobs,
                                                                       start))
            choices.append({"index": idx, "text": text, "logprobs": lp, "finish_reason": st.finish_reason})
            if scored:  # vLLM's place for them in a completion: each choice
                p_i = idx // n
                choices[-1]["prompt_logprobs"] = prompt_logprobs(s.strs, prompts[p_i], _scored(params, states, p_i))
    if chat:
        log_chat(s, body, choices)
        if scored:  # and in a chat completion: the response (one prompt)
            top["prompt_logprobs"] = prompt_logprobs(s.strs, prompts[0], _scored(params, states, 0))
    return response.json({**base, "choices": choices, "usage": await _usage(s, prompts, n, states), **top})


async def _stream(s: ApiState, request, rid, base, prompts, params, spec, chat, body):
    options = body.stream_options
    include_usage = bool(options and options.include_usage)
    continuous = bool(options and options.continuous_usage_stats)
    chunk_kind = "chat.completion.chunk" if chat else "text_completion"
    resp = await request.respond(content_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def send(choices, extra=None):
        payload = {**base, "object": chunk_kind, "choices": choices}
        if continuous:  # the usage so far (reasoning tokens are counted once, at the end)
            payload["usage"] = usage(sum(len(p) for p in prompts) * n, sum(st.tokens for st in states),
                                     sum(st.cached for st in states))
        elif include_usage:
            payload["usage"] = None
        payload.update(extra or {})
        await resp.send("data: " + dumps(payload) + "\n\n")

    n = params.n
    states = [ChoiceState() for _ in range(len(prompts) * n)]
    calls_seen = [set() for _ in states]
    text_len = [0] * len(states)
    try:
        if chat:
            for i in range(len(states)):  # one choice per chunk, as clients read choices[0]
                await send([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                             "finish_reason": None}])
        elif body.echo:
            for i in range(len(states)):
                text_len[i] = len(_echo(s, body, prompts, i // n))
        echoed = set()
        async for idx, o in merged(s, rid, prompts, params, spec):
            if o is None:
                await resp.send(": keep-alive\n\n")
                continue
            st = states[idx]
            st.add(o)
            reason = st.finish_reason if o.finish_reason else None
            if chat:
                delta = chat_delta(o, calls_seen[idx])
                lp = {"content": chat_logprobs(s.strs, unpack_ids(o.logprob_token_ids), o.logprobs)} \
                    if o.logprobs else None
                if delta or reason or lp:
                    await send([{"index": idx, "delta": delta, "logprobs": lp, "finish_reason": reason}])
                continue
            text, lp = o.text, None
            if body.echo and idx not in echoed:
                echoed.add(idx)
                prefix, lp = _echoed(s, body, prompts, params, states, idx)
                text = prefix + text
            if o.logprobs:
                lp = merge_completion_logprobs(lp, completion_logprobs(
                    s.strs, unpack_ids(o.logprob_token_ids), o.logprobs, text_len[idx]))
            text_len[idx] += len(o.text)
            if text or reason or lp:
                await send([{"index": idx, "text": text, "logprobs": lp, "finish_reason": reason}])
        if include_usage:
            await send([], {"usage": await _usage(s, prompts, n, states)})
        if chat:
            log_chat(s, body, [{"index": i, "message": {"content": "".join(st.content),
                                                         "reasoning_content": "".join(st.reasoning),
                                                         "tool_calls": st.tool_calls()},
                                 "finish_reason": st.finish_reason} for i, st in enumerate(states)])
    except Exception as e:  # the stream has started: report in-band, then end it
        await resp.send("data: " + dumps({"error": stream_error(rid, e).body()["error"]}) + "\n\n")
    await resp.send("data: [DONE]\n\n")
    await resp.eof()


def stream_error(rid: str, e: Exception) -> ApiError:
    """What a stream that failed after it started reports in-band (logged once)."""
    log.warning("stream %s failed: %s", rid, e)
    if isinstance(e, ApiError):
        return e
    if isinstance(e, InvalidRequestError):
        return ApiError(str(e), status=400, param=e.param, code=e.code)
    return ApiError(str(e), status=500, kind="server_error")


def log_chat(s: ApiState, body, choices):
    """XINFER_CHAT_LOGGER=1: one JSON line per conversation turn in ./log."""
    if not envs.chat_logger():
        return
    try:
        os.makedirs("log", exist_ok=True)
        line = dumps({"time": time.strftime("%Y-%m-%dT%H:%M:%S"), "model": s.model_name,
                       "messages": msgspec.to_builtins(body.messages), "choices": choices})
        with open(os.path.join("log", time.strftime("chat-%Y%m%d.jsonl")), "a") as f:
            f.write(line + "\n")
    except OSError as e:
        log.warning("chat logger: %s", e)


def dumps(obj) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
