"""The router's Prometheus metrics, in a registry of their own (one per router)."""

from __future__ import annotations

import contextlib

from prometheus_client import CollectorRegistry, Counter, Gauge


class RouterMetrics:
    """Label `engine` is the engine's address as the router knows it (HOST:PORT)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "nanoserve_router_requests", "Requests routed, by engine and why it was chosen: "
            "prefix_hit, prefix_miss, load_guard, least_load, round_robin (router.policy), or "
            "retry / continuation for a later attempt", ["engine", "reason"], registry=r)
        # prefix hit rate per engine: prefix_matched_tokens / prompt_tokens
        self.prompt_tokens = Counter(
            "nanoserve_router_prompt_tokens", "Prompt tokens routed", ["engine"], registry=r)
        self.prefix_matched_tokens = Counter(
            "nanoserve_router_prefix_matched_tokens",
            "Prompt tokens the chosen engine was believed to hold in its prefix cache",
            ["engine"], registry=r)
        self.retries = Counter(
            "nanoserve_router_retries",
            "Requests retried on another engine after failing before their first token, by the "
            "engine that failed", ["engine"], registry=r)
        self.failovers = Counter(
            "nanoserve_router_failovers",
            "Streams continued on another engine after failing mid-stream, by the engine that "
            "failed", ["engine"], registry=r)
        self.engine_failures = Counter(
            "nanoserve_router_engine_failures",
            "Transport / server-side errors counted against an engine", ["engine", "code"],
            registry=r)
        self.errors = Counter(
            "nanoserve_router_request_errors", "Requests that ended in an error, by code",
            ["code"], registry=r)
        self.rejected = Counter(
            "nanoserve_router_rejected_requests",
            "Requests refused by admission control (RESOURCE_EXHAUSTED): reason queue_full "
            "or queue_timeout", ["reason"], registry=r)
        self.admitted = Gauge(
            "nanoserve_router_admission_requests",
            "Requests holding a --max-concurrent-requests slot (state in_flight) or waiting "
            "for one (state queued; served lower priority first, then by arrival; "
            "priorities are not labels)", ["state"], registry=r)
        self.engine_healthy = Gauge(
            "nanoserve_router_engine_healthy", "1 when the engine can take requests",
            ["engine"], registry=r)
        self.engine_load = Gauge(
            "nanoserve_router_engine_load_tokens", "Engine tokens in flight (last report)",
            ["engine"], registry=r)

    def forget_engine(self, engine: str) -> None:
        for gauge in (self.engine_healthy, self.engine_load):
            with contextlib.suppress(KeyError):
                gauge.remove(engine)
