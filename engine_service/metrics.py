"""Prometheus metrics of an engine under vLLM's names and `model_name` label, so dashboards
and gateway scorers built for vLLM read an engine unchanged (served on --metrics-port).
Only what vLLM has no name for carries a `nanoserve_engine_` name."""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from engine_service.common.listen import serve_metrics

if TYPE_CHECKING:
    from engine_service.spec_decode.speculator import SpecDecodeStats

# vLLM's buckets (vllm/v1/metrics/loggers.py), so histograms aggregate with a vLLM fleet's.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
               7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                   60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
FINISHED_REASONS = ("stop", "length", "abort")  # vLLM's finished_reason values


class EngineMetrics:
    """One registry per engine, so several engines in one test process do not collide.
    Attributes are the label-bound series; `model_name` is the served model name."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name

        def one(kind, name: str, doc: str, **kw):
            return kind(name, doc, ["model_name"], registry=self.registry, **kw).labels(
                model_name)

        self.running = one(Gauge, "vllm:num_requests_running",
                           "Requests in model execution batches")
        self.waiting = one(Gauge, "vllm:num_requests_waiting", "Requests waiting to be scheduled")
        self.kv_usage = one(Gauge, "vllm:kv_cache_usage_perc",
                            "KV-cache usage: 1 means every block is held")
        self.prefix_queries = one(Counter, "vllm:prefix_cache_queries",
                                  "Prompt tokens looked up in the prefix cache (first schedule)")
        self.prefix_hits = one(Counter, "vllm:prefix_cache_hits",
                               "Prompt tokens the prefix cache served (first schedule)")
        self.prompt_tokens = one(Counter, "vllm:prompt_tokens",
                                 "Prompt tokens of requests that reached their first token")
        self.generation_tokens = one(Counter, "vllm:generation_tokens", "Tokens generated")
        self.ttft = one(Histogram, "vllm:time_to_first_token_seconds",
                        "Arrival at the frontend to the first token", buckets=TTFT_BUCKETS)
        self.itl = one(Histogram, "vllm:inter_token_latency_seconds",
                       "Time between a request's tokens", buckets=ITL_BUCKETS)
        self.e2e = one(Histogram, "vllm:e2e_request_latency_seconds",
                       "Arrival at the frontend to the last token", buckets=REQUEST_BUCKETS)
        self.queue_time = one(Histogram, "vllm:request_queue_time_seconds",
                              "Time waiting in the scheduler before the first schedule",
                              buckets=REQUEST_BUCKETS)
        success = Counter("vllm:request_success", "Finished requests, by finish reason "
                          "(abort: cancelled by the client, its deadline, or the engine)",
                          ["model_name", "finished_reason"], registry=self.registry)
        self.finished = {r: success.labels(model_name, r) for r in FINISHED_REASONS}
        self._errors = Counter("nanoserve_engine_request_errors",
                               "Requests that ended in a gRPC error, by status code (refused, "
                               "cancelled, past their deadline, or cut by a core failure)",
                               ["model_name", "code"], registry=self.registry)
        self.core_stalled = one(Gauge, "nanoserve_engine_core_stalled",
                                "1 while the core watchdog holds the engine NOT_SERVING")
        self.spec_decode: SpecDecodeMetrics | None = None  # enable_spec_decode() creates it

    def enable_spec_decode(self, num_speculative_tokens: int) -> SpecDecodeMetrics:
        """The speculative-decoding series, created once and only for an engine that
        speculates (as vLLM: an engine without speculation exports none)."""
        if self.spec_decode is None:
            self.spec_decode = SpecDecodeMetrics(self.registry, self.model_name,
                                                 num_speculative_tokens)
        return self.spec_decode

    def observe_spec_decode(self, stats: SpecDecodeStats) -> None:
        self.enable_spec_decode(len(stats.accepted_per_pos)).observe(stats)

    def error(self, code_name: str) -> None:
        self._errors.labels(self.model_name, code_name).inc()

    def observe_load(self, load) -> None:
        self.running.set(load.num_running)
        self.waiting.set(load.num_waiting)
        self.kv_usage.set(load.kv_blocks_used / load.kv_blocks_total if load.kv_blocks_total
                          else 0.0)

    def observe_admitted(self, admitted) -> None:
        """Requests the scheduler took for the first time (core_process.Admitted)."""
        for a in admitted:
            self.queue_time.observe(a.queue_seconds)
            self.prefix_queries.inc(a.num_prompt_tokens)
            self.prefix_hits.inc(a.num_cached_tokens)

    def serve(self, port: int, host: str = "0.0.0.0") -> None:
        serve_metrics(self.registry, host, port)


class SpecDecodeMetrics:
    """vLLM's spec_decode counters (vllm/v1/spec_decode/metrics.py). Acceptance rate:
    rate(num_accepted_tokens) / rate(num_draft_tokens); mean acceptance length:
    1 + rate(num_accepted_tokens) / rate(num_drafts); acceptance rate at position i:
    rate(num_accepted_tokens_per_pos{position=i}) / rate(num_drafts)."""

    def __init__(self, registry: CollectorRegistry, model_name: str, k: int) -> None:
        def one(name: str, doc: str) -> Counter:
            return Counter(name, doc, ["model_name"], registry=registry).labels(model_name)

        self.num_drafts = one("vllm:spec_decode_num_drafts",
                              "Speculative drafts verified: decode rows that carried proposals")
        self.num_draft_tokens = one("vllm:spec_decode_num_draft_tokens",
                                    "Proposed tokens verified by the model")
        self.num_accepted_tokens = one("vllm:spec_decode_num_accepted_tokens",
                                       "Proposed tokens the model kept (its bonus token not "
                                       "counted)")
        per_pos = Counter("vllm:spec_decode_num_accepted_tokens_per_pos",
                          "Drafts whose proposal at 0-based `position` was kept (so every "
                          "proposal before it was too); divided by vllm:spec_decode_num_drafts: "
                          "the acceptance rate at that position",
                          ["model_name", "position"], registry=registry)
        self.accepted_per_pos = [per_pos.labels(model_name, str(i)) for i in range(k)]

    def observe(self, stats: SpecDecodeStats) -> None:
        self.num_drafts.inc(stats.num_drafts)
        self.num_draft_tokens.inc(stats.num_draft_tokens)
        self.num_accepted_tokens.inc(stats.num_accepted_tokens)
        for counter, n in zip(self.accepted_per_pos, stats.accepted_per_pos, strict=True):
            counter.inc(n)
