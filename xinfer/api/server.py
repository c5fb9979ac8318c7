"""The API process: Sanic on uvloop. Validates requests, renders chat templates and tokenizes
(in a thread pool, never on the event loop), talks to the engine core over ZMQ and streams."""
from __future__ import annotations

import asyncio
import logging
import os
import shutil
import signal
import time
import uuid
from pathlib import Path

import zmq
import zmq.asyncio
from sanic import Sanic, response
from sanic.exceptions import SanicException

from xinfer.api.metrics import Metrics
from xinfer.api.protocol import (ApiError, chat_prompt, completion_prompts, parse_body, sampling_params,
                                 usage)
from xinfer.config import EngineConfig
from xinfer.errors import InvalidRequestError, XinferError
from xinfer.ipc import launch
from xinfer.ipc.api import Abort, FromEngine, GenerateRequest, Ready, RequestError, Stats, ToEngine
from xinfer.ipc.text import TextBatch
from xinfer.ipc.channels import Codec, endpoint, socket
from xinfer.ipc.shm_ring import pid_alive
from xinfer.ipc.step import pack_ids
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

    async def generate(self, request_id: str, prompt_ids: list[int], params):
        """Yield the TextDeltas of one request until all its choices finish."""
        if self.dead:
            raise RuntimeError("the engine stopped")
        q: asyncio.Queue = asyncio.Queue()
        self.queues[request_id] = q
        remaining = params.n
        m, start, first = self.metrics, time.monotonic(), True
        seen = [0] * params.n  # characters received per choice: resends after a restart are trimmed
        finished = set()
        try:
            await self.push.send(self.tx.encode(GenerateRequest(request_id, pack_ids(prompt_ids), params)))
            while remaining:
                item = await q.get()
                if isinstance(item, Exception):
                    raise item
                if item.index in finished:
                    continue
                end = item.offset + len(item.text)
                if item.offset < seen[item.index]:
                    item.text = item.text[seen[item.index] - item.offset:]
                seen[item.index] = max(seen[item.index], end)
                if first:
                    m.ttft.labels(m.model).observe(time.monotonic() - start)
                    first = False
                if item.finish_reason:
                    finished.add(item.index)
                    remaining -= 1
                    m.finished.labels(m.model, item.finish_reason).inc()
                yield item
            m.e2e.labels(m.model).observe(time.monotonic() - start)
        finally:
            self.queues.pop(request_id, None)
            if remaining:  # the client went away (or an error): free the request's KV blocks now
                await self.push.send(self.tx.encode(Abort(request_id)))

    def close(self):
        self.push.close()
        self.pull.close()


def create_app(config: EngineConfig, rundir: str, max_queued_requests: int = 256, drain_timeout: float = 30.0,
               parent: int | None = None) -> Sanic:
    """The API app. It binds its engine sockets in `rundir`, where the engine core (started by
    the supervisor) connects; `parent`, the supervisor's pid: the app stops when it is gone."""
    app = Sanic("xinfer", configure_logging=False)  # Sanic's loggers follow --log-level
    app.ctx.draining = False
    app.ctx.launched = parent is None  # under the supervisor: its SIGUSR1 says every process is ready
    app.config.RESPONSE_TIMEOUT = 3600
    app.config.KEEP_ALIVE_TIMEOUT = 75
    info = load_model_info(config.model, config.load_format)  # tokenizer and config only, no weights
    tok = info.tokenizer
    model_name = info.name
    ctx_len = info.config.get("max_position_embeddings") or 4096
    max_model_len = config.max_model_len or min(ctx_len, 4096)
    metrics = Metrics(model_name)
    config.max_model_len = max_model_len

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
        return response.json(ApiError(str(e), status=status, kind="invalid_request_error"
                                      if status < 500 else "server_error").body(), status=status)

    @app.exception(Exception)
    async def unexpected(request, e):
        log.exception("request failed")
        return response.json(ApiError(str(e) or type(e).__name__, status=500, kind="server_error").body(),
                             status=500)

    @app.get("/")
    async def index(request):
        return await response.file(WEB_PAGE, mime_type="text/html")

    @app.get("/health")
    async def health(request):
        c = app.ctx.client
        ok = c.ready is not None and not c.dead and app.ctx.launched
        return response.json({"status": "ok" if ok else "loading" if not c.dead else "dead"},
                             status=200 if ok else 503)

    @app.get("/metrics")
    async def prometheus(request):
        return response.raw(metrics.render(), content_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models(request):
        return response.json({"object": "list", "data": [_model_card(model_name, max_model_len)]})

    @app.get("/v1/models/<model_id:path>")
    async def model(request, model_id):
        if model_id != model_name:
            raise ApiError(f"model {model_id!r} not found", status=404, kind="not_found_error", code="model_not_found")
        return response.json(_model_card(model_name, max_model_len))

    async def _prepare(request, chat: bool):
        _admit()
        body = parse_body(request)
        loop = asyncio.get_running_loop()
        if chat:
            prompts = [await loop.run_in_executor(None, chat_prompt, tok, body)]
        else:
            prompts = await loop.run_in_executor(None, completion_prompts, tok, body, info.config["vocab_size"])
        params = sampling_params(body, info.config["vocab_size"])
        for ids in prompts:
            room = max_model_len - len(ids)
            if params.max_tokens is not None and params.max_tokens > room or room < 1:
                raise ApiError(f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the "
                               f"model's context length ({max_model_len})", param="max_tokens",
                               code="context_length_exceeded")
        return body, prompts, params

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

    @app.post("/v1/chat/completions")
    async def chat_completions(request):
        body, prompts, params = await _prepare(request, chat=True)
        return await _respond(request, body, prompts, params, chat=True)

    @app.post("/v1/completions")
    async def completions(request):
        body, prompts, params = await _prepare(request, chat=False)
        return await _respond(request, body, prompts, params, chat=False)

    async def _respond(request, body, prompts, params, chat: bool):
        c: EngineClient = app.ctx.client
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        created = int(time.time())
        kind = "chat.completion" if chat else "text_completion"
        base = {"id": rid, "object": kind, "created": created, "model": model_name}
        if body.get("stream"):
            return await _stream(request, c, rid, base, prompts, params, chat, body)
        choices, cached = [], 0
        tokens = {}
        for p_i, ids in enumerate(prompts):
            texts, reasons = [""] * params.n, [None] * params.n
            async for o in c.generate(f"{rid}-{p_i}", ids, params):
                texts[o.index] += o.text
                tokens[(p_i, o.index)] = o.total_tokens
                if o.finish_reason:
                    reasons[o.index] = _finish(o.finish_reason)
                    cached += o.num_cached_tokens
            for i in range(params.n):
                idx = p_i * params.n + i
                if chat:
                    choices.append({"index": idx, "message": {"role": "assistant", "content": texts[i]},
                                    "logprobs": None, "finish_reason": reasons[i]})
                else:
                    choices.append({"index": idx, "text": texts[i], "logprobs": None, "finish_reason": reasons[i]})
        n_prompt = sum(len(p) for p in prompts)
        n_out = sum(tokens.values())
        return response.json({**base, "choices": choices, "usage": usage(n_prompt, n_out, cached)})

    async def _stream(request, c, rid, base, prompts, params, chat, body):
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

        cached = 0
        tokens = {}
        try:
            for p_i, ids in enumerate(prompts):
                if chat:
                    await send([{"index": p_i * params.n + i, "delta": {"role": "assistant", "content": ""},
                                 "logprobs": None, "finish_reason": None} for i in range(params.n)])
                async for o in c.generate(f"{rid}-{p_i}", ids, params):
                    tokens[(p_i, o.index)] = o.total_tokens
                    idx = p_i * params.n + o.index
                    reason = _finish(o.finish_reason) if o.finish_reason else None
                    cached += o.num_cached_tokens if reason else 0
                    if not o.text and not reason:
                        continue
                    if chat:
                        delta = {"content": o.text} if o.text else {}
                        await send([{"index": idx, "delta": delta, "logprobs": None, "finish_reason": reason}])
                    else:
                        await send([{"index": idx, "text": o.text, "logprobs": None, "finish_reason": reason}])
            if include_usage:
                await send([], {"usage": usage(sum(len(p) for p in prompts), sum(tokens.values()), cached)})
        except Exception as e:  # the stream has started: report in-band, then end it
            log.warning("stream %s failed: %s", rid, e)
            await resp.send("data: " + _dumps({"error": ApiError(str(e), status=500, kind="server_error")
                                               .body()["error"]}) + "\n\n")
        await resp.send("data: [DONE]\n\n")
        await resp.eof()

    return app


def _finish(reason: str) -> str:
    return "stop" if reason == "abort" else reason


def _model_card(name, max_model_len):
    return {"id": name, "object": "model", "created": 0, "owned_by": "xinfer", "max_model_len": max_model_len}


def _dumps(obj) -> str:
    import json
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def serve(config: EngineConfig, rundir: str, host: str, port: int, log_level: str = "info",
          max_queued_requests: int = 256, drain_timeout: float = 30.0, parent: int | None = None) -> None:
    """The API process, started by the supervisor (xinfer/launch.py)."""
    from xinfer.cli import set_title, setup_logging

    name = "xinfer::api"
    setup_logging(log_level, name)
    set_title(name)
    try:
        app = create_app(config, rundir, max_queued_requests, drain_timeout, parent)
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
