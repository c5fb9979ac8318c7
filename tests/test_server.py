"""`xinfer serve` end to end: the supervisor, the API process, the scheduler process, the openai client."""
import asyncio
import json
import os
import signal
import socket
import time
import urllib.error
import urllib.request

import pytest

from tests.conftest import start_server, stop_server


@pytest.fixture(scope="module")
def server():
    proc, base, saw_503 = start_server("--kv-cache-gb", "0.2")
    yield base, saw_503, proc.pid
    stop_server(proc)


def test_health_is_503_while_loading(server):
    assert server[1]


def post(base, path, body):
    req = urllib.request.Request(base + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_chat_with_openai_client(server):
    from openai import OpenAI
    base = server[0]
    client = OpenAI(base_url=base + "/v1", api_key="none")
    model = client.models.list().data[0].id
    r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "What is 2+2?"}],
                                       max_tokens=16, temperature=0)
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.completion_tokens > 0 and r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    stream = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "What is 2+2?"}],
                                            max_tokens=16, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == r.choices[0].message.content  # same greedy answer streamed
    assert sum(1 for c in chunks if c.choices and c.choices[0].finish_reason) == 1
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == r.usage.completion_tokens
    assert len({c.id for c in chunks}) == 1


def test_completions_and_models(server):
    base = server[0]
    status, body = post(base, "/v1/completions", {"prompt": "The capital of France is", "max_tokens": 5,
                                                   "temperature": 0})
    assert status == 200 and body["object"] == "text_completion" and body["usage"]["completion_tokens"] == 5
    with urllib.request.urlopen(base + "/v1/models") as r:
        assert json.loads(r.read())["data"][0]["object"] == "model"


@pytest.mark.parametrize("body, param", [
    ({"messages": "hi"}, "messages"),
    ({"messages": [{"role": "user", "content": "hi"}], "temperature": -1}, "temperature"),
    ({"messages": [{"role": "user", "content": "hi"}], "top_p": 2}, "top_p"),
    # The prompt alone is over the context (a larger max_tokens is clamped: tests/test_request_surface.py).
    ({"messages": [{"role": "user", "content": "hi " * 9000}]}, "max_tokens"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "messages"),
])
def test_bad_requests_get_openai_errors(server, body, param):
    base = server[0]
    status, err = post(base, "/v1/chat/completions", body)
    assert status == 400 and err["error"]["param"] == param and err["error"]["message"]
    assert set(err["error"]) == {"message", "type", "param", "code"}
    status, ok = post(base, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                      "max_tokens": 2})
    assert status == 200  # the server still serves


@pytest.mark.parametrize("extra", [
    {"top_k": 9223372036854775808},  # once overflowed a torch long in the worker: restart loop, exit 1
    {"top_k": 10 ** 6},  # more than the vocabulary: no filter, not a crash
    {"seed": 18446744073709551615, "n": 2},  # seed + 1 once broke the step plan's int64: scheduler exit
    {"seed": 9223372036854775807, "n": 2},
])
def test_known_killers_leave_other_streams_and_the_server_up(server, extra):
    import concurrent.futures as cf
    base = server[0]
    chat = {"messages": [{"role": "user", "content": "Count to ten"}], "max_tokens": 24, "temperature": 0}
    with cf.ThreadPoolExecutor(2) as pool:
        other = pool.submit(post, base, "/v1/chat/completions", {**chat, "ignore_eos": True})
        status, body = post(base, "/v1/chat/completions", {**chat, "max_tokens": 4, **extra})
        assert status in (200, 400), body
        if status == 400:
            assert body["error"]["param"] in extra
        ostatus, obody = other.result()
    assert ostatus == 200 and obody["usage"]["completion_tokens"] == 24
    assert post(base, "/v1/chat/completions", {**chat, "max_tokens": 2})[0] == 200


def test_web_page_and_health(server):
    base = server[0]
    with urllib.request.urlopen(base + "/") as r:
        assert r.status == 200 and b"xinfer chat" in r.read()
    with urllib.request.urlopen(base + "/health") as r:
        assert r.status == 200


def _descendants(pid):
    kids = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                kids.setdefault(ppid, []).append(int(d))
            except (OSError, ValueError, IndexError):
                pass
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        for c in kids.get(p, []):
            out.append(c)
            todo.append(c)
    return out


def _title(pid):
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read().split(b"\0")[0].decode()


def test_worker_killed_mid_stream_loses_no_request(server):
    """kill -9 of the model worker during 16 streaming requests: all complete, same greedy text."""
    import concurrent.futures as cf
    import threading
    from openai import OpenAI
    base = server[0]
    client = OpenAI(base_url=base + "/v1", api_key="none")
    model = client.models.list().data[0].id
    msgs = [[{"role": "user", "content": f"Count from {i} to {i + 20}."}] for i in range(16)]
    streaming = threading.Event()  # some answer is under way: the kill lands mid-stream

    gaps = []  # between two chunks of a stream once its first token came

    def ask(m):
        s = client.chat.completions.create(model=model, messages=m, max_tokens=64, temperature=0, stream=True,
                                           extra_body={"ignore_eos": True})
        parts, last = [], None
        for c in s:
            now = time.monotonic()
            if len(parts) >= 2:
                gaps.append(now - last)
            last = now
            if c.choices:
                parts.append(c.choices[0].delta.content or "")
                if len(parts) == 8:
                    streaming.set()
        return "".join(parts)

    with cf.ThreadPoolExecutor(16) as pool:
        want = list(pool.map(ask, msgs))
        before, gaps[:] = max(gaps), []
        streaming.clear()
        futures = [pool.submit(ask, m) for m in msgs]
        assert streaming.wait(120)
        workers = [p for p in _descendants(server[2]) if _title(p) == "xinfer::worker-0"]
        assert len(workers) == 1
        os.kill(workers[0], signal.SIGKILL)
        assert not all(f.done() for f in futures)
        got = [f.result(timeout=300) for f in futures]
    stall = max(gaps)
    print(f"worker killed: longest gap between two chunks of a stream {stall:.2f}s (undisturbed {before:.2f}s)")
    assert stall < before + 5.0  # restart (model load) and the recompute of all 16 sequences
    assert got == want
    new = [p for p in _descendants(server[2]) if _title(p) == "xinfer::worker-0"]
    assert len(new) == 1 and new != workers


def test_sigterm_drains_in_flight_requests():
    """SIGTERM with 8 streams in flight: all 8 finish, new requests get 503, the tree is gone."""
    import concurrent.futures as cf
    from openai import OpenAI
    proc, base, _ = start_server("--kv-cache-gb", "0.2", "--drain-timeout", "120")
    children = _descendants(proc.pid)
    client = OpenAI(base_url=base + "/v1", api_key="none", max_retries=0)
    model = client.models.list().data[0].id

    def ask(i):
        s = client.chat.completions.create(model=model, messages=[{"role": "user", "content": f"Story {i}"}],
                                           max_tokens=48, temperature=0, stream=True,
                                           extra_body={"ignore_eos": True})
        chunks = [c for c in s if c.choices]
        return chunks[-1].choices[0].finish_reason, sum(1 for c in chunks if c.choices[0].delta.content)

    with cf.ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(ask, i) for i in range(8)]
        time.sleep(4)
        proc.send_signal(signal.SIGTERM)
        try:
            deadline = time.time() + 10
            while time.time() < deadline:  # a load balancer sees it going
                try:
                    urllib.request.urlopen(base + "/health", timeout=60)
                except urllib.error.HTTPError as e:
                    assert e.code == 503 and json.loads(e.read())["status"] == "draining"
                    break
                time.sleep(0.05)
            else:
                pytest.fail("/health did not turn 503 within 10 s of SIGTERM")
            status, err = post(base, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                              "max_tokens": 8})
        except OSError as e:  # show what the server said
            proc.kill()
            pytest.fail(f"no answer while draining ({e}); server output:\n{proc.stdout.read()}")
        results = [f.result(timeout=300) for f in futures]
    assert status == 503 and err["error"]["type"] == "service_unavailable"
    assert all(reason == "length" for reason, _ in results)
    rc = proc.wait(60)
    assert rc == 0, f"exit {rc}; server output:\n{proc.stdout.read()}"
    deadline = time.time() + 20
    while time.time() < deadline and _alive_xinfer(children):
        time.sleep(0.2)
    assert not _alive_xinfer(children)


def _metric(base, name):
    with urllib.request.urlopen(base + "/metrics") as r:
        for line in r.read().decode().splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


@pytest.mark.parametrize("stream", [True, False])
def test_disconnect_frees_blocks_within_a_second(server, stream):
    import http.client
    base = server[0]
    host, port = base.split("//")[1].split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    body = {"messages": [{"role": "user", "content": "Write a very long story."}], "max_tokens": 2000,
            "stream": stream, "ignore_eos": True}
    conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    deadline = time.time() + 30
    while _metric(base, "xinfer:num_requests_running") < 1 and time.time() < deadline:
        time.sleep(0.1)
    assert _metric(base, "xinfer:num_requests_running") == 1
    if stream:
        resp = conn.getresponse()
        resp.read1(100)
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    t = time.time()
    while time.time() - t < 1.0 and (_metric(base, "xinfer:num_requests_running") > 0
                                     or _metric(base, "xinfer:kv_cache_usage_perc") > 0):
        time.sleep(0.05)
    assert _metric(base, "xinfer:num_requests_running") == 0
    assert _metric(base, "xinfer:kv_cache_usage_perc") == 0


def test_a_client_gone_as_its_tokens_arrive_still_aborts():
    """The handler is cancelled in the same loop turn as a delta lands in its queue: the abort must
    still go out (asyncio.wait_for on Python 3.11 returns the item and swallows such a cancel)."""
    from xinfer.api.metrics import Metrics
    from xinfer.api.engine_client import EngineClient
    from xinfer.ipc.api import Abort, ToEngine
    from xinfer.ipc.channels import Codec
    from xinfer.ipc.text import TextDelta
    from xinfer.sampling_params import SamplingParams

    class Push:
        sent = []

        async def send(self, data):
            self.sent.append(c.tx.decode(data))

    c = EngineClient.__new__(EngineClient)
    c.metrics, c.queues, c.dead, c.push, c.tx = Metrics("m"), {}, False, Push(), Codec(ToEngine)

    async def consume():
        async for _ in c.generate("r", [1, 2, 3], SamplingParams(max_tokens=100), keepalive=15.0):
            pass

    async def main():
        task = asyncio.get_running_loop().create_task(consume())
        for _ in range(3):
            await asyncio.sleep(0)  # the request is sent and the handler waits on its queue
        c.queues["r"].put_nowait(TextDelta("r", 0, 0, "a", 1, None, 0))
        task.cancel()
        await asyncio.wait({task}, timeout=2)
        done = task.done()
        task.cancel()  # a swallowed cancel left it waiting for more tokens
        return done

    assert asyncio.run(main()), "the cancelled handler kept waiting for tokens"
    assert type(Push.sent[-1]) is Abort


def _cpu_seconds(pids):
    total = 0.0
    for p in pids:
        try:
            with open(f"/proc/{p}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except OSError:
            pass
    return total


def test_idle_server_uses_no_cpu(server):
    pids = [server[2]] + _descendants(server[2])
    time.sleep(1)
    c0, t0 = _cpu_seconds(pids), time.time()
    time.sleep(5)
    share = (_cpu_seconds(pids) - c0) / (time.time() - t0)
    assert share < 0.05, f"idle process tree used {share:.1%} of a core"


def _bound_unix_paths(pid):
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    with open("/proc/net/unix") as f:
        for line in f.readlines()[1:]:
            parts = line.split()
            if len(parts) >= 8 and parts[6] in inodes:
                yield parts[7]


def test_garbage_frame_into_api_socket_is_dropped(server):
    import zmq
    base, _, pid = server
    api = next(p for p in _descendants(pid) if _title(p) == "xinfer::api")
    path = next(p for p in _bound_unix_paths(api) if p.endswith("from_engine"))
    s = zmq.Context.instance().socket(zmq.PUSH)
    s.connect("ipc://" + path)
    s.send(b"\x00\xffnot a message")
    s.close(linger=1000)
    status, body = post(base, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                        "max_tokens": 3})
    assert status == 200 and body["usage"]["completion_tokens"] == 3


def test_engine_death_stops_the_server_nonzero():
    proc, base, _ = start_server("--kv-cache-gb", "0.1")
    tree = _descendants(proc.pid)
    engine = [p for p in tree if _title(p) == "xinfer::scheduler"]
    assert len(engine) == 1
    os.kill(engine[0], signal.SIGKILL)
    assert proc.wait(60) == 1
    assert "xinfer::scheduler exited unexpectedly" in proc.stdout.read()
    deadline = time.time() + 20  # each child notices its parent is gone (a child still starting takes longer)
    while time.time() < deadline and _alive_xinfer(tree):
        time.sleep(0.2)
    assert not _alive_xinfer(tree)


def _alive_xinfer(pids):
    out = []
    for p in pids:
        try:
            if _title(p).startswith("xinfer"):
                out.append(p)
        except OSError:
            pass
    return out


def test_64_concurrent_streams_match_offline(server, smollm_path):
    """64 concurrent streaming chats give the same greedy texts as the offline Engine."""
    import concurrent.futures as cf
    from openai import OpenAI
    from xinfer import Engine, EngineConfig, SamplingParams
    chats = [[{"role": "user", "content": f"Give me a fun fact about the number {i}."}] for i in range(64)]
    client = OpenAI(base_url=server[0] + "/v1", api_key="none", max_retries=0)
    model = client.models.list().data[0].id

    def ask(m):
        s = client.chat.completions.create(model=model, messages=m, max_tokens=12, temperature=0, stream=True)
        return "".join(c.choices[0].delta.content or "" for c in s if c.choices)

    with cf.ThreadPoolExecutor(64) as pool:
        got = list(pool.map(ask, chats))
    offline = Engine(EngineConfig(model=smollm_path, kv_cache_gb=0.1))
    want = [o.text for o in offline.chat(chats, SamplingParams(temperature=0, max_tokens=12))]
    assert got == want


@pytest.mark.parametrize("victim", ["xinfer::detokenizer", "xinfer::parser"])
def test_detokenizer_or_parser_killed_mid_stream_loses_no_text(server, victim):
    """kill -9 of the detokenizer or the parser during 16 streams: every stream completes with
    exactly the text of an undisturbed run (resent text is trimmed, never doubled)."""
    import concurrent.futures as cf
    from openai import OpenAI
    client = OpenAI(base_url=server[0] + "/v1", api_key="none", max_retries=0)
    model = client.models.list().data[0].id
    msgs = [[{"role": "user", "content": f"Describe the colour {c}."}] for c in range(16)]

    import threading
    gaps = []  # between two chunks of a stream once its first token came (the prefill wait is not a stall)
    streaming = threading.Event()  # answers are under way: the kill lands mid-stream

    def ask(m):
        s = client.chat.completions.create(model=model, messages=m, max_tokens=40, temperature=0, stream=True,
                                           stream_options={"include_usage": True})
        chunks, last = [], None
        for c in s:
            now = time.monotonic()
            if len(chunks) >= 2:
                gaps.append(now - last)
            chunks.append(c)
            last = now
            if len(chunks) == 6:
                streaming.set()
        return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices), chunks[-1].usage

    with cf.ThreadPoolExecutor(16) as pool:
        want = list(pool.map(ask, msgs))
        before, gaps[:] = max(gaps), []
        streaming.clear()
        futures = [pool.submit(ask, m) for m in msgs]
        assert streaming.wait(120)
        pids = [p for p in _descendants(server[2]) if _title(p) == victim]
        assert len(pids) == 1
        os.kill(pids[0], signal.SIGKILL)
        got = [f.result(timeout=300) for f in futures]
    stall = max(gaps)
    print(f"{victim} killed: longest gap between two chunks of a stream {stall:.2f}s (undisturbed {before:.2f}s)")
    assert stall < before + 1.0  # a restarted detokenizer/parser is serving again within a second
    assert [g[0] for g in got] == [w[0] for w in want]
    assert [g[1].completion_tokens for g in got] == [w[1].completion_tokens for w in want]
    assert [p for p in _descendants(server[2]) if _title(p) == victim] != pids
