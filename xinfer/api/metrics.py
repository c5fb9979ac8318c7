"""Prometheus metrics: engine gauges/counters from the engine core's Stats messages, and
request-level latency histograms measured in the API process."""
from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, SummaryMetricFamily

from xinfer.ipc.api import Stats


_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
_ITL_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0)
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)
FINISH_REASONS = ("stop", "length", "abort")
REJECT_REASONS = ("loading", "draining", "full", "queue_timeout")
CHILDREN = ("xinfer::worker-0", "xinfer::detokenizer", "xinfer::parser")


class Metrics:
    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        self.stats = Stats(0, 0, 0.0, 0, 0, 0, 0, 0)
        self.model = model_name
        self.registry.register(self)
        labels = ["model_name"]
        self.ttft = Histogram("xinfer:time_to_first_token_seconds", "Time to first token", labels,
                              buckets=_BUCKETS, registry=self.registry)
        self.itl = Histogram("xinfer:inter_token_latency_seconds", "Time between output tokens of a request",
                             labels, buckets=_ITL_BUCKETS, registry=self.registry)
        self.e2e = Histogram("xinfer:e2e_request_latency_seconds", "End-to-end request latency", labels,
                             buckets=_BUCKETS, registry=self.registry)
        self.queue = Histogram("xinfer:request_queue_time_seconds", "Time from arrival to first scheduled",
                               labels, buckets=_BUCKETS, registry=self.registry)
        self.prompt_tokens = Histogram("xinfer:request_prompt_tokens", "Prompt tokens per request", labels,
                                       buckets=_TOKEN_BUCKETS, registry=self.registry)
        self.generation_tokens = Histogram("xinfer:request_generation_tokens", "Generated tokens per request",
                                           labels, buckets=_TOKEN_BUCKETS, registry=self.registry)
        self.finished = Counter("xinfer:request_success", "Finished requests by finish reason",
                                labels + ["finished_reason"], registry=self.registry)
        self.rejected = Counter("xinfer:request_rejected", "Requests refused with 503, by reason",
                                labels + ["reason"], registry=self.registry)
        # Every family is exported before any traffic (dashboards and alerts expect the series).
        for h in (self.ttft, self.itl, self.e2e, self.queue, self.prompt_tokens, self.generation_tokens):
            h.labels(model_name)
        for r in REJECT_REASONS:
            self.rejected.labels(model_name, r)
        for r in FINISH_REASONS:
            self.finished.labels(model_name, r)

    def reject(self, reason: str) -> None:
        """A request refused with 503, counted by reason (its answer is logged where it is made: app.py)."""
        self.rejected.labels(self.model, reason).inc()

    def request_done(self, reason: str, prompt_tokens: int, generation_tokens: int, queue_time: float) -> None:
        """One choice finished (each of a request's n choices counts as a request, as in vLLM)."""
        self.finished.labels(self.model, "stop" if reason == "abort" else reason).inc()
        self.prompt_tokens.labels(self.model).observe(prompt_tokens)
        self.generation_tokens.labels(self.model).observe(generation_tokens)
        self.queue.labels(self.model).observe(queue_time)

    def request(self, prompt_tokens: int) -> RequestMetrics:
        """The recorder of one request (one prompt, all its choices), timed from now."""
        return RequestMetrics(self, prompt_tokens)

    def collect(self):
        s, m = self.stats, [self.model]
        for name, doc, value in (
                ("xinfer:num_requests_running", "Sequences in the running batch", s.num_running),
                ("xinfer:num_requests_waiting", "Sequences waiting to be scheduled", s.num_waiting),
                ("xinfer:kv_cache_usage_perc", "Share of KV cache blocks in use (0-1)", s.kv_cache_usage),
                ("xinfer:kv_cache_capacity_tokens", "Tokens the KV cache holds (in its --kvcache-dtype)",
                 s.kv_cache_capacity_tokens)):
            g = GaugeMetricFamily(name, doc, labels=["model_name"])
            g.add_metric(m, value)
            yield g
        for name, doc, value in (
                ("xinfer:prompt_tokens", "Prompt tokens processed", s.prompt_tokens),
                ("xinfer:generation_tokens", "Tokens generated", s.generation_tokens),
                ("xinfer:prefix_cache_queries", "Prompt tokens looked up in the prefix cache", s.prompt_tokens),
                ("xinfer:prefix_cache_hits", "Prompt tokens served from the prefix cache",
                 s.prefix_cache_hit_tokens),
                ("xinfer:num_preemptions", "Sequences preempted for KV space", s.preemptions),
                ("xinfer:worker_restarts", "Model worker restarts", s.worker_restarts),
                ("xinfer:spec_decode_num_draft_tokens", "Speculative draft tokens verified", s.spec_draft_tokens),
                ("xinfer:spec_decode_num_accepted_tokens", "Speculative draft tokens accepted",
                 s.spec_accepted_tokens)):
            c = CounterMetricFamily(name, doc, labels=["model_name"])
            c.add_metric(m, value)
            yield c
        r = SummaryMetricFamily("xinfer:child_restart_seconds", "Time from a child's death to its replacement "
                                "being up (the worker also reloads the model)", labels=["model_name", "child"])
        for child in CHILDREN:
            n, total = next(((n, t) for c, n, t in s.restart_seconds if c == child), (0, 0.0))
            r.add_metric(m + [child], n, total)
        yield r

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RequestMetrics:
    """Latencies and outcomes of one request as its outputs arrive."""

    def __init__(self, metrics: Metrics, prompt_tokens: int):
        self.m = metrics
        self.prompt_tokens = prompt_tokens
        self.start = self.last = time.monotonic()
        self.first = True

    def tokens(self, new_tokens: int) -> None:
        """An output arrived carrying `new_tokens` tokens not seen before."""
        if not new_tokens:
            return
        m, now = self.m, time.monotonic()
        if self.first:
            m.ttft.labels(m.model).observe(now - self.start)
            new_tokens -= 1
            self.first = False
        for _ in range(new_tokens):  # tokens that arrive together: spread over the gap
            m.itl.labels(m.model).observe((now - self.last) / new_tokens)
        self.last = now

    def choice_done(self, reason: str, generation_tokens: int, queue_time: float) -> None:
        self.m.request_done(reason, self.prompt_tokens, generation_tokens, queue_time)

    def done(self) -> None:
        """Every choice finished."""
        self.m.e2e.labels(self.m.model).observe(time.monotonic() - self.start)

    def aborted(self, choices: int) -> None:
        """`choices` ended unfinished (the client went away, or an error)."""
        self.m.finished.labels(self.m.model, "abort").inc(choices)
