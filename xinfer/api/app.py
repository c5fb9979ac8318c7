"""The API app: Sanic on uvloop. Validates requests, renders chat templates and tokenizes (in a thread
pool, never on the event loop), talks to the engine core over ZMQ and streams. Here: the factory, the
process lifecycle (start, parent watch, signals, drain, stop), the API key and the error answers;
the routes are in chat, completions, embeddings, tokenizer and info, the HTTP-level checks in guard."""
from __future__ import annotations

import asyncio
import functools
import hmac
import logging
import os
import signal
import ssl
import time

from sanic import Sanic, response
from sanic.exceptions import SanicException

from xinfer import process
from xinfer.api import anthropic, chat, completions, embeddings, guard, info, responses_api, tokenizer
from xinfer.api.engine_client import EngineClient
from xinfer.api.metrics import Metrics
from xinfer.api.protocol import ApiError
from xinfer.api.responses import TokenStrings
from xinfer.api.state import ApiOptions, ApiState
from xinfer.config import EngineConfig
from xinfer.errors import InvalidRequestError
from xinfer.ipc.topology import Topology
from xinfer.loader import load_model_info
from xinfer.mm import processor_for
from xinfer.parsers import choose_tool_parser, reasoning_markers

log = logging.getLogger("xinfer.api")


def create_app(config: EngineConfig, topology: Topology, max_queued_requests: int = 256, drain_timeout: float = 30.0,
               parent: int | None = None, ui_port: int | None = None, **options) -> Sanic:
    """The API app. It binds its engine sockets (`topology`), where the engine core (started by
    the supervisor) connects; `parent`, the supervisor's pid: the app stops when it is gone.
    `options` are ApiOptions fields."""
    opts = ApiOptions(**options)
    app = Sanic("xinfer", configure_logging=False)  # Sanic's loggers follow --log-level
    # No response timeout cuts a long generation; bodies and headers are kept small.
    app.config.RESPONSE_TIMEOUT = 7 * 24 * 3600
    app.config.REQUEST_MAX_SIZE = opts.max_request_bytes
    app.config.REQUEST_MAX_HEADER_SIZE = 8192
    s = app.ctx.state = _load_state(config, opts, max_queued_requests)
    app.ctx.ssl = _ssl_context(opts)
    s.launched = parent is None

    @app.before_server_start
    async def start(app):
        def engine_died():
            app.ctx.failed = True
            app.stop()
        app.ctx.failed = False
        s.client = EngineClient(topology, s.metrics, engine_died)
        app.ctx.pump = asyncio.get_running_loop().create_task(s.client.pump())
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
            loop.add_signal_handler(sig, lambda: s.draining or loop.create_task(drain()))
        loop.add_signal_handler(signal.SIGUSR1, lambda: setattr(s, "launched", True))
        process.started("xinfer::api")  # listening: the supervisor starts the engine core next

    async def drain():
        """Stop admitting (503), let in-flight requests finish up to the drain timeout,
        abort what is left, then stop the server (which stops the engine)."""
        s.draining = True
        c = s.client
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
        s.client.close()

    _error_handlers(app)
    if opts.access_log:
        _access_log(app)
    protected = _key_check(opts.api_key)
    for family in (info, tokenizer, chat, completions, embeddings, anthropic, responses_api):
        family.register(app, s, protected)
    guard.install(app, opts)  # the keep-alive and request timeouts too
    if ui_port:
        _listen_for_ui(app, ui_port)
    return app


def _ssl_context(opts: ApiOptions):
    """--ssl-certfile / --ssl-keyfile: a server-side TLS context (a bad file stops the start-up)."""
    if not opts.ssl_certfile and not opts.ssl_keyfile:
        return None
    if not (opts.ssl_certfile and opts.ssl_keyfile):
        raise ValueError("--ssl-certfile and --ssl-keyfile go together")
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        ctx.load_cert_chain(opts.ssl_certfile, opts.ssl_keyfile)
    except (OSError, ssl.SSLError) as e:
        raise ValueError(f"--ssl-certfile {opts.ssl_certfile} / --ssl-keyfile {opts.ssl_keyfile}: {e}") from None
    return ctx


def _load_state(config: EngineConfig, opts: ApiOptions, max_queued_requests: int) -> ApiState:
    # the tokenizer and config only, no weights
    info = load_model_info(config.model, config.load_format, config.read_chat_template())
    tok = info.tokenizer
    config.resolve_context(info.config)
    template = tok.chat_template if tok is not None else None
    arch = (info.config.get("architectures") or [None])[0]
    tool_parser = choose_tool_parser(arch, template, opts.enforce_parser)  # ValueError names the valid ones
    markers = reasoning_markers(template, opts.reasoning_parser)
    log.info("tool-call parser %s, reasoning markers %s", tool_parser, markers)
    names = opts.served_model_names or [info.name]
    s = ApiState(opts=opts, tok=tok, model_names=names,
                    vocab_size=info.config["vocab_size"], template=template, tool_parser=tool_parser,
                    markers=markers, strs=TokenStrings(tok), metrics=Metrics(names[0]), config=config,
                    max_queued_requests=max_queued_requests, hidden_size=info.config.get("hidden_size") or 0,
                    vision=processor_for(info.config, tok))
    if opts.embedding_model:  # torch comes into the API process with it, and only then
        from xinfer.api.embed_batcher import EmbedBatcher
        from xinfer.embedding_model import EmbeddingModel
        model = EmbeddingModel(opts.embedding_model, opts.embedding_pooling)
        log.info("embedding model %s (%s pooling, %d dimensions, up to %d tokens) serves /v1/embeddings",
                 model.name, model.pooling, model.hidden_size, model.max_len)
        s.embedder = EmbedBatcher(model, s.offload)
    return s


def _key_check(api_key: str | None):
    """The decorator of the routes that need the API key (all but /, /health and /metrics)."""
    def protected(handler):
        """The API key check, decided by the route itself (never by a URL rebuilt from headers)."""
        if not api_key:
            return handler
        want = ("Bearer " + api_key).encode()

        @functools.wraps(handler)
        async def check(request, *args, **kwargs):
            key = request.headers.get("x-api-key")  # Anthropic's clients send the key so
            got = (request.headers.get("authorization") or ("Bearer " + key if key else "")).encode()
            if not hmac.compare_digest(got, want):
                raise ApiError("invalid or missing API key (send 'Authorization: Bearer <key>' or 'x-api-key')",
                               status=401,
                               kind="authentication_error", code="invalid_api_key")
            return await handler(request, *args, **kwargs)
        return check
    return protected


def _error_handlers(app: Sanic) -> None:
    """Every error answer (the routes' and guard's) is made here, and logged here once."""
    def answer(request, e: ApiError):
        log.info("rejected %s %s: %d %s: %s", request.method, request.path, e.status, e.code or e.kind, e)
        headers = {"Retry-After": str(e.retry_after)} if e.retry_after else None
        body = anthropic.error_body(e) if anthropic.is_anthropic(request.path) else e.body()
        return response.json(body, status=e.status, headers=headers)

    @app.exception(ApiError)
    async def api_error(request, e: ApiError):
        return answer(request, e)

    @app.exception(InvalidRequestError)
    async def invalid(request, e):
        return answer(request, ApiError(str(e), param=e.param, code=e.code))

    @app.exception(SanicException)
    async def sanic_error(request, e):
        status = getattr(e, "status_code", 500)
        kind = {404: "not_found_error", 405: "invalid_request_error", 413: "invalid_request_error"}.get(
            status, "invalid_request_error" if status < 500 else "server_error")
        return answer(request, ApiError(str(e), status=status, kind=kind))

    @app.exception(Exception)
    async def unexpected(request, e):
        log.exception("request failed")
        return answer(request, ApiError(str(e) or type(e).__name__, status=500, kind="server_error"))


def _access_log(app: Sanic) -> None:
    """--access-log: one line per request (a stream's duration is until its headers went out)."""
    @app.on_request
    async def started(request):
        request.ctx.t0 = time.perf_counter()

    @app.on_response
    async def answered(request, resp):
        t0 = getattr(request.ctx, "t0", None)
        took = f"{(time.perf_counter() - t0) * 1000:.1f} ms" if t0 is not None else "-"
        log.info("%s %s %d %s", request.method, request.path, resp.status, took)


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
                              register_sys_signals=False, connections=set(), signal=Signal(),
                              protocol=guard.Protocol, ssl=app.ctx.ssl)
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
