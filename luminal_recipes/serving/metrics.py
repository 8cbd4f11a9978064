"""Prometheus metrics of one server (``GET /metrics``, text format): the queue's depth, requests by route and
status, tokens generated (and a tokens/s gauge over the last minute), time to first token and request latency."""

from __future__ import annotations

import collections
import threading
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class Metrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, model: str, window_s: float = 60.0):
        self.registry = CollectorRegistry()
        r = self.registry
        self.queue_depth = Gauge("luminal_queue_depth", "requests waiting for the model", registry=r)
        self.running = Gauge("luminal_running_sequences", "sequences (or pipeline runs) being computed", registry=r)
        self.requests = Counter("luminal_requests", "requests answered, by route and HTTP status",
                                ["route", "status"], registry=r)
        self.prompt_tokens = Counter("luminal_prompt_tokens", "prompt tokens of answered requests", registry=r)
        self.generated_tokens = Counter("luminal_generated_tokens", "tokens generated", registry=r)
        self.tokens_per_s = Gauge("luminal_generated_tokens_per_second",
                                  f"tokens generated per second over the last {window_s:g} s", registry=r)
        self.ttft = Histogram("luminal_time_to_first_token_seconds", "request received -> first token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.latency = Histogram("luminal_request_latency_seconds", "request received -> answered, by route",
                                 ["route"], buckets=LATENCY_BUCKETS, registry=r)
        Gauge("luminal_model_info", "the model served", ["model"], registry=r).labels(model).set(1)
        self._window = window_s
        self._recent: collections.deque[tuple[float, int]] = collections.deque()
        self._lock = threading.Lock()

    def tokens(self, count: int) -> None:
        if count <= 0:
            return
        self.generated_tokens.inc(count)
        with self._lock:
            self._recent.append((time.monotonic(), count))

    def render(self) -> bytes:
        now = time.monotonic()
        with self._lock:
            while self._recent and self._recent[0][0] < now - self._window:
                self._recent.popleft()
            total = sum(c for _, c in self._recent)
        self.tokens_per_s.set(total / self._window)
        return generate_latest(self.registry)
