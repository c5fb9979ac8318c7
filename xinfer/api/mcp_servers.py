"""MCP servers the API process runs for the model (--mcp-config, --mcp-command): their config, their
start and supervision, their tools and the calls to them (with the `mcp` SDK's Client).

Each connection lives in a task of its own: the SDK's transports are anyio task groups, entered
and left in one task. A call never raises and never hangs: it answers (text, is_error), bound by
--mcp-timeout, a restart included. A server whose connection closed (it crashed) is restarted by
the next call to it; one that does not answer after a call timed out (hung) is dropped, so the next
call restarts it too."""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os

log = logging.getLogger("xinfer.api")

COMMAND_SERVER = "mcp"  # the name of the --mcp-command server
START_TIMEOUT = 60.0  # at start-up a server may take this long (npx and uvx fetch packages first)
MAX_RESULT = 64 << 10  # characters of a result given to the model; more is cut


def load_config(path: str | None, command: str | None = None, args: list[str] | None = None) -> dict | None:
    """{name: server spec} from --mcp-config FILE (Claude's / Cursor's `mcpServers` JSON) and
    --mcp-command CMD --mcp-args ...; None without either. A bad file is a ValueError naming it."""
    servers: dict = {}
    if path is not None:
        try:
            with open(path, encoding="utf-8") as f:
                doc = json.load(f)
        except OSError as e:
            raise ValueError(f"--mcp-config {path}: cannot read it: {e.strerror or e}") from None
        except ValueError as e:
            raise ValueError(f"--mcp-config {path}: not valid JSON: {e}") from None
        entries = doc.get("mcpServers") if isinstance(doc, dict) else None
        if not isinstance(entries, dict):
            raise ValueError(f"--mcp-config {path}: expected an object with 'mcpServers': {{name: server}}")
        for name, spec in entries.items():
            spec = _checked(name, spec, f"--mcp-config {path}: server {name!r}")
            if spec is not None:
                servers[name] = spec
    if args and command is None:
        raise ValueError("--mcp-args needs --mcp-command")
    if command is not None:
        if COMMAND_SERVER in servers:
            raise ValueError(f"--mcp-command: the config already has a server named {COMMAND_SERVER!r}")
        servers[COMMAND_SERVER] = {"command": command, "args": list(args or []), "env": {}}
    return servers or None


def _checked(name, spec, where: str) -> dict | None:
    """One server's entry, normalised; None when it is "disabled"."""
    if not isinstance(spec, dict):
        raise ValueError(f"{where}: expected an object")
    if spec.get("disabled"):
        return None
    if "command" in spec:
        cmd, args, env = spec["command"], spec.get("args", []), spec.get("env") or {}
        if not isinstance(cmd, str) or not cmd:
            raise ValueError(f"{where}: 'command' must be a non-empty string")
        if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
            raise ValueError(f"{where}: 'args' must be a list of strings")
        if not isinstance(env, dict) or not all(isinstance(v, str) for v in env.values()):
            raise ValueError(f"{where}: 'env' must map names to strings")
        return {"command": cmd, "args": args, "env": env, "cwd": spec.get("cwd")}
    if "url" in spec:
        kind = str(spec.get("type") or spec.get("transport") or "http").lower()
        if kind not in ("http", "streamable-http", "streamablehttp", "streamable_http", "sse"):
            raise ValueError(f"{where}: unknown transport {kind!r} (http or sse)")
        headers = spec.get("headers") or {}
        if not isinstance(spec["url"], str) or not isinstance(headers, dict):
            raise ValueError(f"{where}: 'url' must be a string and 'headers' an object")
        return {"url": spec["url"], "sse": kind == "sse", "headers": headers}
    raise ValueError(f"{where}: needs 'command' (a stdio server) or 'url' (an HTTP one)")


def _why(e: BaseException) -> str:
    """The first real error inside the SDK's nested exception groups."""
    while getattr(e, "exceptions", None):
        e = e.exceptions[0]
    if isinstance(e, (TimeoutError, asyncio.TimeoutError)):
        return "timed out"
    return str(e) or type(e).__name__


def result_text(res) -> tuple[str, bool]:
    """A CallToolResult as the text the model reads."""
    parts = [c.text if getattr(c, "text", None) is not None else f"[{c.type} content]" for c in res.content]
    if not parts and res.structured_content is not None:
        parts.append(json.dumps(res.structured_content, ensure_ascii=False))
    text = "\n".join(parts)
    if len(text) > MAX_RESULT:
        text = text[:MAX_RESULT] + " [cut]"
    return ("tool failed: " + text if res.is_error else text), bool(res.is_error)


def _no_inherit() -> None:
    """Sanic makes its listening socket inheritable (for worker processes it does not use here) and
    uvloop's spawn passes such fds on: an MCP server would hold the API port open past our exit."""
    fds = os.listdir("/proc/self/fd") if os.path.isdir("/proc/self/fd") else []
    for fd in map(int, fds):
        if fd > 2:
            try:
                os.set_inheritable(fd, False)
            except OSError:  # the listing's own fd, gone by now
                pass


@contextlib.asynccontextmanager
async def _http_with_headers(url: str, headers: dict):
    """Streamable HTTP with our headers: the SDK takes them only on an HTTP client we make and close."""
    from mcp.client.streamable_http import streamable_http_client
    from mcp.shared._httpx_utils import create_mcp_http_client  # with the SDK's own timeouts

    async with create_mcp_http_client(headers=headers) as http, \
            streamable_http_client(url, http_client=http) as streams:
        yield streams


class Server:
    """One MCP server: its live connection (or none) and its tools."""

    def __init__(self, name: str, spec: dict, timeout: float):
        self.name, self.spec, self.timeout = name, spec, timeout
        self.client = None  # the connected mcp.Client; None: (re)started by the next call
        self.tools: list = []  # mcp Tool objects of the latest connection
        self._closed: asyncio.Event | None = None  # set: the holder task leaves the connection
        self._tasks: set = set()  # every task of ours still running: the loop keeps only weak references
        self._lock = asyncio.Lock()

    def describe(self) -> str:
        s = self.spec
        return f"url {s['url']}" if "url" in s else "command " + " ".join([s["command"], *s["args"]])

    def _target(self):
        from mcp import StdioServerParameters
        s = self.spec
        if "command" not in s:
            logging.getLogger("httpx2").setLevel(logging.WARNING)  # not a log line per MCP message
            if s["sse"]:
                from mcp.client.sse import sse_client
                return sse_client(s["url"], headers=s["headers"] or None)
            if s["headers"]:
                return _http_with_headers(s["url"], s["headers"])
            return s["url"]
        _no_inherit()
        # The SDK hands a server only a few safe variables of ours (PATH, HOME, ...), never the
        # API key or the launch address; the config's env adds to them.
        return StdioServerParameters(command=s["command"], args=s["args"], env=s["env"] or None, cwd=s.get("cwd"))

    async def connect(self, timeout: float) -> None:
        """Start the server (or open its URL) and list its tools; raises with why not."""
        from mcp import Client

        loop = asyncio.get_running_loop()
        ready, closed = loop.create_future(), asyncio.Event()

        async def hold():
            try:
                async with Client(self._target()) as client:
                    tools, cursor = [], None
                    while True:  # every page of the listing
                        page = await client.list_tools(cursor=cursor)
                        tools += page.tools
                        cursor = page.next_cursor
                        if not cursor:
                            break
                    ready.set_result((client, tools))
                    await closed.wait()
            except BaseException as e:  # noqa: B036 (cancellation too: the waiter must hear of it)
                if not ready.done():
                    ready.set_exception(RuntimeError(_why(e)))
                elif not isinstance(e, asyncio.CancelledError):
                    log.warning("MCP server %r: connection ended: %s", self.name, _why(e))
            finally:
                if self.client is not None and self._closed is closed:
                    self.client = None

        task = self._spawn(hold())
        try:
            client, tools = await asyncio.wait_for(asyncio.shield(ready), timeout)
        except BaseException:
            ready.cancel()  # no one will read it now
            closed.set()
            task.cancel()
            raise
        self.drop()  # a previous connection, if any
        self.client, self.tools, self._closed = client, tools, closed
        log.info("MCP server %r (%s): %d tools: %s", self.name, self.describe(), len(tools),
                 ", ".join(t.name for t in tools))

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def drop(self) -> None:
        """Leave the connection (the SDK stops a stdio server); the next call starts a new one."""
        if self._closed is not None:
            self._closed.set()
        self.client = self._closed = None

    async def close(self) -> None:
        """Leave every connection, waiting a little for the SDK to stop the processes."""
        self.drop()
        if self._tasks:
            _, late = await asyncio.wait(list(self._tasks), timeout=5)
            for task in late:
                task.cancel()

    async def call(self, tool: str, args: dict) -> tuple[str, bool]:
        """Run one tool: (the text for the model, whether it failed). Never raises."""
        from mcp import MCPError
        from mcp_types import CONNECTION_CLOSED

        try:
            return await asyncio.wait_for(self._call(tool, args), self.timeout)
        except (TimeoutError, asyncio.TimeoutError):
            why = f"timed out after {self.timeout:g}s"
            self._spawn(self._check(self.client))
        except Exception as e:
            why = _why(e)
            # An error the server sent (bad arguments, unknown tool) leaves it running; a closed
            # or broken connection (it crashed) makes the next call start it again.
            if not isinstance(e, MCPError) or e.code == CONNECTION_CLOSED:
                self.drop()
        log.warning("MCP tool %s of server %r failed: %s", tool, self.name, why)
        return f"tool failed: {why}", True

    async def _call(self, tool: str, args: dict) -> tuple[str, bool]:
        async with self._lock:
            if self.client is None:
                log.warning("MCP server %r is not running; starting it", self.name)
                await self.connect(self.timeout)
        return result_text(await self.client.call_tool(tool, args))

    async def _check(self, client) -> None:
        """After a timeout: a server that does not answer a tool listing (the SDK's ping is gone from
        the newer protocol) is hung; drop it."""
        if client is None or client is not self.client:
            return
        try:
            await asyncio.wait_for(client.list_tools(cache_mode="bypass"), 5)
        except Exception:
            if client is self.client:
                log.warning("MCP server %r does not answer; it is restarted by the next call", self.name)
                self.drop()


class Servers:
    """Every configured server, and which one serves each tool name (the first that lists it)."""

    def __init__(self, specs: dict, timeout: float):
        self.servers = [Server(name, spec, timeout) for name, spec in specs.items()]

    async def start(self) -> None:
        """Connect to all at once; one that fails stops the start-up with a message naming it."""
        got = await asyncio.gather(*(srv.connect(max(srv.timeout, START_TIMEOUT)) for srv in self.servers),
                                   return_exceptions=True)
        for srv, e in zip(self.servers, got):
            if isinstance(e, BaseException):
                await self.close()
                why = _why(e)
                if why == "Connection closed":
                    why = "it closed the connection (exited?) before the MCP handshake; its output is above"
                raise RuntimeError(f"MCP server {srv.name!r} ({srv.describe()}) did not start: {why}") from None

    async def close(self) -> None:
        await asyncio.gather(*(srv.close() for srv in self.servers))

    def tools(self) -> dict:
        """{tool name: (server, mcp Tool)}; a name two servers list goes to the first."""
        out: dict = {}
        for srv in self.servers:
            for t in srv.tools:
                out.setdefault(t.name, (srv, t))
        return out

    async def call(self, name: str, arguments: str) -> tuple[str, bool]:
        entry = self.tools().get(name)
        if entry is None:  # a restarted server no longer lists it
            return f"tool failed: no MCP server offers {name!r} now", True
        try:
            args = json.loads(arguments or "{}")
        except ValueError as e:
            return f"tool failed: the arguments are not valid JSON: {e}", True
        if not isinstance(args, dict):
            return "tool failed: the arguments must be a JSON object", True
        return await entry[0].call(name, args)


def function_tool(t) -> dict:
    """An MCP tool as an OpenAI function tool."""
    fn = {"name": t.name, "parameters": t.input_schema or {"type": "object", "properties": {}}}
    if t.description:
        fn["description"] = t.description
    return {"type": "function", "function": fn}
