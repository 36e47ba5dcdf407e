"""Router settings; the keyword names are the `nanoserve router` flags in snake_case."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine_service.common.serving_flags import ServingOptions
from engine_service.common.tls import check_tls_files
from router.policy import PolicyConfig


def split_host_port(address: str) -> tuple[str, int]:
    """'host:port' or '[v6]:port' -> (host, port); ValueError names what is wrong."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"expected HOST:PORT, got {address!r}")
    return host.strip("[]"), int(port)


@dataclass
class RouterConfig:
    engine: list[str] = field(default_factory=list)   # static HOST:PORT list
    engine_dns: str | None = None                      # NAME:PORT, re-resolved periodically
    dns_interval: float = 5.0                          # seconds between DNS resolutions
    host: str = "127.0.0.1"
    port: int = 50050                                  # 0 = any free port
    metrics_port: int | None = None                    # None / 0 = no metrics endpoint
    http_port: int | None = 8000                       # OpenAI HTTP API; 0 = any, None = off
    served_model_name: str | None = None               # None: the engines' model name
    api_key: str | None = None                         # clients' key, sent to engines too
    policy: str = "prefix"
    tokenizer: str | None = None                       # dir; None = fetch from an engine
    cache_weight: float = 1.0
    load_guard_ratio: float = 2.0                      # 0 = guard off
    load_guard_min: float = 2048.0                     # tokens
    health_interval: float = 1.0                       # seconds between health checks
    load_interval: float = 0.2                         # seconds between GetLoad polls
    optimistic_ttl: float = 10.0                       # seconds an unconfirmed entry lives
    max_attempts: int = 3                              # engines tried per request
    failure_backoff: float = 1.0                       # first passive-failure backoff, s
    failure_backoff_max: float = 30.0
    stream_progress_timeout: float = 10.0              # s without a chunk: engine stalled
    max_concurrent_requests: int = 0                   # 0 = unlimited
    max_queued_requests: int = 1024                    # beyond the concurrency limit
    queue_timeout: float = 30.0                        # seconds a request may wait queued
    log_level: str = "info"
    seed: int | None = None                            # tie-break RNG (tests)
    tls_cert: str | None = None                        # serve TLS; client cert to engines
    tls_key: str | None = None
    tls_ca: str | None = None                          # engines over TLS, verified by it

    def __post_init__(self) -> None:
        self.engine = list(self.engine)
        if not self.engine and not self.engine_dns:
            raise ValueError("give --engine HOST:PORT (repeatable) or --engine-dns NAME:PORT")
        if self.engine and self.engine_dns:
            raise ValueError("give either --engine or --engine-dns, not both")
        for address in self.engine:
            split_host_port(address)
        if self.engine_dns:
            split_host_port(self.engine_dns)
        if self.metrics_port == 0:
            self.metrics_port = None
        for name in ("dns_interval", "health_interval", "load_interval", "failure_backoff",
                     "failure_backoff_max", "stream_progress_timeout", "queue_timeout"):
            value = getattr(self, name)
            if value <= 0:
                raise ValueError(f"{name.replace('_', '-')} must be > 0, got {value!r}")
        for name in ("optimistic_ttl", "max_concurrent_requests", "max_queued_requests"):
            value = getattr(self, name)
            if value < 0:
                raise ValueError(f"{name.replace('_', '-')} must be >= 0, got {value!r}")
        if self.max_attempts < 1:
            raise ValueError(f"max-attempts must be >= 1, got {self.max_attempts!r}")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {self.port!r}")
        self.policy_config()  # validates policy, cache weight and guard
        check_tls_files(self.tls_cert, self.tls_key, self.tls_ca, ca_alone=True)
        self.serving_options()  # validates the HTTP port, model name and key

    def serving_options(self) -> ServingOptions:
        """The HTTP front's settings; its TLS is the router's serving certificate (its
        --tls-ca verifies engines, it does not ask clients for certificates)."""
        return ServingOptions(self.http_port, self.served_model_name, self.api_key,
                              self.tls_cert, self.tls_key)

    def policy_config(self) -> PolicyConfig:
        return PolicyConfig(policy=self.policy, cache_weight=self.cache_weight,
                            load_guard_ratio=self.load_guard_ratio,
                            load_guard_min=self.load_guard_min)
