"""The API process: Sanic on uvloop. Validates requests, renders chat templates and tokenizes
(in a thread pool, never on the event loop), talks to the engine core over ZMQ and streams."""
from __future__ import annotations

import asyncio
import functools
import hmac
import logging
import os
import shutil
import signal
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.asyncio
from sanic import Sanic, response
from sanic.exceptions import SanicException

from xinfer import __version__
from xinfer.api.metrics import Metrics
from xinfer.api.protocol import (ApiError, chat_text, completion_prompts, parse_body, parse_tools,
                                 sampling_params, usage)
from xinfer.api.responses import (ChoiceState, TokenStrings, chat_delta, chat_logprobs, completion_logprobs,
                                  merge_completion_logprobs)
from xinfer.config import EngineConfig
from xinfer.errors import InvalidRequestError, XinferError
from xinfer.ipc import launch
from xinfer.ipc.api import Abort, FromEngine, GenerateRequest, Ready, RequestError, Stats, ToEngine
from xinfer.ipc.channels import Codec, endpoint, socket
from xinfer.ipc.shm_ring import pid_alive
from xinfer.ipc.step import pack_ids, unpack_ids
from xinfer.ipc.text import ParseSpec, TextBatch
from xinfer.parsers import choose_tool_parser, get_tool_parser, reasoning_markers, starts_in_reasoning
from xinfer.loader import load_model_info

log = logging.getLogger("xinfer.api")
WEB_PAGE = Path(__file__).parent / "web" / "index.html"


class EngineClient:
    """The API side of the engine core: one queue per in-flight request. The supervisor starts
    the engine core; both find each other's sockets in the supervisor's runtime directory."""

    def __init__(self, rundir: str, metrics: Metrics, on_death):
        self.on_death = on_death
        self.metrics = metrics
        self.rundir = rundir
        self.ctx = zmq.asyncio.Context()
        in_addr, out_addr = endpoint(self.rundir, "to_engine"), endpoint(self.rundir, "from_engine")
        self.push = socket(self.ctx, zmq.PUSH, in_addr, bind=True)
        self.pull = socket(self.ctx, zmq.PULL, out_addr, bind=True)
        self.tx, self.rx = Codec(ToEngine), Codec(FromEngine | TextBatch)
        self.queues: dict[str, asyncio.Queue] = {}
        self.ready: Ready | None = None
        self.dead = False

    async def pump(self):
        """Route engine outputs to their requests; notice an engine that died."""
        while True:
            if await self.pull.poll(1000):
                msg = self.rx.decode(await self.pull.recv())
                if isinstance(msg, TextBatch):
                    for o in msg.items:
                        q = self.queues.get(o.request_id)
                        if q is not None:
                            q.put_nowait(o)
                elif isinstance(msg, RequestError):
                    q = self.queues.get(msg.request_id)
                    if q is not None:
                        q.put_nowait(InvalidRequestError(msg.message))
                elif isinstance(msg, Stats):
                    self.metrics.stats = msg
                elif isinstance(msg, Ready):
                    self.ready = msg
                    log.info("engine ready: %s, max_model_len %d", msg.model, msg.max_model_len)
            elif self.ready is not None and not pid_alive(self.ready.pid) and not self.dead:
                self.dead = True
                log.error("the engine core (pid %d) exited; stopping the server", self.ready.pid)
                for q in self.queues.values():
                    q.put_nowait(RuntimeError("the engine stopped"))
                await asyncio.sleep(0.2)  # let streams send their error event
                self.on_death()

    async def generate(self, request_id: str, prompt_ids: list[int], params, parse=None,
                       keepalive: float | None = None):
        """Yield the TextDeltas of one request until all its choices finish, trimmed of what was
        already sent (a restarted detokenizer/parser resends); None after `keepalive` s of silence."""
        if self.dead:
            raise RuntimeError("the engine stopped")
        q: asyncio.Queue = asyncio.Queue()
        self.queues[request_id] = q
        remaining = params.n
        m, start = self.metrics, time.monotonic()
        seen = [_Seen() for _ in range(params.n)]
        finished = set()
        first, last = True, start
        stop_after_call = parse is not None and parse.single_call
        getter = None
        try:
            await self.push.send(self.tx.encode(GenerateRequest(request_id, pack_ids(prompt_ids), params, parse)))
            while remaining:
                # Not asyncio.wait_for: on Python 3.11 it swallows a cancel that lands as an item
                # arrives, and a client that went away would never abort its request.
                getter = getter or asyncio.ensure_future(q.get())
                if not (await asyncio.wait({getter}, timeout=keepalive))[0]:
                    yield None
                    continue
                item, getter = getter.result(), None
                if isinstance(item, Exception):
                    raise item
                if item.index in finished:
                    continue
                new_tokens = seen[item.index].trim(item)
                if stop_after_call and item.tool_calls and not item.finish_reason:  # the call asked for is in
                    await self.push.send(self.tx.encode(Abort(request_id, item.index)))
                now = time.monotonic()
                if new_tokens:
                    if first:
                        m.ttft.labels(m.model).observe(now - start)
                        new_tokens -= 1
                        first = False
                    for _ in range(new_tokens):  # tokens that arrive together: spread over the gap
                        m.itl.labels(m.model).observe((now - last) / new_tokens)
                    last = now
                if item.finish_reason:
                    finished.add(item.index)
                    remaining -= 1
                    m.request_done(item.finish_reason, len(prompt_ids), item.total_tokens, item.queue_time)
                yield item
            m.e2e.labels(m.model).observe(time.monotonic() - start)
        finally:
            if getter is not None:
                getter.cancel()
            self.queues.pop(request_id, None)
            if remaining:  # the client went away (or an error): free the request's KV blocks now
                m.finished.labels(m.model, "abort").inc(remaining)
                await self.push.send(self.tx.encode(Abort(request_id)))

    def close(self):
        self.push.close()
        self.pull.close()


@dataclass
class ApiOptions:
    """`xinfer serve` flags of the API process (the engine's are in EngineConfig)."""
    api_key: str | None = None  # when set, every route but /, /health and /metrics needs it
    max_n: int = 16
    max_request_bytes: int = 8 << 20
    enforce_parser: str | None = None  # tool-call parser; None: chosen from the model
    disable_reasoning: bool = False  # the default of a request's `thinking` flag
    keepalive_s: float = 15.0  # SSE comment after this long without output


def create_app(config: EngineConfig, rundir: str, max_queued_requests: int = 256, drain_timeout: float = 30.0,
               parent: int | None = None, ui_port: int | None = None, **options) -> Sanic:
    """The API app. It binds its engine sockets in `rundir`, where the engine core (started by
    the supervisor) connects; `parent`, the supervisor's pid: the app stops when it is gone.
    `options` are ApiOptions fields."""
    opts = ApiOptions(**options)
    app = Sanic("xinfer", configure_logging=False)  # Sanic's loggers follow --log-level
    app.ctx.draining = False
    app.ctx.launched = parent is None  # under the supervisor: its SIGUSR1 says every process is ready
    # No response timeout cuts a long generation; bodies and headers are kept small.
    app.config.RESPONSE_TIMEOUT = 7 * 24 * 3600
    app.config.KEEP_ALIVE_TIMEOUT = 75
    app.config.REQUEST_MAX_SIZE = opts.max_request_bytes
    app.config.REQUEST_MAX_HEADER_SIZE = 8192
    info = load_model_info(config.model, config.load_format)  # tokenizer and config only, no weights
    tok = info.tokenizer
    model_name = info.name
    ctx_len = info.config.get("max_position_embeddings") or 4096
    max_model_len = config.max_model_len or min(ctx_len, 4096)
    metrics = Metrics(model_name)
    config.max_model_len = max_model_len
    vocab_size = info.config["vocab_size"]
    template = tok.chat_template if tok is not None else None
    arch = (info.config.get("architectures") or [None])[0]
    tool_parser = choose_tool_parser(arch, template, opts.enforce_parser)  # ValueError names the valid ones
    markers = reasoning_markers(template)
    strs = TokenStrings(tok)
    log.info("tool-call parser %s, reasoning markers %s", tool_parser, markers)

    @app.before_server_start
    async def start(app):
        def engine_died():
            app.ctx.failed = True
            app.stop()
        app.ctx.failed = False
        app.ctx.client = EngineClient(rundir, metrics, engine_died)
        app.ctx.pump = asyncio.get_running_loop().create_task(app.ctx.client.pump())
        if parent is not None:
            app.ctx.watch = asyncio.get_running_loop().create_task(watch_parent())

    async def watch_parent():
        """The supervisor was killed (even by SIGKILL): stop within a few seconds, no orphan."""
        while os.getppid() == parent:
            await asyncio.sleep(1)
        log.warning("the supervisor exited; stopping")
        app.ctx.failed = app.ctx.orphaned = True
        asyncio.get_running_loop().call_later(3, os._exit, 1)  # open connections must not hold us
        app.stop()

    @app.after_server_start
    async def on_signals(app):
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, lambda: app.ctx.draining or loop.create_task(drain()))
        loop.add_signal_handler(signal.SIGUSR1, lambda: setattr(app.ctx, "launched", True))
        launch.started("xinfer::api")  # listening: the supervisor starts the engine core next

    async def drain():
        """Stop admitting (503), let in-flight requests finish up to the drain timeout,
        abort what is left, then stop the server (which stops the engine)."""
        app.ctx.draining = True
        c: EngineClient = app.ctx.client
        log.info("draining %d requests (up to %.0fs)", len(c.queues), drain_timeout)
        deadline = time.monotonic() + drain_timeout
        while c.queues and time.monotonic() < deadline and not c.dead:
            await asyncio.sleep(0.05)
        for rid, q in list(c.queues.items()):
            q.put_nowait(RuntimeError("the server is shutting down"))
        await asyncio.sleep(0.1)  # let the aborted streams send their last event
        app.stop()

    @app.after_server_stop
    async def stop(app):
        app.ctx.pump.cancel()
        if parent is not None:
            app.ctx.watch.cancel()
        app.ctx.client.close()

    @app.exception(ApiError)
    async def api_error(request, e: ApiError):
        headers = {"Retry-After": str(e.retry_after)} if e.retry_after else None
        return response.json(e.body(), status=e.status, headers=headers)

    @app.exception(InvalidRequestError)
    async def invalid(request, e):
        return response.json(ApiError(str(e)).body(), status=400)

    @app.exception(SanicException)
    async def sanic_error(request, e):
        status = getattr(e, "status_code", 500)
        kind = {404: "not_found_error", 405: "invalid_request_error", 413: "invalid_request_error"}.get(
            status, "invalid_request_error" if status < 500 else "server_error")
        return response.json(ApiError(str(e), status=status, kind=kind).body(), status=status)

    @app.exception(Exception)
    async def unexpected(request, e):
        log.exception("request failed")
        return response.json(ApiError(str(e) or type(e).__name__, status=500, kind="server_error").body(),
                             status=500)

    def protected(handler):
        """The API key check, decided by the route itself (never by a URL rebuilt from headers)."""
        if not opts.api_key:
            return handler
        want = ("Bearer " + opts.api_key).encode()

        @functools.wraps(handler)
        async def check(request, *args, **kwargs):
            got = (request.headers.get("authorization") or "").encode()
            if not hmac.compare_digest(got, want):
                raise ApiError("invalid or missing API key (send 'Authorization: Bearer <key>')", status=401,
                               kind="authentication_error", code="invalid_api_key")
            return await handler(request, *args, **kwargs)
        return check

    @app.get("/")
    async def index(request):
        return await response.file(WEB_PAGE, mime_type="text/html")

    if ui_port:
        _listen_for_ui(app, ui_port)

    @app.get("/health")
    async def health(request):
        c = app.ctx.client
        status = ("dead" if c.dead else "draining" if app.ctx.draining else
                  "ok" if c.ready is not None and app.ctx.launched else "loading")
        return response.json({"status": status}, status=200 if status == "ok" else 503)

    @app.get("/metrics")
    async def prometheus(request):
        return response.raw(metrics.render(), content_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/version")
    @protected
    async def version(request):
        return response.json({"version": __version__})

    @app.get("/v1/models")
    @protected
    async def models(request):
        return response.json({"object": "list", "data": [_model_card(model_name, max_model_len)]})

    @app.get("/v1/models/<model_id:path>")
    @protected
    async def model(request, model_id):
        _check_model(model_id)
        return response.json(_model_card(model_name, max_model_len))

    def _check_model(name):
        if name is not None and name != model_name:
            raise ApiError(f"the model {name!r} does not exist; this server serves {model_name!r}", status=404,
                           kind="not_found_error", param="model", code="model_not_found")

    @app.post("/tokenize")
    @protected
    async def tokenize(request):
        body = parse_body(request)
        _need_tokenizer()
        loop = asyncio.get_running_loop()
        if body.get("messages") is not None:
            tools, _ = parse_tools(body)
            text = await loop.run_in_executor(None, chat_text, tok, body, tools, not opts.disable_reasoning)
            ids = tok.encode(text, add_special_tokens=bool(body.get("add_special_tokens", False)))
        elif isinstance(body.get("prompt"), str):
            ids = await loop.run_in_executor(None, functools.partial(
                tok.encode, body["prompt"], add_special_tokens=bool(body.get("add_special_tokens", True))))
        else:
            raise ApiError("send 'prompt' (a string) or 'messages'", param="prompt")
        out = {"count": len(ids), "max_model_len": max_model_len, "tokens": ids}
        if body.get("return_token_strs"):
            out["token_strs"] = [strs(t) for t in ids]
        return response.json(out)

    @app.post("/detokenize")
    @protected
    async def detokenize(request):
        body = parse_body(request)
        _need_tokenizer()
        ids = body.get("tokens")
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise ApiError("'tokens' must be a list of token ids", param="tokens")
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise ApiError(f"unknown token id {bad[0]} (vocabulary size {vocab_size})", param="tokens")
        skip = bool(body.get("skip_special_tokens", True))
        return response.json({"prompt": tok.decode(ids, skip_special_tokens=skip)})

    @app.get("/tokenizer_info")
    @protected
    async def tokenizer_info(request):
        _need_tokenizer()
        return response.json({
            "model": model_name, "vocab_size": vocab_size, "max_model_len": max_model_len,
            "bos_token": tok.bos_token or None, "bos_token_id": tok.bos_token_id,
            "eos_token": tok.eos_token or None, "eos_token_ids": tok.eos_token_ids,
            "add_bos_token": tok.add_bos, "chat_template": template,
            "tool_parser": tool_parser, "reasoning_markers": list(markers) if markers else None})

    def _admit():
        """503 with Retry-After while loading, draining or past the queue limit."""
        c = app.ctx.client
        if c.ready is None or c.dead or app.ctx.draining or not app.ctx.launched:
            why, retry = ("shutting down" if app.ctx.draining else "not ready"), 5
        elif len(c.queues) >= config.max_num_seqs + max_queued_requests:
            why, retry = f"full: too many requests queued (limit {max_queued_requests})", 1
        else:
            return
        metrics.rejected.labels(model_name).inc()
        raise ApiError(f"the server is {why}; retry later", status=503, kind="service_unavailable",
                       retry_after=retry)

    def _check_room(prompts, params):
        for ids in prompts:
            room = max_model_len - len(ids)
            if params.max_tokens is not None and params.max_tokens > room or room < 1:
                raise ApiError(f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the "
                               f"model's context length ({max_model_len})", param="max_tokens",
                               code="context_length_exceeded")

    def _need_tokenizer():
        if tok is None:
            raise ApiError("this model has no tokenizer: send token ids to /v1/completions", param="prompt")

    def _chat_prepare(body):
        """(prompt ids, what the parser process does with the output) for a chat request."""
        _need_tokenizer()
        tools, choice = parse_tools(body)
        text = chat_text(tok, body, tools, not opts.disable_reasoning, describe_tools=choice is not None)
        spec = ParseSpec(reasoning=markers, id_prefix="call_" + uuid.uuid4().hex[:24])
        if choice is not None:
            # A model whose template has no call format of its own is asked for plain JSON.
            spec.tool_parser = tool_parser if tool_parser != "passthrough" else "json"
            spec.tools = tools
            if choice != "auto":
                prefix = get_tool_parser(spec.tool_parser).forced_prefix(None if choice == "required" else choice)
                if prefix:
                    spec.prefix = prefix
                    text += prefix
                spec.single_call = choice != "required"
        spec.in_reasoning = bool(markers) and starts_in_reasoning(text, markers)
        return tok.encode(text, add_special_tokens=False), spec

    @app.post("/v1/chat/completions")
    @protected
    async def chat_completions(request):
        _admit()
        body = parse_body(request)
        _check_model(body.get("model"))
        params = sampling_params(body, vocab_size, chat=True, max_n=opts.max_n)
        ids, spec = await asyncio.get_running_loop().run_in_executor(None, _chat_prepare, body)
        _check_room([ids], params)
        return await _respond(request, body, [ids], params, spec, chat=True)

    @app.post("/v1/completions")
    @protected
    async def completions(request):
        _admit()
        body = parse_body(request)
        _check_model(body.get("model"))
        params = sampling_params(body, vocab_size, chat=False, max_n=opts.max_n)
        prompts = await asyncio.get_running_loop().run_in_executor(None, completion_prompts, tok, body, vocab_size)
        _check_room(prompts, params)
        return await _respond(request, body, prompts, params, None, chat=False)

    async def _merged(c, rid, prompts, params, spec):
        """Every prompt's choices at once: (global choice index, TextDelta or None for keep-alive)."""
        q: asyncio.Queue = asyncio.Queue()

        async def run(p_i, ids):
            try:
                async for o in c.generate(f"{rid}-{p_i}", ids, params, spec, opts.keepalive_s):
                    await q.put((p_i * params.n + o.index, o) if o is not None else (None, None))
            except Exception as e:
                await q.put((None, e))
            finally:
                await q.put((None, StopAsyncIteration()))

        tasks = [asyncio.get_running_loop().create_task(run(p_i, ids)) for p_i, ids in enumerate(prompts)]
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
            for t in tasks:
                t.cancel()

    async def _reasoning_tokens(states) -> int:
        texts = ["".join(st.reasoning) for st in states]
        if not any(texts):
            return 0
        return await asyncio.get_running_loop().run_in_executor(
            None, lambda: sum(len(tok.encode(t, add_special_tokens=False)) for t in texts if t))

    async def _usage(prompts, n, states) -> dict:
        return usage(sum(len(p) for p in prompts) * n, sum(st.tokens for st in states),
                     sum(st.cached for st in states), await _reasoning_tokens(states))

    def _echoed(body, prompts, params, states, idx) -> tuple[str, dict | None]:
        """Echo: the prompt's text and, with logprobs, its scored tokens. The prompt is scored by
        its first choice (n > 1 siblings share its KV blocks)."""
        p_i = idx // params.n
        lp = None
        if params.logprobs is not None:
            lp = completion_logprobs(strs, prompts[p_i], states[p_i * params.n].prompt_logprobs or [], 0)
        return _echo(body, prompts, p_i), lp

    def _echo(body, prompts, p_i) -> str:
        p = body["prompt"]
        if isinstance(p, str):
            return p
        if isinstance(p[0], str):
            return p[p_i]
        return tok.decode(prompts[p_i], skip_special_tokens=False)

    async def _respond(request, body, prompts, params, spec, chat: bool):
        c: EngineClient = app.ctx.client
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        base = {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
                "model": model_name}
        if body.get("stream"):
            return await _stream(request, c, rid, base, prompts, params, spec, chat, body)
        n = params.n
        states = [ChoiceState() for _ in range(len(prompts) * n)]
        async for idx, o in _merged(c, rid, prompts, params, spec):
            if o is not None:
                states[idx].add(o)
        choices = []
        for idx, st in enumerate(states):
            if chat:
                msg = {"role": "assistant", "content": "".join(st.content) or (None if st.calls else "")}
                reasoning = "".join(st.reasoning)
                if reasoning:
                    msg["reasoning_content"] = reasoning
                if st.calls:
                    msg["tool_calls"] = st.tool_calls()
                lp = {"content": chat_logprobs(strs, st.logprob_ids, st.logprobs)} if params.logprobs is not None \
                    else None
                choices.append({"index": idx, "message": msg, "logprobs": lp, "finish_reason": st.finish_reason})
            else:
                text, lp = "".join(st.content), None
                if body.get("echo"):
                    prefix, lp = _echoed(body, prompts, params, states, idx)
                    text = prefix + text
                if params.logprobs is not None:
                    start = len(text) - len("".join(st.content))
                    lp = merge_completion_logprobs(lp, completion_logprobs(strs, st.logprob_ids, st.logprobs,
                                                                           start))
                choices.append({"index": idx, "text": text, "logprobs": lp, "finish_reason": st.finish_reason})
        if chat:
            _log_chat(body, choices)
        return response.json({**base, "choices": choices, "usage": await _usage(prompts, n, states)})

    async def _stream(request, c, rid, base, prompts, params, spec, chat, body):
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        chunk_kind = "chat.completion.chunk" if chat else "text_completion"
        resp = await request.respond(content_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

        async def send(choices, extra=None):
            payload = {**base, "object": chunk_kind, "choices": choices}
            if include_usage:
                payload["usage"] = None
            payload.update(extra or {})
            await resp.send("data: " + _dumps(payload) + "\n\n")

        n = params.n
        states = [ChoiceState() for _ in range(len(prompts) * n)]
        calls_seen = [set() for _ in states]
        text_len = [0] * len(states)
        try:
            if chat:
                for i in range(len(states)):  # one choice per chunk, as clients read choices[0]
                    await send([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                 "finish_reason": None}])
            elif body.get("echo"):
                for i in range(len(states)):
                    text_len[i] = len(_echo(body, prompts, i // n))
            echoed = set()
            async for idx, o in _merged(c, rid, prompts, params, spec):
                if o is None:
                    await resp.send(": keep-alive\n\n")
                    continue
                st = states[idx]
                st.add(o)
                reason = st.finish_reason if o.finish_reason else None
                if chat:
                    delta = chat_delta(o, calls_seen[idx])
                    lp = {"content": chat_logprobs(strs, unpack_ids(o.logprob_token_ids), o.logprobs)} \
                        if o.logprobs else None
                    if delta or reason or lp:
                        await send([{"index": idx, "delta": delta, "logprobs": lp, "finish_reason": reason}])
                    continue
                text, lp = o.text, None
                if body.get("echo") and idx not in echoed:
                    echoed.add(idx)
                    prefix, lp = _echoed(body, prompts, params, states, idx)
                    text = prefix + text
                if o.logprobs:
                    lp = merge_completion_logprobs(lp, completion_logprobs(
                        strs, unpack_ids(o.logprob_token_ids), o.logprobs, text_len[idx]))
                text_len[idx] += len(o.text)
                if text or reason or lp:
                    await send([{"index": idx, "text": text, "logprobs": lp, "finish_reason": reason}])
            if include_usage:
                await send([], {"usage": await _usage(prompts, n, states)})
            if chat:
                _log_chat(body, [{"index": i, "message": {"content": "".join(st.content),
                                                          "reasoning_content": "".join(st.reasoning),
                                                          "tool_calls": st.tool_calls()},
                                  "finish_reason": st.finish_reason} for i, st in enumerate(states)])
        except Exception as e:  # the stream has started: report in-band, then end it
            log.warning("stream %s failed: %s", rid, e)
            await resp.send("data: " + _dumps({"error": ApiError(str(e), status=500, kind="server_error")
                                               .body()["error"]}) + "\n\n")
        await resp.send("data: [DONE]\n\n")
        await resp.eof()

    def _log_chat(body, choices):
        """XINFER_CHAT_LOGGER=1: one JSON line per conversation turn in ./log."""
        if os.environ.get("XINFER_CHAT_LOGGER") != "1":
            return
        try:
            os.makedirs("log", exist_ok=True)
            line = _dumps({"time": time.strftime("%Y-%m-%dT%H:%M:%S"), "model": model_name,
                           "messages": body.get("messages"), "choices": choices})
            with open(os.path.join("log", time.strftime("chat-%Y%m%d.jsonl")), "a") as f:
                f.write(line + "\n")
        except OSError as e:
            log.warning("chat logger: %s", e)

    return app


class _Seen:
    """How much of one choice's streams the client has: resent parts are cut off."""

    def __init__(self):
        self.content = self.reasoning = self.tokens = 0
        self.args: dict[int, int] = {}  # tool call index -> argument characters sent
        self.prompt_logprobs = False

    def trim(self, o) -> int:
        """Cut what was sent already out of `o`; returns how many new tokens it brings."""
        o.text, self.content = _cut(o.text, o.offset, self.content)
        o.reasoning, self.reasoning = _cut(o.reasoning, o.reasoning_offset, self.reasoning)
        calls = []
        for c in o.tool_calls:
            have = self.args.get(c.index)
            if have is not None:
                c.id = c.name = None
            c.arguments, self.args[c.index] = _cut(c.arguments, c.offset, have or 0)
            if have is None or c.arguments:
                calls.append(c)
        o.tool_calls = calls
        new = max(0, o.total_tokens - self.tokens)
        if o.logprobs:
            skip = max(0, len(o.logprobs) - new)
            o.logprobs = o.logprobs[skip:]
            o.logprob_token_ids = o.logprob_token_ids[4 * skip:]  # int32 ids
        self.tokens = max(self.tokens, o.total_tokens)
        if o.prompt_logprobs is not None:
            if self.prompt_logprobs:
                o.prompt_logprobs = None
            self.prompt_logprobs = True
        return new


def _cut(text: str, offset: int, have: int) -> tuple[str, int]:
    """(the part of text at `offset` not yet sent, the new sent length)."""
    end = offset + len(text)
    return text[max(0, have - offset):], max(have, end)


def _model_card(name, max_model_len):
    return {"id": name, "object": "model", "created": 0, "owned_by": "xinfer", "max_model_len": max_model_len}


def _dumps(obj) -> str:
    import json
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def _listen_for_ui(app: Sanic, ui_port: int) -> None:
    """--ui-server: the same app also listens on ui_port (the chat page at /, and the API its page calls,
    so the page's same-origin fetches work on either port). A plain extra listener on the running loop:
    Sanic's own multi-server mode would run the app's stop listeners once per server."""
    from sanic.models.server_types import Signal
    from sanic.server.runners import serve as sanic_serve

    @app.after_server_start
    async def start_ui(app):
        host = app.state.host or "127.0.0.1"
        app.ctx.ui_server = None
        try:
            srv = sanic_serve(host, ui_port, app, loop=asyncio.get_running_loop(), run_async=True,
                              register_sys_signals=False, connections=set(), signal=Signal())
            app.ctx.ui_server = await srv
        except OSError as e:  # the API keeps serving (and its own / still has the page)
            log.error("web chat page: cannot listen on %s:%d: %s", host, ui_port, e)
            return
        log.info("web chat page on http://%s:%d/", host, ui_port)

    @app.before_server_stop
    async def stop_ui(app):
        srv = getattr(app.ctx, "ui_server", None)
        if srv is None:
            return
        srv.server.close()
        for conn in list(srv.connections):
            conn.close_if_idle()
        for _ in range(20):  # in-flight requests were already ended by the drain
            if not srv.connections:
                break
            await asyncio.sleep(0.05)
        for conn in list(srv.connections):
            conn.abort()


def serve(config: EngineConfig, rundir: str, host: str, port: int, log_level: str = "info",
          max_queued_requests: int = 256, drain_timeout: float = 30.0, parent: int | None = None,
          api_options: dict | None = None) -> None:
    """The API process, started by the supervisor (xinfer/launch.py); `api_options`: create_app's
    keyword arguments (ui_port and ApiOptions fields)."""
    from xinfer.cli import set_title, setup_logging

    name = "xinfer::api"
    setup_logging(log_level, name)
    set_title(name)
    try:
        app = create_app(config, rundir, max_queued_requests, drain_timeout, parent, **(api_options or {}))
    except Exception as e:  # a bad model path, an unreadable tokenizer: shown by the supervisor
        log.debug("start-up failed", exc_info=True)
        known = isinstance(e, (XinferError, OSError, ValueError))
        launch.failed(name, str(e) if known else f"{type(e).__name__}: {e}")
        raise SystemExit(1)
    log.info("serving %s on http://%s:%d", config.model or "the bundled SmolLM2-135M-Instruct", host, port)
    try:
        app.run(host=host, port=port, single_process=True, access_log=False, motd=False)
    except OSError as e:  # the port is taken
        launch.failed(name, f"cannot listen on {host}:{port}: {e.strerror or e}")
        raise SystemExit(1)
    if getattr(app.ctx, "orphaned", False):  # nobody waits for a clean exit: be gone at once
        shutil.rmtree(rundir, ignore_errors=True)
        logging.shutdown()
        os._exit(1)
    if app.ctx.failed:
        raise SystemExit(1)  # the engine died
