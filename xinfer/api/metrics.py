"""Prometheus metrics: engine gauges/counters from the engine core's Stats messages, and
request-level latency histograms measured in the API process."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from xinfer.ipc.api import Stats

_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)


class Metrics:
    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        self.stats = Stats(0, 0, 0.0, 0, 0, 0, 0, 0)
        self.model = model_name
        self.registry.register(self)
        labels = ["model_name"]
        self.ttft = Histogram("xinfer:time_to_first_token_seconds", "Time to first token", labels,
                              buckets=_BUCKETS, registry=self.registry)
        self.e2e = Histogram("xinfer:e2e_request_latency_seconds", "End-to-end request latency", labels,
                             buckets=_BUCKETS, registry=self.registry)
        self.finished = Counter("xinfer:request_success", "Finished requests by finish reason",
                                labels + ["finished_reason"], registry=self.registry)
        self.rejected = Counter("xinfer:request_rejected", "Requests refused with 503 (loading, draining, full)",
                                labels, registry=self.registry)

    def collect(self):
        s, m = self.stats, [self.model]
        for name, doc, value in (
                ("xinfer:num_requests_running", "Sequences in the running batch", s.num_running),
                ("xinfer:num_requests_waiting", "Sequences waiting to be scheduled", s.num_waiting),
                ("xinfer:kv_cache_usage_perc", "Share of KV cache blocks in use (0-1)", s.kv_cache_usage)):
            g = GaugeMetricFamily(name, doc, labels=["model_name"])
            g.add_metric(m, value)
            yield g
        for name, doc, value in (
                ("xinfer:prompt_tokens", "Prompt tokens processed", s.prompt_tokens),
                ("xinfer:generation_tokens", "Tokens generated", s.generation_tokens),
                ("xinfer:prefix_cache_hit_tokens", "Prompt tokens served from the prefix cache",
                 s.prefix_cache_hit_tokens),
                ("xinfer:num_preemptions", "Sequences preempted for KV space", s.preemptions),
                ("xinfer:worker_restarts", "Model worker restarts", s.worker_restarts)):
            c = CounterMetricFamily(name, doc, labels=["model_name"])
            c.add_metric(m, value)
            yield c

    def render(self) -> bytes:
        return generate_latest(self.registry)
