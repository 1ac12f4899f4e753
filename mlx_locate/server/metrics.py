"""`/metrics`: the HTTP requests (`Observe` counts them), the first boxes, and the worker's counters and gauges
read when scraped.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from .worker import Worker

LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120, 300)


class Metrics:
    """`/metrics` of one app: HTTP requests (by route and status, latency), first boxes, and the worker's
    counters and gauges read when scraped."""

    def __init__(self, worker: Worker):
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "mlx_locate_http_requests", "HTTP requests answered", ["route", "status"], registry=self.registry
        )
        self.latency = Histogram(
            "mlx_locate_http_request_seconds",
            "time from a request's arrival to the end of its answer",
            ["route"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.first_box = Histogram(
            "mlx_locate_first_box_seconds",
            "time from a request's arrival to its first box or point",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.registry.register(WorkerCollector(worker))

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class WorkerCollector:
    """The worker's stats as Prometheus metrics, read at scrape time."""

    def __init__(self, worker: Worker):
        self.worker = worker

    def collect(self):
        w, s = self.worker, self.worker.stats
        steps_per_s, tokens_per_s = s.rates()
        gauges = [
            ("mlx_locate_ready", "1 once the model is loaded and warmed up", float(w.ready)),
            ("mlx_locate_queue_cost", "views x queries accepted and not finished (limit: --max-queue)", w.pending),
            ("mlx_locate_queue_limit", "--max-queue", w.max_queue),
            ("mlx_locate_waiting_requests", "engine requests waiting for a row", s.waiting),
            ("mlx_locate_active_rows", "rows decoding", s.active_rows),
            ("mlx_locate_steps_per_second", "forward steps per second over the last 10 s", steps_per_s),
            ("mlx_locate_tokens_per_second", "generated tokens per second over the last 10 s", tokens_per_s),
        ]
        counters = [
            ("mlx_locate_steps", "forward steps (one host read each)", s.steps),
            ("mlx_locate_tokens", "generated tokens", s.tokens),
            ("mlx_locate_engine_requests", "engine requests accepted (a view of a tiled call is not one)", s.submitted),
            ("mlx_locate_engine_requests_failed", "engine requests that ended with an error", s.failed),
            ("mlx_locate_cancellations", "engine requests cancelled (client gone, timeout)", s.cancelled),
            ("mlx_locate_failed_steps", "steps that raised past the engine's isolation", s.failed_steps),
        ]
        for name, doc, value in gauges:
            yield GaugeMetricFamily(name, doc, value=value)
        for name, doc, value in counters:
            yield CounterMetricFamily(name, doc, value=value)
