"""HTTP-level hardening through a real server (xinfer/api/guard.py): Host (DNS rebinding), Origin and
CORS, JSON-only POSTs, an oversized body answered cleanly, trickling clients cut off, connections per
client capped. After each refusal a valid request still works."""
import http.client
import json
import re
import select
import socket
import threading
import time

import pytest

from tests.conftest import start_server, stop_server

READ_TIMEOUT = 3
MAX_CONNECTIONS = 4


@pytest.fixture(scope="module")
def server():
    proc, base, _ = start_server("--kv-cache-gb", "0.1", "--allowed-origins", "http://ok.example",
                                 "--request-read-timeout", str(READ_TIMEOUT),
                                 "--max-connections-per-client", str(MAX_CONNECTIONS))
    yield int(base.rsplit(":", 1)[1])
    stop_server(proc)


def request(port, method, path, body=None, headers=None):
    """(status, headers, parsed JSON or raw bytes) over a fresh connection."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        data = json.dumps(body).encode() if isinstance(body, dict) else body
        conn.request(method, path, data, {"Content-Type": "application/json", **(headers or {})})
        r = conn.getresponse()
        raw = r.read()
        return r.status, r.headers, json.loads(raw) if r.headers.get_content_type() == "application/json" else raw
    finally:
        conn.close()


COMPLETION = {"prompt": "Hello", "max_tokens": 2, "temperature": 0}


def assert_works(port):
    status, _, body = request(port, "POST", "/v1/completions", COMPLETION)
    assert status == 200 and body["choices"][0]["text"] is not None


def assert_error(status, body, want):
    assert status == want, body
    assert set(body["error"]) == {"message", "type", "param", "code"} and body["error"]["message"]


def prompt_tokens(port) -> float:
    _, _, raw = request(port, "GET", "/metrics")
    return sum(float(v) for v in re.findall(rb"^xinfer:prompt_tokens_total\{[^}]*\} (\S+)$", raw, re.M))


def test_host_not_allowed_is_421_and_runs_nothing(server):
    before = prompt_tokens(server)
    for path, body in (("/v1/completions", COMPLETION), ("/health", None), ("/", None)):
        status, _, got = request(server, "POST" if body else "GET", path, body, {"Host": "evil.example"})
        assert_error(status, got, 421)
    assert_error(*request(server, "GET", "/v1/models", headers={"Host": "evil.example:%d" % server})[::2], 421)
    assert prompt_tokens(server) == before
    for host in ("localhost:%d" % server, "127.0.0.1", "[::1]:%d" % server):
        assert request(server, "GET", "/health", headers={"Host": host})[0] == 200
    assert_works(server)


def test_cross_origin_post_is_403_same_origin_works(server):
    status, _, body = request(server, "POST", "/v1/completions", COMPLETION, {"Origin": "http://evil.example"})
    assert_error(status, body, 403)
    assert_error(*request(server, "POST", "/tokenize", {"prompt": "x"}, {"Origin": "null"})[::2], 403)
    status, headers, body = request(server, "POST", "/v1/completions", COMPLETION,
                                    {"Origin": "http://127.0.0.1:%d" % server})
    assert status == 200 and body["choices"] and "Access-Control-Allow-Origin" not in headers
    assert_works(server)


def test_allowed_origin_gets_cors(server):
    status, headers, _ = request(server, "OPTIONS", "/v1/chat/completions", headers={
        "Origin": "http://ok.example", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type"})
    assert status == 204
    assert headers["Access-Control-Allow-Origin"] == "http://ok.example" and headers["Vary"] == "Origin"
    assert "POST" in headers["Access-Control-Allow-Methods"]
    assert {"authorization", "content-type"} <= {h.strip().lower() for h in headers["Access-Control-Allow-Headers"].split(",")}
    assert int(headers["Access-Control-Max-Age"]) > 0
    status, headers, body = request(server, "POST", "/v1/completions", COMPLETION, {"Origin": "http://ok.example"})
    assert status == 200 and body["choices"] and headers["Access-Control-Allow-Origin"] == "http://ok.example"
    status, headers, _ = request(server, "OPTIONS", "/v1/chat/completions", headers={"Origin": "http://evil.example"})
    assert "Access-Control-Allow-Origin" not in headers  # the browser will not send the POST
    assert_works(server)


def test_post_must_be_json(server):
    for ctype in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"):
        status, _, body = request(server, "POST", "/v1/completions", json.dumps(COMPLETION).encode(),
                                  {"Content-Type": ctype})
        assert_error(status, body, 415)
    status, _, body = request(server, "POST", "/v1/completions", COMPLETION,
                              {"Content-Type": "application/json; charset=utf-8"})
    assert status == 200
    assert_works(server)


def test_oversized_body_gets_a_readable_413(server):
    status, headers, body = request(server, "POST", "/v1/completions", b"x" * (9 << 20))
    assert_error(status, body, 413)
    assert headers["Connection"] == "close"
    # Expect: 100-continue: the 413 comes instead of the go-ahead
    with socket.create_connection(("127.0.0.1", server), timeout=10) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\nExpect: 100-continue\r\n\r\n" % (9 << 20))
        answer = b""
        while chunk := s.recv(65536):
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 413 ") and b"100 Continue" not in answer
    assert json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "request_too_large"
    assert_works(server)


def trickle(port, sent: bytes, trickled: bytes, out: dict):
    """Send `sent`, then `trickled` a byte a second; out: how long until the server closed, and its answer."""
    t0, answer = time.monotonic(), b""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(sent)
        for i in range(len(trickled)):
            if select.select([s], [], [], 1.0)[0]:  # an answer, or the close
                break
            try:
                s.send(trickled[i:i + 1])
            except OSError:
                break
        try:
            while chunk := s.recv(65536):
                answer += chunk
        except OSError:
            pass
    out.update(seconds=time.monotonic() - t0, answer=answer)


def test_trickling_clients_are_cut_off(server):
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Content-Length: 200\r\n\r\n")
    in_head, in_body = {}, {}
    threads = [threading.Thread(target=trickle, args=(server, b"", head, in_head)),
               threading.Thread(target=trickle, args=(server, head, b" " * 200, in_body))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    for out in (in_head, in_body):
        assert out["seconds"] < READ_TIMEOUT + 4, out
        assert out["answer"] == b"" or out["answer"].startswith(b"HTTP/1.1 408 "), out
    assert_works(server)


def test_connections_per_client_are_capped(server):
    idle = [socket.create_connection(("127.0.0.1", server), timeout=10) for _ in range(MAX_CONNECTIONS)]
    try:
        time.sleep(0.5)  # the server has taken them all
        status, headers, body = request(server, "GET", "/health")
        assert_error(status, body, 429)
        assert headers["Connection"] == "close" and headers["Retry-After"]
    finally:
        for s in idle:
            s.close()
    time.sleep(0.5)
    assert_works(server)
