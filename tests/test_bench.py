"""xinfer-bench: statistics on recorded timings, the prompt generator, and the modes end to end
against a tiny fake OpenAI-compatible server (plain asyncio, in a thread) and a real xinfer server."""
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from tests.conftest import free_port, stop_server
from tests.fake_openai import FakeServer

pytest.importorskip("aiohttp")
pytest.importorskip("matplotlib")

from bench import cli, cmd_soak, load, stats  # noqa: E402
from bench.stats import RequestRecord  # noqa: E402


# ---------------------------------------------------------------- statistics

def test_percentile_interpolates_like_numpy():
    xs = [15, 20, 35, 40, 50]
    assert stats.percentile(xs, 0) == 15
    assert stats.percentile(xs, 100) == 50
    assert stats.percentile(xs, 50) == 35
    assert stats.percentile(xs, 40) == pytest.approx(29.0)  # rank 1.6: 20 + 0.6 * 15
    assert stats.percentile(xs, 90) == pytest.approx(46.0)  # rank 3.6: 40 + 0.6 * 10
    assert stats.percentile([7], 99) == 7
    assert stats.percentile([], 50) is None
    assert stats.percentile([4, 1, 3, 2], 50) == 2.5  # unsorted input


def recorded():
    """Three recorded requests (seconds since the run began) and one failure."""
    a = RequestRecord(ok=True, prompt_len=10, output_len=5, start=0.0, ttft=0.1, latency=0.5,
                      chunk_times=[0.1, 0.2, 0.3, 0.4, 0.5], usage_reported=True, cached_tokens=0)
    b = RequestRecord(ok=True, prompt_len=20, output_len=3, start=0.2, ttft=0.3, latency=1.1,
                      chunk_times=[0.5, 0.9, 1.3], usage_reported=True, cached_tokens=16)
    c = RequestRecord(ok=True, prompt_len=30, output_len=1, start=1.0, ttft=0.2, latency=0.2,
                      chunk_times=[1.2], usage_reported=True, cached_tokens=0)
    d = RequestRecord(ok=False, error="HTTP 500: boom", start=1.5, latency=0.1)
    return [a, b, c, d]


def test_tpot_and_itl_per_request():
    a, b, c, _ = recorded()
    assert a.tpot == pytest.approx((0.5 - 0.1) / 4)  # 0.1 s
    assert b.tpot == pytest.approx((1.1 - 0.3) / 2)  # 0.4 s
    assert c.tpot is None  # one token: no TPOT
    assert a.itl == pytest.approx([0.1, 0.1, 0.1, 0.1])
    assert b.itl == pytest.approx([0.4, 0.4])
    assert c.itl == []


def test_metrics_on_recorded_timings():
    m = stats.compute_metrics(recorded(), duration=2.0)
    assert m["completed"] == 3 and m["failed"] == 1
    assert m["total_input_tokens"] == 60 and m["total_output_tokens"] == 9
    assert m["request_throughput"] == pytest.approx(1.5)
    assert m["output_throughput"] == pytest.approx(4.5)
    assert m["total_token_throughput"] == pytest.approx(34.5)
    # TTFT of the ok requests: 100, 300, 200 ms
    assert m["mean_ttft_ms"] == pytest.approx(200.0)
    assert m["median_ttft_ms"] == pytest.approx(200.0)
    assert m["p90_ttft_ms"] == pytest.approx(280.0)  # rank 1.8 of [100, 200, 300]
    assert m["p99_ttft_ms"] == pytest.approx(298.0)
    assert m["std_ttft_ms"] == pytest.approx((20000 / 3) ** 0.5)
    # TPOT: 100 and 400 ms (the one-token request has none)
    assert m["mean_tpot_ms"] == pytest.approx(250.0)
    assert m["median_tpot_ms"] == pytest.approx(250.0)
    assert m["p99_tpot_ms"] == pytest.approx(397.0)
    # ITL pooled: four gaps of 100 ms and two of 400 ms
    assert m["mean_itl_ms"] == pytest.approx(200.0)
    assert m["median_itl_ms"] == pytest.approx(100.0)
    assert m["p90_itl_ms"] == pytest.approx(400.0)  # rank 4.5 lies between the two 400s
    # e2e: 500, 1100, 200 ms
    assert m["mean_e2el_ms"] == pytest.approx(600.0)
    assert m["median_e2el_ms"] == pytest.approx(500.0)
    assert m["request_goodput"] is None  # no SLO given
    assert m["error_counts"] == {"HTTP 500: boom": 1}
    assert m["total_cached_tokens"] == 16
    assert m["client_prefix_cache_hit_rate"] == pytest.approx(16 / 60)
    assert m["max_concurrent_requests"] == 2  # a and b overlap; c and d each alone
    assert m["usage_missing"] == 0


def test_goodput_with_slos():
    recs = recorded()
    m = stats.compute_metrics(recs, 2.0, slo_ttft_ms=250)  # a (100) and c (200) pass; b (300) fails
    assert m["good_requests"] == 2 and m["request_goodput"] == pytest.approx(1.0)
    m = stats.compute_metrics(recs, 2.0, slo_tpot_ms=150)  # a (100) and c (one token: 0) pass
    assert m["good_requests"] == 2
    m = stats.compute_metrics(recs, 2.0, slo_ttft_ms=150, slo_tpot_ms=150)  # only a
    assert m["good_requests"] == 1 and m["request_goodput"] == pytest.approx(0.5)
    m = stats.compute_metrics(recs, 4.0, slo_ttft_ms=1e9, slo_tpot_ms=1e9)  # the failure never counts
    assert m["good_requests"] == 3 and m["request_goodput"] == pytest.approx(0.75)


def test_token_rate_and_concurrency_series():
    recs = recorded()
    ok = [r for r in recs if r.ok]
    s = stats.token_rate_series(ok, 2.0, bin_s=1.0)
    # second 0: a's 5 chunks (5 tokens) + b's chunks at 0.5 and 0.9 (1 token each); second 1: b 1.3 + c 1.2
    assert s == [(0.0, 7.0), (1.0, 2.0)]
    c = stats.concurrency_series(recs, 2.0, bin_s=1.0)
    assert c == [(0.0, 1), (1.0, 1)]  # at 0.5 s: b (a ends exactly then); at 1.5 s: d


def test_prometheus_parse_and_delta():
    before = load.parse_prometheus("# HELP x\nvllm:prefix_cache_queries_total{model=\"m\"} 100\n"
                                   "vllm:prefix_cache_hits_total{model=\"m\"} 20\nvllm:num_preemptions_total 1\n")
    after = load.parse_prometheus("vllm:prefix_cache_queries_total{model=\"m\"} 300\n"
                                  "vllm:prefix_cache_hits_total{model=\"m\"} 170\nvllm:num_preemptions_total 4\n"
                                  "other_metric 5\n")
    d = load.metrics_delta(before, after)
    assert d["prefix_cache_hit_rate"] == pytest.approx(0.75)
    assert d["preemptions"] == 3
    assert "other_metric" not in d["deltas"]
    assert load.metrics_delta(None, after) is None


# ---------------------------------------------------------------- prompts

def word_tokenizer(tmp_path):
    """A tiny word-level tokenizer with byte-level pieces ("Ġword"), saved as tokenizer.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    words = sorted(set(load.WORDS))
    vocab = {"<unk>": 0, **{"Ġ" + w: i + 1 for i, w in enumerate(words)}, **{w: i + 1 + len(words)
                                                                              for i, w in enumerate(words)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    tok.decoder = decoders.ByteLevel()
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    return str(path)


def test_random_prompts_are_deterministic(tmp_path):
    maker = load.load_text_maker("words")
    a = load.RandomPrompts(maker, 50, 20, range_ratio=0.5, seed=7)
    b = load.RandomPrompts(maker, 50, 20, range_ratio=0.5, seed=7)
    c = load.RandomPrompts(maker, 50, 20, range_ratio=0.5, seed=8)
    ra = [a.get(i) for i in range(10)]
    assert ra == [b.get(i) for i in reversed(range(10))][::-1]  # per index, whatever the order
    assert [r.text for r in ra] != [c.get(i).text for i in range(10)]
    for r in ra:
        assert 25 <= r.prompt_len <= 75 and 10 <= r.output_len <= 30
        assert len(r.text.split()) == r.prompt_len
    assert len({r.prompt_len for r in ra}) > 1  # the range ratio varies lengths
    longer = load.RandomPrompts(maker, 100, 20, seed=7).get(0)  # another shape shares no prefix
    assert longer.text.split()[:5] != a.get(0).text.split()[:5]

    maker = load.load_text_maker(word_tokenizer(tmp_path))
    assert maker.tok is not None and len(maker.pool) > 100
    p = load.RandomPrompts(maker, 40, 8, seed=3)
    r = p.get(5)
    assert maker.count(r.text) == 40 == r.prompt_len
    assert r == load.RandomPrompts(maker, 40, 8, seed=3).get(5)


def test_shared_prefix_groups():
    maker = load.load_text_maker("words")
    p = load.RandomPrompts(maker, 10, 4, seed=1, prefix_groups=3, prefix_len=30)
    reqs = [p.get(i) for i in range(6)]
    assert reqs[0].system == reqs[3].system and reqs[1].system == reqs[4].system
    assert len({r.system for r in reqs}) == 3
    assert reqs[0].text != reqs[3].text
    assert reqs[0].prompt_len == 40
    msgs = reqs[0].chat_messages()
    assert msgs[0] == {"role": "system", "content": reqs[0].system} and msgs[1]["role"] == "user"


def test_datasets(tmp_path):
    maker = load.load_text_maker("words")
    j = tmp_path / "p.jsonl"
    j.write_text('{"prompt": "one two three", "output_len": 5}\n\n'
                 '{"messages": [{"role": "user", "content": "hi there"}]}\n')
    ds = load.load_dataset(str(j), "jsonl", maker, 7, seed=0)
    got = sorted((r.prompt_len, r.output_len) for r in ds.items)
    assert got == [(2, 7), (3, 5)]
    s = tmp_path / "sg.json"
    s.write_text(json.dumps([
        {"conversations": [{"from": "human", "value": "a b c d e"}, {"from": "gpt", "value": "x y z w v u"}]},
        {"conversations": [{"from": "human", "value": "short"}, {"from": "gpt", "value": "a b c d"}]},
        {"conversations": [{"from": "human", "value": "only one turn"}]}]))
    ds = load.load_dataset(str(s), "sharegpt", maker, 0, seed=0)
    assert [(r.text, r.prompt_len, r.output_len) for r in ds.items] == [("a b c d e", 5, 6)]


def test_loopback_only_by_default():
    assert load.is_loopback("http://127.0.0.1:8000/v1") and load.is_loopback("http://localhost:1/v1")
    assert not load.is_loopback("http://10.0.0.1:8000/v1")
    assert cli.DEFAULT_URL.startswith("http://127.0.0.1:")
    assert load.root_url("http://127.0.0.1:8000/v1") == "http://127.0.0.1:8000"


# ---------------------------------------------------------------- a fake streaming server

@pytest.fixture(scope="module")
def fake():
    srv = FakeServer()
    yield srv
    srv.close()


def read_result(out_dir, prefix):
    files = sorted(os.listdir(out_dir))
    js = [f for f in files if f.startswith(prefix) and f.endswith(".json")]
    assert len(js) == 1, files
    return json.loads((out_dir / js[0]).read_text()), files


def test_serve_against_fake_server(fake, tmp_path):
    rc = cli.main(["serve", "--base-url", fake.url, "--num-requests", "6", "--concurrency", "3",
                   "--input-len", "20", "--output-len", "10", "--tokenizer", "words", "--warmup", "1",
                   "--slo-ttft", "1000", "--output-dir", str(tmp_path), "--result-name", "run", "--quiet"])
    assert rc == 0
    r, files = read_result(tmp_path, "run")
    assert "run-latency.png" in files and "run-throughput.png" in files
    for f in ("run-latency.png", "run-throughput.png"):
        data = (tmp_path / f).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) < 200_000
    for k in ("completed", "failed", "duration", "request_throughput", "output_throughput", "total_token_throughput",
              "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "p90_tpot_ms", "mean_itl_ms",
              "p99_itl_ms", "mean_e2el_ms", "p99_e2el_ms", "request_goodput", "input_lens", "output_lens", "ttfts",
              "itls", "errors", "server_metrics", "max_concurrency", "date", "machine", "model", "config"):
        assert k in r, k
    assert r["completed"] == 6 and r["failed"] == 0 and r["model"] == "fake"
    assert r["total_output_tokens"] == 60 and r["output_lens"] == [10] * 6
    assert r["max_concurrency"] == 3 and r["max_concurrent_requests"] <= 3
    assert all(len(x) == 9 for x in r["itls"])
    assert 15 < r["mean_ttft_ms"] < 1000  # the fake waits 20 ms before the first token
    assert 3 < r["mean_tpot_ms"] < 100
    assert r["good_requests"] == 6
    assert r["server_metrics"]["prefix_cache_hit_rate"] == pytest.approx(0.5, abs=0.05)
    assert r["client_prefix_cache_hit_rate"] == pytest.approx(0.5, abs=0.1)
    sent = fake.requests[-6:]
    assert all(q["ignore_eos"] is True and q["min_tokens"] == 10 and q["stream"] for q in sent)
    assert all(q["stream_options"] == {"include_usage": True} for q in sent)
    assert all(len(q["messages"][0]["content"].split()) == 20 for q in sent)


def test_serve_sweep_completions_no_stream(fake, tmp_path):
    rc = cli.main(["serve", "--base-url", fake.url, "--sweep", "concurrency=1,2", "--num-requests", "3",
                   "--endpoint", "completions", "--no-stream", "--output-len", "5", "--input-len", "8",
                   "--tokenizer", "words", "--warmup", "0", "--output-dir", str(tmp_path), "--result-name", "sw",
                   "--quiet"])
    assert rc == 0
    r, files = read_result(tmp_path, "sw")
    assert "sw-sweep.png" in files and "sw-latency.png" in files
    assert r["mode"] == "sweep" and [x["sweep_value"] for x in r["runs"]] == [1, 2]
    assert all(x["completed"] == 3 and x["total_output_tokens"] == 15 for x in r["runs"])
    assert "prompt" in fake.requests[-1] and not fake.requests[-1]["stream"]


def test_request_rate_and_duration(fake, tmp_path):
    rc = cli.main(["serve", "--base-url", fake.url, "--request-rate", "20", "--arrival", "constant",
                   "--num-requests", "5", "--output-len", "3", "--input-len", "4", "--tokenizer", "words",
                   "--warmup", "0", "--output-dir", str(tmp_path), "--result-name", "rate", "--no-plots", "--quiet"])
    assert rc == 0
    r, _ = read_result(tmp_path, "rate")
    gaps = [b - a for a, b in zip(r["start_times"], r["start_times"][1:])]
    assert r["completed"] == 5 and all(0.03 < g < 0.2 for g in gaps)  # one every 50 ms
    rc = cli.main(["serve", "--base-url", fake.url, "--request-rate", "40", "--duration", "1",
                   "--output-len", "3", "--input-len", "4", "--tokenizer", "words", "--warmup", "0",
                   "--output-dir", str(tmp_path), "--result-name", "dur", "--no-plots", "--quiet"])
    assert rc == 0
    r, _ = read_result(tmp_path, "dur")
    assert 10 < r["completed"] < 80 and max(r["start_times"]) < 1.0 and r["duration"] < 3  # Poisson, ~40/s


def test_errors_are_grouped(fake, tmp_path):
    rc = cli.main(["serve", "--base-url", fake.url, "--model", "nope", "--num-requests", "4", "--concurrency", "2",
                   "--tokenizer", "words", "--warmup", "0", "--output-dir", str(tmp_path), "--result-name", "err",
                   "--no-plots", "--quiet"])
    assert rc == 1
    r, _ = read_result(tmp_path, "err")
    assert r["completed"] == 0 and r["failed"] == 4
    assert r["error_counts"] == {'HTTP 404: {"error": {"message": "model nope not found"}}': 4}


def test_compare_against_fake_servers(fake, tmp_path):
    slow = FakeServer(first_s=0.06, gap_s=0.008, metrics=False)
    try:
        rc = cli.main(["compare", "--target", f"fast={fake.url}", "--target", f"slow={slow.url}",
                       "--scenario", "cpu-smoke", "--num-requests", "4", "--tokenizer", "words",
                       "--repeats", "2", "--output-dir", str(tmp_path), "--result-name", "cmp", "--quiet"])
    finally:
        slow.close()
    assert rc == 0
    r, files = read_result(tmp_path, "cmp")
    assert "cmp-compare.png" in files and "cmp-latency.png" in files
    assert r["mode"] == "compare" and r["scenario"] == "cpu-smoke"
    fast, slw = r["targets"]
    assert fast["name"] == "fast" and slw["name"] == "slow"
    assert [x["repeat"] for x in fast["runs"]] == [0, 1] and len(slw["runs"]) == 2
    assert fast["summary"]["completed"] == 4 and slw["summary"]["completed"] == 4
    assert fast["ratio"]["output_throughput"] == pytest.approx(1.0)
    assert slw["ratio"]["mean_ttft_ms"] > 1.5  # the slow one waits 3x longer for the first token
    assert slw["ratio"]["output_throughput"] < 1.0
    assert fast["runs"][0]["config"]["input_len"] == 32  # the scenario's shape
    assert [x["config"]["seed"] for x in fast["runs"]] == [0, 1]  # fresh prompts each round
    sent = [q["messages"][0]["content"] for q in fake.requests[-10:]]
    sent = [t for t in sent if len(t.split()) == 32]  # not the (16-word) warm-ups
    assert len(sent) == 8 and len(set(sent)) == 8  # 4 prompts in round 1, 4 others in round 2
    assert slw["runs"][0]["server_metrics"] is None  # no /metrics there: handled


def test_compare_starts_each_server_in_turn(tmp_path):
    """--serve: a target's server runs only for its own runs, so the servers never share the machine."""
    script, log = tmp_path / "fake_serve.py", tmp_path / "starts.txt"
    script.write_text("import sys, time\n"
                      f"sys.path.insert(0, {os.path.dirname(os.path.dirname(os.path.abspath(__file__)))!r})\n"
                      "from tests.fake_openai import FakeServer\n"
                      "open(sys.argv[3], 'a').write(sys.argv[1] + '\\n')\n"
                      "FakeServer(port=int(sys.argv[2]))\n"
                      "time.sleep(600)\n")
    ports = {"a": free_port(), "b": free_port()}
    args = ["compare", "--scenario", "cpu-smoke", "--num-requests", "2", "--tokenizer", "words", "--repeats", "2",
            "--output-dir", str(tmp_path), "--result-name", "turn", "--no-plots", "--quiet"]
    for n, port in ports.items():
        args += ["--target", f"{n}=http://127.0.0.1:{port}/v1",
                 "--serve", f"{n}={sys.executable} {script} {n} {port} {log}"]
    assert cli.main(args) == 0
    assert log.read_text().split() == ["a", "b", "a", "b"]  # started for each run, in the rounds' order
    r, _ = read_result(tmp_path, "turn")
    assert [t["summary"]["completed"] for t in r["targets"]] == [2, 2] and r["targets"][0]["serve"]
    for port in ports.values():  # stopped after its runs
        with pytest.raises(OSError):
            urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2)
    with pytest.raises(SystemExit, match="exited"):
        cli.main(["compare", "--target", f"a=http://127.0.0.1:{free_port()}/v1", "--serve", "a=exit 3",
                  "--num-requests", "1", "--output-dir", str(tmp_path), "--quiet"])
    up = FakeServer()
    try:
        with pytest.raises(SystemExit, match="already answers"):  # it would measure another server
            cli.main(["compare", "--target", f"a={up.url}", "--serve", "a=sleep 60", "--num-requests", "1",
                      "--output-dir", str(tmp_path), "--quiet"])
    finally:
        up.close()
    with pytest.raises(SystemExit, match="NAME=COMMAND"):
        cli.main(["compare", "--target", "a=http://127.0.0.1:1/v1", "--serve", "b=true", "--quiet"])


def test_soak_against_fake_server(fake, tmp_path):
    rc = cli.main(["soak", "--base-url", fake.url, "--duration", "2.5", "--concurrency", "2",
                   "--input-len", "8", "--output-len", "8", "--tokenizer", "words", "--sample-interval", "0.5",
                   "--max-rss-growth-mb", "10000", "--output-dir", str(tmp_path), "--result-name", "soak",
                   "--quiet"])
    assert rc == 0
    r, files = read_result(tmp_path, "soak")
    assert "soak-soak.png" in files
    assert r["mode"] == "soak" and r["passed"] and r["completed"] > 4
    assert r["server_pid"] == os.getpid()  # the fake listens in this process
    assert len(r["rss_samples"]) >= 3 and r["rss_max_mb"] > 10
    assert r["throughput_drift_pct"] is not None
    assert 2.4 < r["duration"] < 10  # stopped by itself


def test_rss_growth_check():
    flat = [(t, 500 * 2**20) for t in range(0, 100, 5)]
    assert cmd_soak.rss_growth(flat) == (0.0, 0.0)
    growing = [(t, (500 + t) * 2**20) for t in range(0, 100, 5)]
    g, slope = cmd_soak.rss_growth(growing)
    assert g > 50 and slope == pytest.approx(60.0)  # 1 MiB/s


# ---------------------------------------------------------------- a real xinfer server

@pytest.fixture(scope="module")
def xinfer_server():
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "xinfer.cli", "--log-level", "warning", "serve",
                             "--port", str(port), "--kv-cache-gb", "0.2"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + 180
    while time.time() < deadline:
        try:
            with urllib.request.urlopen(base + "/health", timeout=2) as r:
                if r.status == 200:
                    break
        except (urllib.error.HTTPError, OSError):
            pass
        if proc.poll() is not None:
            pytest.fail("server exited: " + proc.stdout.read())
        time.sleep(0.5)
    else:
        proc.kill()
        pytest.fail("server did not become healthy")
    yield base + "/v1"
    stop_server(proc)


def test_serve_and_compare_against_xinfer(xinfer_server, tmp_path):
    rc = cli.main(["serve", "--base-url", xinfer_server, "--num-requests", "6", "--concurrency", "2",
                   "--input-len", "16", "--output-len", "4", "--tokenizer", "words", "--warmup", "0",
                   "--output-dir", str(tmp_path), "--result-name", "x", "--quiet"])
    assert rc == 0
    r, files = read_result(tmp_path, "x")
    assert r["completed"] == 6 and r["failed"] == 0
    assert r["output_lens"] == [4] * 6  # ignore_eos + min_tokens: exact lengths
    assert all(n > 16 for n in r["input_lens"])  # the server's count, chat template included
    assert r["mean_ttft_ms"] > 0 and r["mean_tpot_ms"] > 0 and r["output_throughput"] > 0
    assert "x-latency.png" in files
    rc = cli.main(["compare", "--target", f"a={xinfer_server}", "--target", f"b={xinfer_server}",
                   "--num-requests", "2", "--concurrency", "2", "--input-len", "8", "--output-len", "2",
                   "--tokenizer", "words", "--warmup", "0", "--endpoint", "completions",
                   "--output-dir", str(tmp_path), "--result-name", "xc", "--no-plots", "--quiet"])
    assert rc == 0
    r, _ = read_result(tmp_path, "xc")
    assert [t["summary"]["completed"] for t in r["targets"]] == [2, 2]
    assert r["targets"][1]["ratio"]["output_throughput"] > 0


# ---------------------------------------------------------------- offline

def test_offline_on_tiny_model(tiny_llama_path, tmp_path):
    rc = cli.main(["offline", "--m", tiny_llama_path, "--num-seqs", "5", "--min-input-len", "4",
                   "--max-input-len", "9", "--min-output-len", "2", "--max-output-len", "6", "--max-model-len", "64",
                   "--kv-cache-gb", "0.01", "--output-dir", str(tmp_path), "--result-name", "off", "--quiet"])
    assert rc == 0
    r, files = read_result(tmp_path, "off")
    assert "off-throughput.png" in files
    assert r["mode"] == "offline" and r["completed"] == 5 and r["failed"] == 0
    assert all(4 <= n <= 9 for n in r["input_lens"]) and all(2 <= n <= 6 for n in r["output_lens"])
    assert r["total_output_tokens"] == sum(r["output_lens"]) and r["output_throughput"] > 0
    assert r["mean_ttft_ms"] > 0 and r["engine_config"]["max_model_len"] == 64
    # the original xInfer shape: N copies of one prompt, max_tokens clipped to fit the context
    rc = cli.main(["offline", "--m", tiny_llama_path, "--batch", "3", "--input-len", "8", "--max-tokens", "1024",
                   "--max-model-len", "20", "--kv-cache-gb", "0.01", "--output-dir", str(tmp_path),
                   "--result-name", "batch", "--no-plots", "--quiet"])
    assert rc == 0
    r, _ = read_result(tmp_path, "batch")
    assert r["input_lens"] == [8] * 3 and r["output_lens"] == [12] * 3


def test_offline_against_baseline_kernels(tiny_llama_path, tmp_path):
    """Whole runs alternated between two kernel builds (here the current source as its own baseline);
    the shipped kernels are back in place afterwards."""
    from ops import cpu_kernels
    args = ["offline", "--m", tiny_llama_path, "--num-seqs", "3", "--min-input-len", "4", "--max-input-len", "9",
            "--min-output-len", "2", "--max-output-len", "4", "--max-model-len", "64", "--kv-cache-gb", "0.01",
            "--output-dir", str(tmp_path), "--result-name", "ab", "--quiet", "--rounds", "2"]
    assert cli.main(args + ["--baseline-kernels", str(tmp_path / "missing.c")]) == 2
    if not cpu_kernels.available():
        return
    shipped = cpu_kernels.lib()
    assert cli.main(args + ["--baseline-kernels", str(cpu_kernels.SRC)]) == 0
    r = json.loads((tmp_path / "ab.json").read_text())
    assert r["mode"] == "offline-kernels" and len(r["seconds"]["current"]) == len(r["seconds"]["baseline"]) == 2
    assert r["speedup_best"] > 0 and r["output_tokens"] > 0
    assert cpu_kernels.lib() is shipped


def test_models_sweep_end_to_end(tiny_llama_path, tmp_path):
    """`xinfer-bench models` on two tiny models: a chat model whose template reads enable_thinking
    (both answers, flagged: random weights repeat themselves) and a dummy-weights one (timing only)."""
    from tests.conftest import make_chat_model
    template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                "{% if enable_thinking %}<think>{% endif %}assistant:")
    chat = make_chat_model(tiny_llama_path, tmp_path / "chat", template)
    out = tmp_path / "sweep.json"
    r = subprocess.run([sys.executable, "-m", "bench.cli", "models", chat, "--max-tokens", "24", "--prompt-words", "60",
                        "--output", str(out), "--serve-args", "--max-model-len 1024"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    row = json.loads(out.read_text())["models"][0]
    assert row["thinking_off"]["completion_tokens"] == 24 and row["thinking_on"]["completion_tokens"] == 24
    assert row["verdict"] in ("ok", "repetitive", "repetitive, repetitive") and "| thinking off |" in r.stdout
    r = subprocess.run([sys.executable, "-m", "bench.cli", "models", tiny_llama_path, "--max-tokens", "16",
                        "--output", str(out), "--serve-args", "--load-format dummy"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    row = json.loads(out.read_text())["models"][0]
    assert row["verdict"] == "timing only" and row["thinking_off"]["completion_tokens"] == 16


def test_formats_on_tiny_model(tmp_path):
    """`xinfer-bench formats` on a tiny Llama with 256-wide rows: the float folder, --isq K-quants and
    checkpoint formats written from it, each loaded, timed and scored; the in-place formats on blocks."""
    import torch
    import transformers as tf
    from ops import cpu_kernels
    torch.manual_seed(0)
    cfg = tf.LlamaConfig(vocab_size=128, hidden_size=256, intermediate_size=512, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, eos_token_id=1)
    tf.LlamaForCausalLM(cfg).save_pretrained(tmp_path / "tiny")
    out = tmp_path / "formats.json"
    rc = cli.main(["formats", "--m", str(tmp_path / "tiny"), "--formats", "float,q4_k,gptq-4bit-g64,nvfp4",
                   "--tokens", "48", "--decode-tokens", "8", "--batch", "2", "--workdir", str(tmp_path / "w"),
                   "--output", str(out)])
    assert rc == 0
    rows = {r["name"]: r for r in json.loads(out.read_text())["rows"]}
    assert list(rows) == ["float", "q4_k", "gptq-4bit-g64", "nvfp4"]
    assert all(r["single_tok_s"] > 0 and r["weight_mib"] > 0 and r["mean_kld"] >= 0 for r in rows.values())
    if cpu_kernels.available():
        assert rows["float"]["linears_on_blocks"] == 0
        assert rows["q4_k"]["linears_on_blocks"] == rows["gptq-4bit-g64"]["linears_on_blocks"] == 4  # fused qkv, o, gate-up, down
    assert rows["float"]["mean_kld"] < rows["q4_k"]["mean_kld"] < 0.1


def test_attention_command(tmp_path):
    """`xinfer-bench attention`: each KV format's decode attention step, C kernels against the torch path."""
    from ops import cpu_kernels
    out = tmp_path / "attention.json"
    assert cli.main(["attention", "--batch", "2", "--context", "40", "--layers", "2", "--repeats", "1",
                     "--kvcache-dtype", "auto,turbo4", "--output", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["kvcache_dtype"] for r in rows] == ["auto", "turbo4"] and all(r["torch_ms"] > 0 for r in rows)
    assert all(("speedup" in r) == cpu_kernels.available() for r in rows)
    assert cli.main(["attention", "--prefill", "--batch", "2", "--context", "40", "--layers", "1", "--repeats", "1",
                     "--kvcache-dtype", "bf16", "--output", str(out)]) == 0
    got = json.loads(out.read_text())
    assert got["prefill"] and got["rows"][0]["torch_gflops"] > 0
    if cpu_kernels.available():  # the current source as its own baseline: the build cache's copy, outputs equal
        assert cli.main(["attention", "--batch", "2", "--context", "150", "--layers", "1", "--repeats", "1",
                         "--kvcache-dtype", "bf16", "--baseline-kernels", str(cpu_kernels.SRC), "--output", str(out)]) == 0
        row = json.loads(out.read_text())["rows"][0]
        assert row["vs_baseline"] > 0 and row["max_diff_vs_baseline"] == 0.0
    assert cli.main(["attention", "--baseline-kernels", str(tmp_path / "missing.c")]) == 2


def test_fuzz_bodies_are_capped_where_null_or_absent():
    from bench.fuzz import bounded
    assert bounded("/v1/responses", {"max_output_tokens": None})["max_output_tokens"] == 8  # null: no cap
    assert bounded("/v1/chat/completions", {})["max_tokens"] == 8
    assert bounded("/v1/chat/completions", {"max_tokens": 500})["max_tokens"] == 8
    assert bounded("/v1/responses", {"max_output_tokens": "x"}) == {"max_output_tokens": "x"}  # bad input kept
    assert bounded("/v1/embeddings", {"input": "a"}) == {"input": "a"}
