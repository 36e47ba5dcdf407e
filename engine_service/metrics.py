"""Prometheus metrics of an engine (served on --metrics-port)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56,
                    5.12, 10.24, 20.48)


class EngineMetrics:
    """One registry per engine, so several engines in one test process do not collide."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("nanoserve_engine_requests", "Finished requests by outcome",
                                ["outcome"], registry=r)
        self.ttft = Histogram("nanoserve_engine_time_to_first_token_seconds",
                              "Arrival to first token", buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("nanoserve_engine_inter_token_latency_seconds",
                             "Time between tokens of a request", buckets=_LATENCY_BUCKETS,
                             registry=r)
        self.running = Gauge("nanoserve_engine_running_requests", "Requests running", registry=r)
        self.waiting = Gauge("nanoserve_engine_waiting_requests", "Requests waiting", registry=r)
        self.kv_blocks_used = Gauge("nanoserve_engine_kv_blocks_used", "KV blocks held",
                                    registry=r)
        self.kv_blocks_total = Gauge("nanoserve_engine_kv_blocks_total", "KV blocks in all",
                                     registry=r)
        self.prefix_hit_tokens = Counter("nanoserve_engine_prefix_cache_hit_tokens",
                                         "Prompt tokens served from the prefix cache",
                                         registry=r)

    def observe_load(self, load) -> None:
        self.running.set(load.num_running)
        self.waiting.set(load.num_waiting)
        self.kv_blocks_used.set(load.kv_blocks_used)
        self.kv_blocks_total.set(load.kv_blocks_total)

    def serve(self, port: int, host: str = "0.0.0.0") -> None:
        start_http_server(port, addr=host, registry=self.registry)
