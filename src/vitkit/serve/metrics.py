"""The server's Prometheus metrics, in a registry of its own (so that two apps in one process keep apart):
requests by endpoint and status, request latency, the time each image waited for its batch, batch sizes and
the time each batch took on the model."""

from __future__ import annotations

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

# Request latency and queue time, in seconds: from a millisecond to the default 30 s timeout.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
BATCH_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 128, 256)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("vitkit_requests", "HTTP requests answered, by endpoint and status code.",
                                ["endpoint", "status"], registry=r)
        self.latency = Histogram("vitkit_request_latency_seconds",
                                 "Time from a request's arrival to its answer.",
                                 ["endpoint"], buckets=LATENCY_BUCKETS, registry=r)
        self.queue_time = Histogram("vitkit_queue_time_seconds", "Time an image waited before its batch ran.",
                                    buckets=LATENCY_BUCKETS, registry=r)
        self.batch_size = Histogram("vitkit_batch_size", "Images per batch run on the model.",
                                    buckets=BATCH_BUCKETS, registry=r)
        self.batch_time = Histogram("vitkit_batch_seconds", "Time the model took for one batch.",
                                    buckets=LATENCY_BUCKETS, registry=r)
        self.queue_depth = Gauge("vitkit_queue_depth", "Images waiting for a batch.", registry=r)
        self.in_flight = Gauge("vitkit_requests_in_flight", "Requests being answered.", registry=r)

    def observe_batch(self, size: int, waits: list[float]) -> None:
        self.batch_size.observe(size)
        for w in waits:
            self.queue_time.observe(w)

    def exposition(self) -> tuple[bytes, str]:
        """The metrics in Prometheus's text format, and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
