"""Engine configuration: keyword names are the `nanoserve engine` flags in snake_case."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

from engine_service.common.sampling_params import check_field

ATTENTION_BACKENDS = ("auto", "torch", "triton", "flash-attn")
DEVICES = ("auto", "cpu", "cuda")
DTYPES = ("auto", "float32", "bfloat16", "float16")
LOAD_FORMATS = ("auto", "safetensors", "dummy")
SCHEDULING_POLICIES = ("fcfs", "priority")
SPECULATIVE_METHODS = ("ngram", "draft")
# Prompt lookup's n-gram sizes when neither bound is given (vLLM's default).
DEFAULT_PROMPT_LOOKUP = 5


def cpu_threads(ranks: int = 1) -> int:
    """Torch threads for one of `ranks` processes sharing this process's cores:
    OMP_NUM_THREADS when set, else an even share of the cores we may run on (the affinity
    mask, which taskset, cgroups and containers narrow, not every core of the host)."""
    env = os.environ.get("OMP_NUM_THREADS", "")
    if env.isdigit() and int(env) > 0:
        return int(env)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, (cores or 1) // ranks)


@dataclass
class EngineConfig:
    model: str
    device: str = "auto"
    dtype: str = "auto"
    tensor_parallel_size: int = 1
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    kv_block_size: int = 16
    num_kv_blocks: int | None = None  # None: sized from gpu_memory_utilization (or a CPU default)
    gpu_memory_utilization: float = 0.9
    enforce_eager: bool = False
    # Launch step N+1 before step N's tokens reach the host (tensor parallel: always off).
    async_scheduling: bool = True
    attention_backend: str = "auto"
    load_format: str = "auto"
    # fcfs: arrival order; priority: lower GenerateRequest.priority first, then arrival.
    scheduling_policy: str = "fcfs"
    max_waiting_requests: int = 1024
    # Speculative decoding (off when None): proposals of ngram (prompt lookup) or of a
    # smaller draft model, verified by the target in the batched step.
    speculative_method: str | None = None
    num_speculative_tokens: int | None = None
    prompt_lookup_min: int | None = None  # ngram: shortest suffix to match
    prompt_lookup_max: int | None = None  # ngram: longest suffix to match
    speculative_model: str | None = None  # draft: a model directory with the same vocabulary
    # A step speculates only while at most this many requests run: past it the batch is
    # compute-bound and verifying proposals costs more than it gains.
    speculative_disable_by_batch_size: int = 32
    # Seconds the core may send nothing while requests are in flight before the engine
    # reports NOT_SERVING (a hung or stopped core process).
    core_watchdog_timeout: float = 10.0
    seed: int = 0
    hf_config: dict = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        cfg_path = os.path.join(self.model, "config.json")
        if not os.path.isfile(cfg_path):
            raise ValueError(f"model must be a directory with a config.json, got {self.model!r}")
        with open(cfg_path) as f:
            self.hf_config = json.load(f)
        max_pos = int(self.hf_config.get("max_position_embeddings", 4096))
        if self.max_model_len is None:
            self.max_model_len = max_pos
        check_field(1 <= self.max_model_len <= max_pos, "max_model_len",
                    f"in [1, {max_pos}] (the model's max_position_embeddings)", self.max_model_len)
        check_field(self.device in DEVICES, "device", f"one of {DEVICES}", self.device)
        check_field(self.dtype in DTYPES, "dtype", f"one of {DTYPES}", self.dtype)
        check_field(self.attention_backend in ATTENTION_BACKENDS, "attention_backend",
                    f"one of {ATTENTION_BACKENDS}", self.attention_backend)
        check_field(self.load_format in LOAD_FORMATS, "load_format", f"one of {LOAD_FORMATS}",
                    self.load_format)
        check_field(self.scheduling_policy in SCHEDULING_POLICIES, "scheduling_policy",
                    f"one of {SCHEDULING_POLICIES}", self.scheduling_policy)
        check_field(self.tensor_parallel_size >= 1, "tensor_parallel_size", ">= 1",
                    self.tensor_parallel_size)
        check_field(self.max_num_seqs >= 1, "max_num_seqs", ">= 1", self.max_num_seqs)
        check_field(self.max_num_batched_tokens >= 1, "max_num_batched_tokens", ">= 1",
                    self.max_num_batched_tokens)
        check_field(self.kv_block_size >= 1, "kv_block_size", ">= 1", self.kv_block_size)
        if self.attention_backend == "flash-attn":
            check_field(self.kv_block_size % 256 == 0, "kv_block_size",
                        "a multiple of 256 with attention_backend='flash-attn'",
                        self.kv_block_size)
        check_field(0 < self.gpu_memory_utilization <= 1, "gpu_memory_utilization",
                    "in (0, 1]", self.gpu_memory_utilization)
        check_field(self.max_waiting_requests >= 1, "max_waiting_requests", ">= 1",
                    self.max_waiting_requests)
        check_field(self.core_watchdog_timeout > 0, "core_watchdog_timeout", "> 0",
                    self.core_watchdog_timeout)
        self._check_speculative()
        if self.num_kv_blocks is not None:
            # One sequence of max_model_len tokens must fit, or it could never finish.
            need = self.max_blocks_per_seq
            check_field(self.num_kv_blocks >= need, "num_kv_blocks",
                        f">= {need} (max_model_len={self.max_model_len} / "
                        f"kv_block_size={self.kv_block_size}, rounded up)", self.num_kv_blocks)

    def _check_speculative(self) -> None:
        method = self.speculative_method
        if method is None:
            for name in ("num_speculative_tokens", "speculative_model", "prompt_lookup_min",
                         "prompt_lookup_max"):
                check_field(getattr(self, name) is None, name,
                            "unset unless speculative_method is set", getattr(self, name))
            return
        check_field(method in SPECULATIVE_METHODS, "speculative_method",
                    f"one of {SPECULATIVE_METHODS}", method)
        k = self.num_speculative_tokens
        check_field(k is not None and 1 <= k <= 16, "num_speculative_tokens",
                    "in [1, 16] with a speculative_method", k)
        check_field(self.speculative_disable_by_batch_size >= 1,
                    "speculative_disable_by_batch_size", ">= 1",
                    self.speculative_disable_by_batch_size)
        if method == "ngram":
            check_field(self.speculative_model is None, "speculative_model",
                        "unset with speculative_method='ngram'", self.speculative_model)
            lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
            lo = lo if lo is not None else (hi if hi is not None else DEFAULT_PROMPT_LOOKUP)
            hi = hi if hi is not None else max(lo, DEFAULT_PROMPT_LOOKUP)
            check_field(lo >= 1, "prompt_lookup_min", ">= 1", lo)
            check_field(hi >= lo, "prompt_lookup_max", f">= prompt_lookup_min ({lo})", hi)
            self.prompt_lookup_min, self.prompt_lookup_max = lo, hi
            return
        for name in ("prompt_lookup_min", "prompt_lookup_max"):
            check_field(getattr(self, name) is None, name,
                        "unset with speculative_method='draft'", getattr(self, name))
        draft = self.speculative_model
        check_field(draft is not None and os.path.isfile(os.path.join(draft, "config.json")),
                    "speculative_model", "a model directory with a config.json when "
                    "speculative_method='draft'", draft)

    @property
    def num_lookahead_tokens(self) -> int:
        """Proposed tokens a decode row may carry: KV slots beyond its last token."""
        return self.num_speculative_tokens or 0

    @property
    def max_blocks_per_seq(self) -> int:
        return -(-self.max_model_len // self.kv_block_size)
