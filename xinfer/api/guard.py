"""HTTP-level checks, made before any route runs: the Host header (DNS rebinding), the Origin of a POST
(a web page on another site must not drive a local server) and CORS for --allowed-origins, JSON-only
POST bodies, a body over the limit answered before it is read, connections per client, and a
deadline for reading each whole request."""
from __future__ import annotations

import ipaddress
import logging
from collections import Counter
from time import monotonic

from sanic import Sanic, response
from sanic.exceptions import RequestTimeout
from sanic.http.constants import Stage
from sanic.server.protocols.http_protocol import HttpProtocol

from xinfer.api.protocol import ApiError
from xinfer.api.state import ApiOptions

log = logging.getLogger("xinfer.api")

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "[::1]")
DEFAULT_CONNECTIONS_PER_CLIENT = 64
# A body over the limit but under this is read and dropped after the 413, so that the client, still
# sending it, gets to read the answer (closing on unread bytes makes the kernel reset the connection).
DRAIN_BYTES = 64 << 20
PREFLIGHT = {"Access-Control-Allow-Methods": "GET, POST, OPTIONS", "Access-Control-Max-Age": "600"}


class Protocol(HttpProtocol):
    """Sanic's HTTP/1.1 protocol with a deadline for each whole request, head and body, from its first
    byte (REQUEST_TIMEOUT, --request-read-timeout): Sanic's own request timeout restarts with every
    packet and does not cover the body, so a client sending a byte a second would hold its
    connection for ever."""
    __slots__ = ("_read_since",)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._read_since: float | None = None  # when the request being read began to arrive

    def data_received(self, data: bytes):
        if self._read_since is None:
            self._read_since = monotonic()
        super().data_received(data)

    async def send(self, data):
        http = self._http
        if http is not None and not http.request_body:  # answering a request read in full
            self._read_since = None
        await super().send(data)

    def check_timeouts(self):
        http, since = self._http, self._read_since
        if (self._task and http is not None and since is not None and monotonic() - since > self.request_timeout
                and (http.stage is Stage.REQUEST or http.request_body)):
            http.exception = RequestTimeout(f"the request did not arrive within {self.request_timeout:g}s")
            http.keep_alive = False
            http.request_body = None  # close after the 408 instead of waiting for the rest
            self._task.cancel()
            return
        super().check_timeouts()


def install(app: Sanic, opts: ApiOptions) -> None:
    """The checks (signals on every connection and request), OPTIONS answers for CORS preflights, the
    CORS headers and the timeouts. Call once the routes are registered."""
    if not (opts.keep_alive_timeout > 0 and opts.request_read_timeout > 0):
        raise ValueError("--keep-alive-timeout and --request-read-timeout must be > 0 seconds")
    if opts.max_connections_per_client is not None and opts.max_connections_per_client < 0:
        raise ValueError("--max-connections-per-client must be >= 0 (0: no limit)")
    app.config.KEEP_ALIVE_TIMEOUT = opts.keep_alive_timeout
    app.config.REQUEST_TIMEOUT = opts.request_read_timeout
    origins = {o.rstrip("/").lower() for o in opts.allowed_origins}
    any_origin = "*" in origins
    hosts: frozenset[str] | None = None  # None: any Host; set when the server starts (its address)
    # Given, the cap counts every client; by default not loopback ones: a local proxy or benchmark
    # speaks for many clients through 127.0.0.1.
    cap = opts.max_connections_per_client
    count_loopback = cap is not None
    cap = DEFAULT_CONNECTIONS_PER_CLIENT if cap is None else cap
    open_per_ip: Counter[str] = Counter()

    def origin_allowed(origin: str) -> bool:
        return any_origin or origin.lower() in origins

    @app.before_server_start
    async def bind(app):
        nonlocal hosts
        bound = app.state.host or "127.0.0.1"
        hosts = allowed_hosts(opts.allowed_hosts, bound)
        if not is_loopback(bound) and not opts.api_key:
            log.warning("listening on %s without --api-key: anyone who can reach this address can use "
                        "the server", bound)

    @app.signal("http.lifecycle.begin")
    async def opened(conn_info):
        ip = conn_info.client_ip
        if not cap or not ip or (not count_loopback and is_loopback(ip)):
            return
        open_per_ip[ip] += 1
        conn_info.ctx.counted_as = ip
        conn_info.ctx.refused = open_per_ip[ip] > cap

    @app.signal("http.lifecycle.complete")
    async def closed(conn_info):
        ip = getattr(conn_info.ctx, "counted_as", None)
        if ip is not None:
            open_per_ip[ip] -= 1
            if not open_per_ip[ip]:
                del open_per_ip[ip]

    @app.signal("http.lifecycle.handle")
    async def check(request):
        """Before routing and before the body is read; a refusal is an ApiError answer."""
        http, headers = request.stream, request.headers
        if getattr(request.conn_info.ctx, "refused", False):
            http.keep_alive = False
            raise ApiError(f"too many connections from {request.conn_info.client_ip} (the limit is {cap}); "
                           "reuse connections or retry later", status=429, kind="rate_limit_error",
                           code="too_many_connections", retry_after=1)
        host = headers.get("host")
        if not host_allowed(hosts, host):
            raise ApiError(f"this server does not answer to the host {host!r} (see --allowed-hosts)",
                           status=421, code="misdirected_request")
        if request.method != "POST":
            return
        origin = headers.get("origin")
        if origin is not None and not same_origin(origin, host) and not origin_allowed(origin):
            raise ApiError(f"a cross-origin request from {origin!r} is not allowed (see --allowed-origins)",
                           status=403, kind="permission_error", code="origin_not_allowed")
        ctype = headers.get("content-type")
        if ctype is not None and ctype.partition(";")[0].strip().lower() != "application/json":
            raise ApiError(f"the request body must be JSON (Content-Type: application/json), not {ctype!r}",
                           status=415, code="unsupported_media_type")
        length = int(headers.get("content-length") or 0)  # Sanic has checked that it is a number
        if length > opts.max_request_bytes:
            http.keep_alive = False
            if http.expecting_continue:  # the client waits for "100 Continue": it gets the 413 instead
                http.expecting_continue = False
                http.request_body = None
            elif length <= max(DRAIN_BYTES, 2 * opts.max_request_bytes):
                http.request_max_size = http.protocol.request_max_size = length  # let the drain read it
            raise ApiError(f"the request body of {length} bytes is over the limit of {opts.max_request_bytes} "
                           "bytes (--max-request-bytes)", status=413, code="request_too_large")

    async def preflight(request, **_):
        return response.empty(headers={"Allow": "GET, POST, OPTIONS"})

    for i, uri in enumerate(sorted({r.uri for r in app.router.routes})):
        app.add_route(preflight, uri, methods=["OPTIONS"], name=f"preflight_{i}")

    if origins:
        @app.on_response
        async def cors(request, resp):
            origin = request.headers.get("origin")
            if origin is not None and origin_allowed(origin):
                resp.headers["Access-Control-Allow-Origin"] = origin
                resp.headers["Vary"] = "Origin"
                if request.method == "OPTIONS":
                    # what the page asks for: a trusted origin may send any header (the openai
                    # package adds its own x-stainless-* ones)
                    asked = request.headers.get("access-control-request-headers")
                    resp.headers.update(PREFLIGHT)
                    resp.headers["Access-Control-Allow-Headers"] = asked or "Authorization, Content-Type"


def allowed_hosts(given, bound: str) -> frozenset[str] | None:
    """The Host values answered (a name alone allows any port); None: any. By default only a server
    bound to loopback is picky: a DNS-rebinding page reaches it under its own name."""
    if given is not None:
        hosts = frozenset(h.lower() for h in given)
        return None if "*" in hosts else hosts
    if not is_loopback(bound):
        return None
    return frozenset({_bracketed(bound.lower()), *LOOPBACK_NAMES})


def host_allowed(hosts: frozenset[str] | None, host: str | None) -> bool:
    if hosts is None or host is None:  # no Host header: not a browser
        return True
    host = host.lower()
    return host in hosts or _hostname(host) in hosts


def same_origin(origin: str, host: str | None) -> bool:
    """The page's origin is this server's (host and port; the scheme is left out: behind a TLS proxy the
    page is https while this server speaks http)."""
    return bool(host) and origin.lower().partition("://")[2] == host.lower()


def is_loopback(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        addr = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return False
    return (getattr(addr, "ipv4_mapped", None) or addr).is_loopback


def _hostname(host: str) -> str:
    if host.startswith("["):
        return host[:host.find("]") + 1]
    return host.partition(":")[0]


def _bracketed(addr: str) -> str:
    return f"[{addr}]" if ":" in addr and not addr.startswith("[") else addr
