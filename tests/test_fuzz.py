"""Property-based fuzz of every POST route from the server's own /openapi.json (bench/fuzz.py):
no 5xx, no hang over 10 s, no dropped connection; afterwards a valid request works and /metrics
parses. A couple of minutes here; `xinfer-bench fuzz` runs it as long as you like."""
import json
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from bench.fuzz import fuzz
from tests.conftest import start_server, stop_server

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def base():
    # A short context bounds every generation the fuzz can ask for.
    proc, url, _ = start_server("--kv-cache-gb", "0.1", "--max-model-len", "96", "--max-n", "2",
                                "--max-prompts-per-request", "4")
    yield url
    stop_server(proc)


def test_fuzz_every_route(base):
    report = fuzz(base, examples=40, timeout=10.0, seed=1)
    print(report.line())
    assert report.failures == [], "\n".join(report.failures[:10])
    assert report.sent >= 250 and any(400 <= s < 500 for s in report.statuses) and 200 in report.statuses
    req = urllib.request.Request(base + "/v1/chat/completions", headers={"Content-Type": "application/json"},
                                 data=json.dumps({"messages": [{"role": "user", "content": "Hi"}],
                                                  "max_tokens": 4}).encode())
    with urllib.request.urlopen(req, timeout=30) as r:
        assert r.status == 200 and json.loads(r.read())["choices"]
    with urllib.request.urlopen(base + "/metrics", timeout=10) as r:
        families = {f.name for f in text_string_to_metric_families(r.read().decode())}
    assert "xinfer:request_success" in families
