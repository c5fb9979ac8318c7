"""A property-based fuzz of a running server's POST routes, driven by its own /openapi.json.

Bodies come from two sources: the route's request schema (hypothesis-jsonschema: well-formed
requests with every combination of fields and edge values) and arbitrary JSON (anything a client
could send). Every answer must be a non-5xx status within the time limit on a connection that
stayed up, a stream must end with its last event (`data: [DONE]`; Anthropic's `message_stop`, the
Responses API's `response.completed` / `response.incomplete`, or an `error` event); after the run a plain request must still work
and /metrics still parse. tests/test_fuzz.py runs it briefly; `xinfer-bench fuzz` runs it long.
"""
from __future__ import annotations

import http.client
import json
import re
import time
import urllib.request
from dataclasses import dataclass, field
from urllib.parse import urlparse

from hypothesis import HealthCheck, given, settings
from hypothesis import seed as seed_of
from hypothesis import strategies as st
from hypothesis_jsonschema import from_schema

JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner,
                                                                                 max_size=4), max_leaves=12)


@dataclass
class FuzzReport:
    sent: int = 0
    statuses: dict[int, int] = field(default_factory=dict)
    slowest_s: float = 0.0
    failures: list[str] = field(default_factory=list)  # 5xx, hangs, dropped connections

    def line(self) -> str:
        by = ", ".join(f"{k}: {v}" for k, v in sorted(self.statuses.items()))
        return f"{self.sent} requests ({by}), slowest {self.slowest_s:.2f}s, {len(self.failures)} failures"


def post(base: str, path: str, body: bytes, timeout: float) -> tuple[int, bytes]:
    """One POST; raises on a dropped connection or a timeout (the reply is read whole)."""
    u = urlparse(base)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)
    try:
        conn.request("POST", path, body=body, headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


# the field each generating route caps its output with, set where a body leaves it out
_CAPS = {"/v1/chat/completions": "max_tokens", "/v1/completions": "max_tokens", "/v1/responses": "max_output_tokens"}


def bounded(path: str, body):
    """Keep generation short, so each request answers in well under the time limit on a CPU: a
    body without a cap would otherwise generate up to the server's context length."""
    if isinstance(body, dict):
        caps = ("max_tokens", "max_completion_tokens", "max_output_tokens")
        for k in caps:
            if isinstance(body.get(k), int) and body[k] > 8:
                body[k] = 8
        if path in _CAPS and all(body.get(k) is None for k in caps):  # null is no cap, as left out
            body[_CAPS[path]] = 8
    return body


def fuzz(base: str, examples: int = 50, timeout: float = 10.0, seed: int = 0, progress=None) -> FuzzReport:
    """Fuzz every POST route of the server at `base` (`examples` bodies per route and source);
    `progress(text)`, when given, hears after each route and source how far the run is."""
    with urllib.request.urlopen(base + "/openapi.json", timeout=timeout) as r:
        doc = json.loads(r.read())
    report = FuzzReport()
    routes = [(path, op["requestBody"]["content"]["application/json"]["schema"])
              for path, ops in doc["paths"].items() for m, op in ops.items()
              if m == "post" and "requestBody" in op]

    def check(path, body):
        raw = json.dumps(bounded(path, body)).encode()
        t0 = time.monotonic()
        try:
            status, reply = post(base, path, raw, timeout)
        except (OSError, http.client.HTTPException) as e:  # a timeout is an OSError too
            report.failures.append(f"{path} {raw[:300]!r}: {type(e).__name__}: {e}")
            return
        report.slowest_s = max(report.slowest_s, time.monotonic() - t0)
        report.sent += 1
        report.statuses[status] = report.statuses.get(status, 0) + 1
        if status >= 500:
            report.failures.append(f"{path} {raw[:300]!r}: {status} {reply[:300]!r}")
        elif status == 200 and isinstance(body, dict) and body.get("stream") is True and not _ended(path, reply):
            report.failures.append(f"{path} {raw[:300]!r}: a stream that did not end with its last event")

    for n, (path, schema) in enumerate(routes, 1):
        for name, source in (("schema", from_schema(schema)), ("any JSON", JSON)):
            @seed_of(seed)
            @settings(max_examples=examples, deadline=None, database=None, print_blob=False,
                      suppress_health_check=list(HealthCheck))
            @given(source)
            def run(body):
                check(path, body)

            run()
            if progress:
                progress(f"route {n}/{len(routes)} {path} ({name}): {report.line()}")
    return report


# Streams with named events end with one of these; the others with "data: [DONE]".
_LAST_EVENTS = {"/v1/messages": (b"message_stop", b"error"),
                "/v1/responses": (b"response.completed", b"response.incomplete", b"error")}


def _ended(path: str, reply: bytes) -> bool:
    last = _LAST_EVENTS.get(path)
    if last is None:
        return reply.rstrip().endswith(b"data: [DONE]")
    names = re.findall(rb"^event: (\S+)", reply, re.M)
    return bool(names) and names[-1] in last

