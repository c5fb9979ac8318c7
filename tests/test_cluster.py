"""Several nodes on loopback: node 0's frames are signed and only what verifies is taken; two
"nodes" (node 0 in this process or `xinfer serve`, node 1 `xinfer serve --headless`) give the
same greedy tokens as one rank, across tensor- and pipeline-parallel splits; a remote rank killed
mid-stream loses no request; a node that does not join is a clear error."""
import concurrent.futures as cf
import hashlib
import hmac
import os
import signal
import subprocess
import sys
import threading
import time

import msgspec
import pytest

from tests.conftest import free_port, make_chat_model, start_server, stop_server
from tests.test_server import _descendants, _title
from tests.test_tp import PARAMS, PROMPTS, _tiny
from xinfer import Engine, EngineConfig
from xinfer.ipc import cluster
from xinfer.workers.runner import WorkerDied


def _pair(key="k3y"):
    port = free_port(2)  # the master port and the publisher's, one above it
    pub = cluster.Publisher("127.0.0.1", port - 1, key)
    sub = cluster.Subscriber("127.0.0.1", port - 1, key)
    deadline = time.monotonic() + 10
    while sub.recv(0.2) is None:  # PUB/SUB: wait until the subscription is through
        pub.start(1, b"{}", None)
        assert time.monotonic() < deadline
    return pub, sub


def test_frames_are_signed_and_replays_dropped():
    pub, sub = _pair()
    try:
        raw = pub._sock  # what a peer on the wire could send: frames past the publisher's signing
        pub.plan(1, b"plan-1")
        while isinstance(m := sub.recv(5), cluster.Start):
            pass
        assert isinstance(m, cluster.Plan) and m.payload == b"plan-1"
        forged = msgspec.msgpack.encode(cluster.Plan(m.session, m.seq + 1, 1, b"forged"))
        raw.send(forged + b"\0" * 32)  # not signed with the key
        again = msgspec.msgpack.encode(m)
        raw.send(again + hmac.new(b"k3y", again, hashlib.sha256).digest())  # a frame seen before: a replay
        raw.send(b"\xc1")  # garbage
        pub.plan(1, b"plan-2")
        assert sub.recv(5).payload == b"plan-2"
        assert sub.rejected == 3
    finally:
        pub.close()
        sub.close()


def test_a_different_key_verifies_nothing():
    port = free_port(2)  # the master port and the publisher's, one above it
    pub = cluster.Publisher("127.0.0.1", port - 1, "right")
    sub = cluster.Subscriber("127.0.0.1", port - 1, "wrong")
    try:
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline:
            pub.start(1, b"{}", None)
            assert sub.recv(0.1) is None
        assert sub.rejected > 0
    finally:
        pub.close()
        sub.close()


def test_non_loopback_needs_a_key():
    with pytest.raises(ValueError, match="--cluster-key"):
        EngineConfig(tensor_parallel_size=2, nnodes=2, master_addr="192.0.2.1")
    EngineConfig(tensor_parallel_size=2, nnodes=2, master_addr="192.0.2.1", cluster_key="s")


def _headless(port, key="k3y", log=None):
    return subprocess.Popen([sys.executable, "-m", "xinfer.cli", "--log-level", "info", "serve", "--headless",
                             "--nnodes", "2", "--node-rank", "1", "--master-port", str(port), "--cluster-key", key],
                            stdout=log or subprocess.DEVNULL, stderr=subprocess.STDOUT, text=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    _tiny("llama", path)
    kw = dict(model=str(path), block_size=4, num_kv_blocks=200, prefill_chunk_size=8)
    e = Engine(EngineConfig(**kw), log_level="warning")
    try:
        want = [o.token_ids for o in e.generate(PROMPTS, PARAMS)]
    finally:
        e.close()
    return kw, want


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2), (2, 2)])
def test_two_nodes_equal_one_rank(tiny, tp, pp):
    """(2, 2): each node holds one stage of two tensor-parallel ranks."""
    kw, want = tiny
    port = free_port(2)  # the master port and the publisher's, one above it
    node1 = _headless(port)
    try:
        e = Engine(EngineConfig(**kw, tensor_parallel_size=tp, pipeline_parallel_size=pp, nnodes=2, master_port=port,
                                cluster_key="k3y", startup_timeout=120), log_level="warning")
        try:
            assert [o.token_ids for o in e.generate(PROMPTS, PARAMS)] == want
        finally:
            e.close()
    finally:
        node1.terminate()
        assert node1.wait(30) == 0


def test_a_node_that_does_not_join_is_a_clear_error(tiny, tmp_path):
    kw, _ = tiny
    port = free_port(2)  # the master port and the publisher's, one above it
    log = open(tmp_path / "node1.log", "w")
    node1 = _headless(port, key="not-the-key", log=log)  # its frames never verify: it never joins
    try:
        t0 = time.monotonic()
        with pytest.raises(WorkerDied, match="did not start within --startup-timeout 8s.*--headless"):
            Engine(EngineConfig(**kw, tensor_parallel_size=2, nnodes=2, master_port=port, cluster_key="k3y",
                                startup_timeout=8), log_level="warning")
        assert time.monotonic() - t0 < 60
    finally:
        node1.terminate()
        node1.wait(30)
        log.close()
    assert "signature does not verify" in (tmp_path / "node1.log").read_text()


def test_served_across_two_nodes_a_killed_remote_rank_loses_nothing(tiny_llama_path, tmp_path):
    """`xinfer serve -tp 2 --nnodes 2` and a headless node 1: chats stream; kill -9 of node 1's rank
    mid-stream restarts both nodes' ranks, and every stream completes with the same text."""
    from openai import OpenAI
    model = make_chat_model(tiny_llama_path, tmp_path / "m", "{% for m in messages %}{{ m['content'] }}{% endfor %}")
    mport = free_port(2)  # the master port and the publisher's, one above it
    node1 = _headless(mport)
    srv = None
    try:
        srv = start_server("--model", model, "-tp", "2", "--nnodes", "2", "--master-port", str(mport),
                           "--cluster-key", "k3y", "--block-size", "4")
        client = OpenAI(base_url=srv[1] + "/v1", api_key="none")
        started = threading.Event()

        def ask(i):
            s = client.chat.completions.create(model=client.models.list().data[0].id, max_tokens=48, temperature=0,
                                               messages=[{"role": "user", "content": f"{i} and {i + 1}"}], stream=True)
            parts = []
            for c in s:
                if c.choices and c.choices[0].delta.content:
                    parts.append(c.choices[0].delta.content)
                    if len(parts) == 4:
                        started.set()
            return "".join(parts)

        with cf.ThreadPoolExecutor(4) as pool:
            want = list(pool.map(ask, range(4)))
            started.clear()
            futures = [pool.submit(ask, i) for i in range(4)]
            assert started.wait(120)
            remote = [p for p in _descendants(node1.pid) if _title(p) == "xinfer::worker-1"]
            assert len(remote) == 1
            os.kill(remote[0], signal.SIGKILL)
            assert not all(f.done() for f in futures)
            got = [f.result(timeout=240) for f in futures]
        assert got == want and all(want)
        again = [p for p in _descendants(node1.pid) if _title(p) == "xinfer::worker-1"]
        assert again and again[0] != remote[0]  # node 1's rank was started again
    finally:
        if srv is not None:
            stop_server(srv[0])
        node1.terminate()
        node1.wait(30)
