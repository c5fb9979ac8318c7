"""Queue limits in time: with one running slot and --max-queue-wait 1, requests that wait longer
are refused with 503 + Retry-After (streaming: an error event), counted by reason."""
import concurrent.futures as cf
import time
import json
import urllib.error
import urllib.request

import pytest

from tests.conftest import start_server, stop_server


@pytest.fixture(scope="module")
def server():
    proc, base, _ = start_server("--kv-cache-gb", "0.2", "--max-num-seqs", "1", "--max-queue-wait", "1")
    yield base
    stop_server(proc)


def _post(base, body):
    req = urllib.request.Request(base + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, r.read().decode(), dict(r.headers)
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(), dict(e.headers)


def test_requests_that_wait_too_long_get_503(server):
    long = {"messages": [{"role": "user", "content": "Tell a long story"}], "max_tokens": 400,
            "ignore_eos": True, "temperature": 0}
    short = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
    with cf.ThreadPoolExecutor(3) as pool:
        first = pool.submit(_post, server, long)

        time.sleep(0.5)  # the long one holds the only slot
        waiting = pool.submit(_post, server, short)
        streamed = pool.submit(_post, server, {**short, "stream": True})
        status, body, headers = waiting.result()
        assert status == 503 and headers.get("Retry-After") == "1", body
        err = json.loads(body)["error"]
        assert err["type"] == "service_unavailable" and "waited over 1s" in err["message"]
        s_status, s_body, _ = streamed.result()
        events = [ln[6:] for ln in s_body.splitlines() if ln.startswith("data: ")]
        assert s_status == 200 and events[-1] == "[DONE]"
        assert json.loads(events[-2])["error"]["type"] == "service_unavailable"
        assert first.result()[0] == 200  # the running request is untouched
    assert _post(server, short)[0] == 200
    with urllib.request.urlopen(server + "/metrics") as r:
        metrics = r.read().decode()
    line = next(ln for ln in metrics.splitlines()
                if ln.startswith("xinfer:request_rejected_total") and 'reason="queue_timeout"' in ln)
    assert float(line.split()[-1]) == 2.0


def test_many_prompts_are_admitted_in_chunks(server):
    """Six prompts on a one-slot server with --max-queue-wait 1: the API admits them a batch's worth
    at a time, so none waits in the engine's queue long enough to be refused."""
    req = urllib.request.Request(server + "/v1/completions", headers={"Content-Type": "application/json"},
                                 data=json.dumps({"prompt": [f"Count to {i}:" for i in range(6)], "max_tokens": 40,
                                                  "ignore_eos": True, "temperature": 0}).encode())
    with urllib.request.urlopen(req, timeout=120) as r:
        body = json.loads(r.read())
    assert [c["index"] for c in body["choices"]] == list(range(6))
    assert all(c["finish_reason"] == "length" for c in body["choices"]) and body["usage"]["completion_tokens"] == 240

def test_request_timeout_ends_a_long_request_with_408():
    proc, base, _ = start_server("--kv-cache-gb", "0.1", "--request-timeout", "1")
    try:
        long = {"messages": [{"role": "user", "content": "Tell a long story"}], "max_tokens": 1000,
                "ignore_eos": True}
        status, body, _ = _post(base, long)
        err = json.loads(body)["error"]
        assert status == 408 and err["code"] == "request_timeout" and "--request-timeout 1s" in err["message"]
        s_status, s_body, _ = _post(base, {**long, "stream": True})
        events = [ln[6:] for ln in s_body.splitlines() if ln.startswith("data: ")]
        assert s_status == 200 and events[-1] == "[DONE]"
        assert json.loads(events[-2])["error"]["code"] == "request_timeout"
        time.sleep(1.0)  # the aborted choices are freed at once
        with urllib.request.urlopen(base + "/metrics") as r:
            running = next(ln for ln in r.read().decode().splitlines() if ln.startswith("xinfer:num_requests_running"))
        assert float(running.split()[-1]) == 0.0
        assert _post(base, {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4})[0] == 200
    finally:
        stop_server(proc)
