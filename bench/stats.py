"""Figures from per-request timings. Times are seconds in records, milliseconds in the figures.

Key names follow vLLM's `vllm bench serve` where it has one (`request_throughput`,
`output_throughput`, `mean_ttft_ms`, `median_tpot_ms`, `p99_itl_ms`, `mean_e2el_ms`, ...).

Definitions (per request, all from the client's side):
- TTFT: from sending the request to the first chunk that carries text.
- TPOT: (e2e latency - TTFT) / (output tokens - 1), for requests with more than one output token.
- ITL: the gaps between successive text chunks (one per chunk, pooled over all requests).
- E2EL: from sending the request to the end of its response.
A request counts toward goodput when it succeeded and meets every SLO given (TTFT and TPOT in ms;
a one-token answer has TPOT 0).
"""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

PERCENTILES = (50, 90, 99)


@dataclass
class RequestRecord:
    ok: bool = False
    error: str = ""
    prompt_len: int = 0  # the server's usage.prompt_tokens when reported, else the generator's count
    output_len: int = 0  # usage.completion_tokens when reported, else the number of text chunks
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens
    usage_reported: bool = False
    start: float = 0.0  # seconds since the run began
    ttft: float | None = None  # seconds; None when not streamed or no text came
    latency: float = 0.0  # seconds, end to end
    chunk_times: list[float] = field(default_factory=list)  # seconds since the run began, text chunks

    @property
    def itl(self) -> list[float]:
        t = self.chunk_times
        return [b - a for a, b in zip(t, t[1:])]

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.output_len < 2:
            return None
        return (self.latency - self.ttft) / (self.output_len - 1)


def percentile(values, p: float) -> float | None:
    """The p-th percentile with linear interpolation between ranks (numpy's default)."""
    xs = sorted(values)
    if not xs:
        return None
    rank = (len(xs) - 1) * p / 100.0
    lo = math.floor(rank)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (rank - lo)


def mean(values) -> float | None:
    values = list(values)
    return sum(values) / len(values) if values else None


def std(values) -> float | None:
    values = list(values)
    if not values:
        return None
    m = sum(values) / len(values)
    return math.sqrt(sum((v - m) ** 2 for v in values) / len(values))


def summarize(name: str, values_s, percentiles=PERCENTILES) -> dict:
    """mean/median/std/pNN of a list of seconds, as `{stat}_{name}_ms` keys."""
    ms = [v * 1000.0 for v in values_s]
    out = {f"mean_{name}_ms": mean(ms), f"median_{name}_ms": percentile(ms, 50), f"std_{name}_ms": std(ms)}
    for p in percentiles:
        out[f"p{p:g}_{name}_ms"] = percentile(ms, p)
    return out


def is_good(r: RequestRecord, slo_ttft_ms: float | None, slo_tpot_ms: float | None) -> bool:
    if not r.ok:
        return False
    if slo_ttft_ms is not None and (r.ttft is None or r.ttft * 1000.0 > slo_ttft_ms):
        return False
    if slo_tpot_ms is not None and (r.tpot or 0.0) * 1000.0 > slo_tpot_ms:
        return False
    return True


def group_errors(records) -> dict[str, int]:
    return dict(Counter(r.error for r in records if not r.ok).most_common())


def compute_metrics(records: list[RequestRecord], duration: float, slo_ttft_ms: float | None = None,
                    slo_tpot_ms: float | None = None, percentiles=PERCENTILES) -> dict:
    ok = [r for r in records if r.ok]
    duration = max(duration, 1e-9)
    n_in = sum(r.prompt_len for r in ok)
    n_out = sum(r.output_len for r in ok)
    m = {
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "total_input_tokens": n_in,
        "total_output_tokens": n_out,
        "duration": duration,
        "request_throughput": len(ok) / duration,
        "output_throughput": n_out / duration,
        "total_token_throughput": (n_in + n_out) / duration,
        "request_goodput": None,
        "slo_ttft_ms": slo_ttft_ms,
        "slo_tpot_ms": slo_tpot_ms,
    }
    if slo_ttft_ms is not None or slo_tpot_ms is not None:
        good = sum(is_good(r, slo_ttft_ms, slo_tpot_ms) for r in records)
        m["good_requests"] = good
        m["request_goodput"] = good / duration
    m.update(summarize("ttft", [r.ttft for r in ok if r.ttft is not None], percentiles))
    m.update(summarize("tpot", [r.tpot for r in ok if r.tpot is not None], percentiles))
    m.update(summarize("itl", [g for r in ok for g in r.itl], percentiles))
    m.update(summarize("e2el", [r.latency for r in ok], percentiles))
    cached = [r.cached_tokens for r in ok if r.cached_tokens is not None]
    m["total_cached_tokens"] = sum(cached) if cached else None
    m["client_prefix_cache_hit_rate"] = (sum(cached) / n_in) if cached and n_in else None
    m["usage_missing"] = sum(not r.usage_reported for r in ok)
    series = token_rate_series(ok, duration)
    m["max_output_tokens_per_s"] = max((v for _, v in series), default=0.0)
    m["max_concurrent_requests"] = max_concurrency(records)
    m["error_counts"] = group_errors(records)
    return m


def token_rate_series(records: list[RequestRecord], duration: float, bin_s: float | None = None):
    """Output tokens per second over time: [(bin start s, tok/s), ...]. Each text chunk of a request
    carries an equal share of its output tokens (servers may pack several tokens in one chunk)."""
    if bin_s is None:
        bin_s = max(1.0, duration / 60.0)
    n_bins = max(1, math.ceil(duration / bin_s))
    bins = [0.0] * n_bins
    for r in records:
        if not r.ok:
            continue
        times = r.chunk_times or [r.start + r.latency]
        share = r.output_len / len(times)
        for t in times:
            bins[min(n_bins - 1, max(0, int(t / bin_s)))] += share
    return [(i * bin_s, v / bin_s) for i, v in enumerate(bins)]


def concurrency_series(records: list[RequestRecord], duration: float, bin_s: float | None = None):
    """Requests in flight at the middle of each bin: [(bin start s, count), ...]."""
    if bin_s is None:
        bin_s = max(1.0, duration / 60.0)
    n_bins = max(1, math.ceil(duration / bin_s))
    out = []
    for i in range(n_bins):
        t = (i + 0.5) * bin_s
        out.append((i * bin_s, sum(1 for r in records if r.start <= t < r.start + r.latency)))
    return out


def max_concurrency(records: list[RequestRecord]) -> int:
    events = sorted([(r.start, 1) for r in records] + [(r.start + r.latency, -1) for r in records],
                    key=lambda e: (e[0], e[1]))
    cur = best = 0
    for _, d in events:
        cur += d
        best = max(best, cur)
    return best


def records_lists(records: list[RequestRecord]) -> dict:
    """Per-request lists for the result file (vLLM's names where it has them)."""
    return {
        "input_lens": [r.prompt_len for r in records],
        "output_lens": [r.output_len for r in records],
        "ttfts": [r.ttft for r in records],
        "itls": [[round(g, 6) for g in r.itl] for r in records],
        "e2els": [r.latency for r in records],
        "start_times": [r.start for r in records],
        "errors": [r.error for r in records],
    }


def fmt(v, digits=2) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    return str(v)


def table(m: dict, title: str = "Serving Benchmark Result") -> str:
    """The terminal summary of one run."""
    rows = [("Successful requests", m["completed"]), ("Failed requests", m["failed"]),
            ("Benchmark duration (s)", m["duration"]), ("Total input tokens", m["total_input_tokens"]),
            ("Total generated tokens", m["total_output_tokens"]),
            ("Request throughput (req/s)", m["request_throughput"]),
            ("Output token throughput (tok/s)", m["output_throughput"]),
            ("Peak output token throughput (tok/s)", m.get("max_output_tokens_per_s")),
            ("Total token throughput (tok/s)", m["total_token_throughput"]),
            ("Max concurrent requests", m.get("max_concurrent_requests"))]
    if m.get("request_goodput") is not None:
        rows.append(("Request goodput (req/s)", m["request_goodput"]))
    if m.get("client_prefix_cache_hit_rate") is not None:
        rows.append(("Prefix cache hit rate (usage)", m["client_prefix_cache_hit_rate"]))
    for k, v in (m.get("server_metrics") or {}).items():
        if k in ("prefix_cache_hit_rate", "preemptions"):
            rows.append((f"Server {k.replace('_', ' ')}", v))
    lines = [f"{'=' * 20} {title} {'=' * 20}"]
    lines += [f"{k + ':':<42}{fmt(v)}" for k, v in rows]
    for name, label in (("ttft", "Time to First Token"), ("tpot", "Time per Output Token (excl. 1st)"),
                        ("itl", "Inter-token Latency"), ("e2el", "End-to-end Latency")):
        lines.append(f"{'-' * 10} {label} (ms) {'-' * 10}")
        keys = ["mean", "median"] + [k.split("_")[0] for k in m if k.startswith("p") and k.endswith(f"_{name}_ms")]
        lines.append("  ".join(f"{k} {fmt(m.get(f'{k}_{name}_ms'))}" for k in keys))
    if m.get("error_counts"):
        lines.append("-" * 10 + " Errors " + "-" * 10)
        lines += [f"{n:>6} x {text}" for text, n in m["error_counts"].items()]
    lines.append("=" * (42 + len(title)))
    return "\n".join(lines)
