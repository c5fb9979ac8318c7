"""MCP tools run by the server (issue 21): an MCP server written here with the mcp SDK (stdio), started
by `xinfer serve --mcp-config`; the model is forced to call its tools on the first round, the server
runs them and the model answers. Errors, a hung tool, a crashed server, a bad config; the round loop
itself on a scripted engine."""
import asyncio
import json
import socket
import subprocess
import sys
import time
import types

import msgspec
import openai
import pytest

from tests.conftest import free_port, start_server, stop_server

pytest.importorskip("mcp.server.mcpserver")

from xinfer.api import mcp_chat, mcp_servers  # noqa: E402
from xinfer.api.schema import ChatRequest  # noqa: E402
from xinfer.api.state import ApiOptions  # noqa: E402
from xinfer.ipc.text import ParseSpec, TextDelta, ToolCallChunk  # noqa: E402

SERVER = '''
import asyncio, os
from mcp.server.mcpserver import MCPServer

app = MCPServer("test")

def note(s):
    with open(os.environ["MCP_TEST_LOG"], "a") as f:
        f.write(s + "\\n")

@app.tool()
def secret_word() -> str:
    """Returns the secret word."""
    note("secret_word")
    return "pineapple-42"

@app.tool()
def add(a: int, b: int) -> int:
    """Adds two integers."""
    note(f"add {a} {b}")
    return a + b

@app.tool()
def explode() -> str:
    """Always fails."""
    note("explode")
    raise RuntimeError("the tool exploded")

@app.tool()
async def sleepy() -> str:
    """Takes far too long."""
    note("sleepy")
    await asyncio.sleep(600)
    return "late"

@app.tool()
def crash() -> str:
    """Kills its own server."""
    note("crash")
    os._exit(3)

app.run()
'''

# One tool over HTTP: argv transport ("streamable-http" or "sse"), port, the tool's name.
WEB_SERVER = '''
import sys
from mcp.server.mcpserver import MCPServer

transport, port, name = sys.argv[1], int(sys.argv[2]), sys.argv[3]
app = MCPServer("web")

@app.tool(name=name)
def word() -> str:
    """Returns this server's word."""
    return f"{name} over {transport}"

app.run(transport, host="127.0.0.1", port=port)
'''

ASK = [{"role": "user", "content": "What is the secret word?"}]


def forced(name):
    return {"type": "function", "function": {"name": name}}


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    d = tmp_path_factory.mktemp("mcp")
    (d / "server.py").write_text(SERVER)
    log = d / "calls.txt"
    log.write_text("")
    (d / "web.py").write_text(WEB_SERVER)
    webs = {kind: (free_port(), name) for kind, name in (("streamable-http", "http_word"), ("sse", "sse_word"))}
    web_procs = [subprocess.Popen([sys.executable, str(d / "web.py"), kind, str(port), name],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                 for kind, (port, name) in webs.items()]
    http_port, sse_port = webs["streamable-http"][0], webs["sse"][0]
    config = {"mcpServers": {
        "test": {"command": sys.executable, "args": [str(d / "server.py")], "env": {"MCP_TEST_LOG": str(log)}},
        "http": {"url": f"http://127.0.0.1:{http_port}/mcp", "headers": {"X-Test": "1"}},
        "sse": {"url": f"http://127.0.0.1:{sse_port}/sse", "type": "sse"}}}
    (d / "mcp.json").write_text(json.dumps(config))
    try:
        for port in (http_port, sse_port):
            _wait_listening(port)
        proc, base, _ = start_server("--kv-cache-gb", "0.25", "--max-model-len", "2048", "--mcp-config",
                                     str(d / "mcp.json"), "--mcp-timeout", "2", "--mcp-max-rounds", "2")
        client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0)
        yield types.SimpleNamespace(client=client, log=log)
        stop_server(proc)
    finally:
        for p in web_procs:
            p.kill()
            p.wait()


def _wait_listening(port: int) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.2)
    pytest.fail(f"the HTTP MCP server on port {port} did not start")


def calls_logged(srv) -> list[str]:
    return srv.log.read_text().split("\n")[:-1]


def test_forced_mcp_call_is_run_whole_and_streamed(srv):
    r = srv.client.chat.completions.create(model="m", messages=ASK, max_tokens=32, temperature=0,
                                           tool_choice=forced("secret_word"))
    choice = r.choices[0]
    assert choice.finish_reason in ("stop", "length") and not choice.message.tool_calls
    (call,) = choice.message.model_extra["mcp_calls"]
    assert call["name"] == "secret_word" and call["result"] == "pineapple-42" and not call["is_error"]
    assert calls_logged(srv)[-1] == "secret_word"
    assert r.usage.completion_tokens > 1 and r.usage.prompt_tokens > 2 * 100  # two rounds of the prompt

    chunks = list(srv.client.chat.completions.create(
        model="m", messages=ASK, max_tokens=32, temperature=0, tool_choice=forced("secret_word"), stream=True,
        stream_options={"include_usage": True}))
    notes = [c.choices[0].delta.model_extra.get("mcp_calls") for c in chunks if c.choices]
    (ran,) = [n for n in notes if n]
    assert ran[0]["name"] == "secret_word" and ran[0]["result"] == "pineapple-42"
    assert not any(c.choices[0].delta.tool_calls for c in chunks if c.choices)  # run here, not by the client
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == (choice.message.content or "")
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] \
        == [choice.finish_reason]
    assert chunks[-1].usage.total_tokens == r.usage.total_tokens
    assert calls_logged(srv)[-2:] == ["secret_word", "secret_word"]


def test_arguments_reach_the_tool(srv):
    r = srv.client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Add 2 and 3."}],
                                           max_tokens=32, temperature=0, tool_choice=forced("add"))
    (call,) = r.choices[0].message.model_extra["mcp_calls"]
    args = json.loads(call["arguments"])
    assert call["result"] == str(args["a"] + args["b"]) and calls_logged(srv)[-1] == f"add {args['a']} {args['b']}"


def test_url_servers_streamable_http_and_sse(srv):
    for name, transport in (("http_word", "streamable-http"), ("sse_word", "sse")):
        r = srv.client.chat.completions.create(model="m", messages=ASK, max_tokens=32, temperature=0,
                                               tool_choice=forced(name))
        (call,) = r.choices[0].message.model_extra["mcp_calls"]
        assert call["result"] == f"{name} over {transport}" and not call["is_error"]


def test_failing_hung_and_crashed_tools_give_error_results(srv):
    def run(name):
        t0 = time.monotonic()
        r = srv.client.chat.completions.create(model="m", messages=ASK, max_tokens=32, temperature=0,
                                               tool_choice=forced(name), timeout=60)
        assert r.choices[0].finish_reason in ("stop", "length")
        (call,) = r.choices[0].message.model_extra["mcp_calls"]
        assert call["is_error"] and call["result"].startswith("tool failed"), call
        return call["result"], time.monotonic() - t0

    run("explode")
    result, took = run("sleepy")  # --mcp-timeout 2
    assert "timed out" in result and 2 <= took < 60  # not the tool's 600 s
    result, _ = run("crash")
    assert calls_logged(srv)[-3:] == ["explode", "sleepy", "crash"]
    # the crashed (and the hung) server is started again by the next call
    r = srv.client.chat.completions.create(model="m", messages=ASK, max_tokens=32, temperature=0,
                                           tool_choice=forced("secret_word"))
    assert r.choices[0].message.model_extra["mcp_calls"][0]["result"] == "pineapple-42"


def test_the_requests_own_tool_wins_a_clash_and_goes_to_the_client(srv):
    own = {"type": "function", "function": {"name": "add", "description": "Adds on the client",
                                            "parameters": {"type": "object", "properties": {"x": {"type": "integer"}},
                                                           "required": ["x"]}}}
    before = calls_logged(srv)
    r = srv.client.chat.completions.create(model="m", messages=ASK, max_tokens=24, temperature=0, tools=[own],
                                           tool_choice=forced("add"))
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls[0].function.name == "add"
    assert "x" in json.loads(choice.message.tool_calls[0].function.arguments)  # the client's schema
    assert "mcp_calls" not in (choice.message.model_extra or {}) and calls_logged(srv) == before


@pytest.mark.parametrize("config, message", [
    (None, "cannot read it"),
    ('{"mcpServers": {"x": ', "not valid JSON"),
    ('{"mcpServers": {"gone": {"command": "/nonexistent/mcp-server"}}}', "MCP server 'gone'"),
])
def test_a_bad_config_stops_the_start_up(tmp_path, config, message):
    path = tmp_path / "mcp.json"
    if config is not None:
        path.write_text(config)
    p = subprocess.run([sys.executable, "-m", "xinfer.cli", "--log-level", "warning", "serve", "--port",
                        str(free_port()), "--mcp-config", str(path)], capture_output=True, text=True, timeout=180)
    assert p.returncode != 0 and message in p.stderr and str(path if config is None else message) in p.stderr


def test_load_config():
    assert mcp_servers.load_config(None) is None
    assert mcp_servers.load_config(None, "srv", ["-x"]) == {"mcp": {"command": "srv", "args": ["-x"], "env": {}}}
    with pytest.raises(ValueError, match="needs 'command'"):
        mcp_servers.load_config(_write({"mcpServers": {"a": {"cmd": "x"}}}))
    with pytest.raises(ValueError, match="--mcp-args needs --mcp-command"):
        mcp_servers.load_config(None, None, ["x"])
    assert mcp_servers.load_config(_write({"mcpServers": {"a": {"command": "x", "disabled": True}}})) is None
    got = mcp_servers.load_config(_write({"mcpServers": {"h": {"url": "http://127.0.0.1:1/mcp"}}}))
    assert got == {"h": {"url": "http://127.0.0.1:1/mcp", "sse": False, "headers": {}}}


def _write(doc) -> str:
    import tempfile
    f = tempfile.NamedTemporaryFile("w", suffix=".json", delete=False)
    json.dump(doc, f)
    f.close()
    return f.name


# ---- the round loop on a scripted engine: each round replies with the next script entry ----

def _fake_state(script, max_rounds):
    ran, bodies = [], []

    class Mcp:
        def tools(self):
            schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
            return {"add": (None, types.SimpleNamespace(name="add", description="Adds", input_schema=schema))}

        async def call(self, name, arguments):
            ran.append((name, arguments))
            return "3", False

    class Client:
        async def generate(self, rid, ids, params, spec, keepalive):
            text, call = script[len(bodies) - 1]
            calls = [ToolCallChunk(0, 0, "call-%d" % len(bodies), call, '{"a": 1}')] if call else []
            yield TextDelta(rid, 0, 0, text, 3, "stop", 0, tool_calls=calls)

    async def offload(fn, *args):
        return fn(*args)

    def prepare(s, body, params):
        bodies.append(body)
        return [1, 2, 3], ParseSpec()

    s = types.SimpleNamespace(opts=ApiOptions(mcp_max_rounds=max_rounds), mcp=Mcp(), client=Client(), tok=None,
                              config=types.SimpleNamespace(max_num_seqs=4), offload=offload,
                              check=lambda prompts, params: None)
    return s, prepare, ran, bodies


def _run_rounds(s, prepare, body):
    async def go():
        rounds = mcp_chat.Rounds(s, body, prepare)
        first = await rounds.round(list(body.messages), body.tool_choice, True)
        events = [e async for e in rounds.events("r", first)]
        return rounds, events
    return asyncio.run(go())


def test_rounds_run_mcp_calls_until_an_answer_or_the_last_round():
    body = msgspec.convert({"messages": ASK, "tool_choice": forced("add")}, ChatRequest)
    s, prepare, ran, bodies = _fake_state([("", "add"), ("It is 3.", None)], 5)
    rounds, events = _run_rounds(s, prepare, body)
    assert ran == [("add", '{"a": 1}')] and len(rounds.states) == 2 and rounds.states[-1].finish_reason == "stop"
    assert [e for e in events if isinstance(e, list)][0][0]["result"] == "3"
    assert not any(e.tool_calls for e in events if isinstance(e, TextDelta))  # kept from the client
    second = bodies[1]
    assert [m.role for m in second.messages] == ["user", "assistant", "tool"] and second.tool_choice == "none"
    assert second.messages[2].content == "3" and second.messages[2].tool_call_id == second.messages[1].tool_calls[0].id
    assert second.tools[0].function.name == "add"

    # after --mcp-max-rounds the reply is returned as it is, its MCP call included (not run)
    s, prepare, ran, bodies = _fake_state([("", "add")] * 3, 1)
    body = msgspec.convert({"messages": ASK}, ChatRequest)
    rounds, _ = _run_rounds(s, prepare, body)
    assert len(ran) == 1 and len(rounds.states) == 2 and rounds.states[-1].finish_reason == "tool_calls"
    assert rounds.held_calls()[0]["function"]["name"] == "add" and bodies[1].tool_choice is None
