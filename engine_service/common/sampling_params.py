"""Sampling parameters: the one place their values are checked."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

MAX_STOP_STRINGS = 16
MAX_STOP_STRING_LEN = 256
MAX_STOP_TOKEN_IDS = 1024  # each is looked up for every generated token
MAX_LOGPROBS = 20
MAX_QUOTE_CHARS = 80
MAX_LOGIT_BIAS = 1024  # entries of logit_bias, and ids of allowed_token_ids
MAX_CONSTRAINT_CHARS = 1 << 16  # a schema, regex or grammar; each choice
MAX_CHOICES = 256
CONSTRAINTS = ("json_schema", "json_object", "regex", "choice", "grammar")


def quote(value: object) -> str:
    """repr(value), cut to a short prefix plus its length: error messages travel in gRPC
    metadata (16 KiB at most) and logs, so a huge value must never be echoed whole."""
    text = repr(value)
    if len(text) <= MAX_QUOTE_CHARS:
        return text
    size = f" (length {len(value)})" if hasattr(value, "__len__") else ""
    return f"{text[:MAX_QUOTE_CHARS]}...{size}"


def check_field(ok: bool, field_name: str, allowed: str, value: object) -> None:
    if not ok:
        raise ValueError(f"{field_name} must be {allowed}, got {quote(value)}")


def check_prompt_len(num_tokens: int, max_model_len: int) -> None:
    """ValueError unless a prompt of num_tokens leaves room for one output token."""
    check_field(num_tokens >= 1, "prompt", "non-empty (at least 1 token)", num_tokens)
    limit = max_model_len - 1
    check_field(num_tokens <= limit, "prompt",
                f"at most max_model_len - 1 = {limit} tokens (room for one output token)",
                num_tokens)


def validate_prompt(prompt_token_ids: Sequence[int], max_model_len: int, vocab_size: int
                    ) -> None:
    """Raise ValueError naming the field and the allowed range; changes nothing."""
    check_prompt_len(len(prompt_token_ids), max_model_len)
    bad = [t for t in prompt_token_ids if not (isinstance(t, int) and 0 <= t < vocab_size)]
    check_field(not bad, "prompt_token_ids", f"ids in [0, {vocab_size})", bad[:5])


def validate_token_controls(params: SamplingParams, vocab_size: int) -> None:
    """ValueError unless logit_bias and allowed_token_ids name ids of the vocabulary."""
    for name, ids in (("logit_bias", params.logit_bias or ()),
                      ("allowed_token_ids", params.allowed_token_ids or ())):
        bad = [t for t in ids if t >= vocab_size]
        check_field(not bad, name, f"token ids in [0, {vocab_size})", bad[:5])


REMASKING = ("low_confidence", "random")
DLLM_CACHES = ("none", "prefix", "dual")


@dataclass
class DiffusionParams:
    """How a diffusion model (LLaDA, Dream) fills `gen_length` masked positions: in
    `gen_length / block_length` blocks, left to right, each over `steps / num_blocks`
    forward passes that unmask the positions `remasking` ranks first (the most confident
    prediction, or random ones), or with `confidence_threshold` every position above it
    (at least one a pass: Fast-dLLM's parallel decoding). `temperature` adds Gumbel noise
    to the predictions; `cfg_scale` > 0 guides them against a pass with the prompt masked.
    `dllm_cache` (Fast-dLLM's approximate KV caches): "none" recomputes the whole canvas every
    pass (exact); "prefix" and "dual" compute the prompt's KV once and refresh the rest at
    each block's first pass; the other passes recompute the current block and everything
    after it ("prefix") or the block alone ("dual"), reading the rest from the cache.
    `retention_ratio` (dLLM-Serve's head-sparse attention, "dual" only): a block's first
    `delay_step` passes attend fully; at pass `delay_step`, also full, each KV head of each
    layer keeps that fraction of the keys outside the block (prefix and suffix), those its
    block's queries score highest, and the block's later passes attend only to those and the
    block's own keys (a block of at most delay_step + 1 passes never attends sparsely)."""

    gen_length: int = 128
    steps: int = 128
    block_length: int = 32
    remasking: str = "low_confidence"
    temperature: float = 0.0
    cfg_scale: float = 0.0
    confidence_threshold: float | None = None
    dllm_cache: str = "none"
    retention_ratio: float | None = None
    delay_step: int = 1

    def __post_init__(self) -> None:
        check_field(isinstance(self.gen_length, int) and self.gen_length >= 1, "gen_length",
                    ">= 1", self.gen_length)
        check_field(isinstance(self.block_length, int)
                    and 1 <= self.block_length <= self.gen_length
                    and self.gen_length % self.block_length == 0, "block_length",
                    f"a divisor of gen_length={self.gen_length}", self.block_length)
        num_blocks = self.gen_length // self.block_length
        check_field(isinstance(self.steps, int) and self.steps >= num_blocks
                    and self.steps % num_blocks == 0, "steps",
                    f"a positive multiple of the number of blocks ({num_blocks})", self.steps)
        check_field(self.remasking in REMASKING, "remasking", f"one of {REMASKING}",
                    self.remasking)
        check_field(self.temperature >= 0, "temperature", ">= 0 (0: no Gumbel noise)",
                    self.temperature)
        check_field(self.cfg_scale >= 0, "cfg_scale", ">= 0 (0: off)", self.cfg_scale)
        check_field(self.confidence_threshold is None or 0 < self.confidence_threshold <= 1,
                    "confidence_threshold", "in (0, 1] or unset", self.confidence_threshold)
        check_field(self.dllm_cache in DLLM_CACHES, "dllm_cache", f"one of {DLLM_CACHES}",
                    self.dllm_cache)
        check_field(self.retention_ratio is None or 0 < self.retention_ratio <= 1,
                    "retention_ratio", "in (0, 1] or unset", self.retention_ratio)
        # The candidates are the dual cache's prefix and suffix, read as of the refresh.
        check_field(self.retention_ratio is None or self.dllm_cache == "dual",
                    "retention_ratio", f"unset unless dllm_cache is 'dual' (it is "
                    f"{self.dllm_cache!r})", self.retention_ratio)
        check_field(isinstance(self.delay_step, int) and self.delay_step >= 1, "delay_step",
                    ">= 1 (full-attention passes of a block before its keys are chosen)",
                    self.delay_step)

    @property
    def num_blocks(self) -> int:
        return self.gen_length // self.block_length

    @property
    def steps_per_block(self) -> int:
        return self.steps // self.num_blocks


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop; defaults follow vLLM's SamplingParams.

    temperature 0 means greedy. top_k <= 0 turns top-k off. seed None draws a random seed
    when the request enters the engine.
    """

    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    # Structured output: at most one of these five (see CONSTRAINTS).
    json_schema: str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    # Diffusion engines only (LLaDA, Dream): how the canvas is decoded.
    diffusion: DiffusionParams | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids)
        check_field(isinstance(self.max_tokens, int) and self.max_tokens >= 1,
               "max_tokens", ">= 1", self.max_tokens)
        check_field(isinstance(self.min_tokens, int) and 0 <= self.min_tokens <= self.max_tokens,
               "min_tokens", f"in [0, max_tokens={self.max_tokens}]", self.min_tokens)
        check_field(self.temperature >= 0, "temperature", ">= 0 (0 = greedy)", self.temperature)
        check_field(0 < self.top_p <= 1, "top_p", "in (0, 1]", self.top_p)
        check_field(isinstance(self.top_k, int) and self.top_k >= -1, "top_k",
               ">= 1, or 0 / -1 for off", self.top_k)
        check_field(0 <= self.min_p <= 1, "min_p", "in [0, 1]", self.min_p)
        check_field(self.seed is None or (isinstance(self.seed, int) and 0 <= self.seed < 2**63),
               "seed", "in [0, 2**63)", self.seed)
        check_field(self.repetition_penalty > 0, "repetition_penalty", "> 0 (1 = off)",
               self.repetition_penalty)
        check_field(-2 <= self.presence_penalty <= 2, "presence_penalty", "in [-2, 2]",
               self.presence_penalty)
        check_field(-2 <= self.frequency_penalty <= 2, "frequency_penalty", "in [-2, 2]",
               self.frequency_penalty)
        check_field(len(self.stop) <= MAX_STOP_STRINGS, "stop",
               f"a list of at most {MAX_STOP_STRINGS} strings", len(self.stop))
        for s in self.stop:
            check_field(isinstance(s, str) and 1 <= len(s) <= MAX_STOP_STRING_LEN, "stop",
                   f"strings of 1..{MAX_STOP_STRING_LEN} characters", s)
        check_field(len(self.stop_token_ids) <= MAX_STOP_TOKEN_IDS, "stop_token_ids",
                    f"a list of at most {MAX_STOP_TOKEN_IDS} ids", len(self.stop_token_ids))
        for t in self.stop_token_ids:
            check_field(isinstance(t, int) and t >= 0, "stop_token_ids", "non-negative ints", t)
        check_field(self.logprobs is None or (isinstance(self.logprobs, int)
                                         and 0 <= self.logprobs <= MAX_LOGPROBS),
               "logprobs", f"in [0, {MAX_LOGPROBS}] or unset", self.logprobs)
        self._check_token_controls()
        self._check_constraint()

    def _check_token_controls(self) -> None:
        if self.logit_bias is not None:
            self.logit_bias = dict(self.logit_bias)
            check_field(len(self.logit_bias) <= MAX_LOGIT_BIAS, "logit_bias",
                        f"at most {MAX_LOGIT_BIAS} entries", len(self.logit_bias))
            for t, bias in self.logit_bias.items():
                check_field(isinstance(t, int) and t >= 0, "logit_bias",
                            "keyed by non-negative token ids", t)
                check_field(isinstance(bias, (int, float)) and -100 <= bias <= 100,
                            f"logit_bias[{t}]", "in [-100, 100]", bias)
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = list(self.allowed_token_ids)
            n = len(self.allowed_token_ids)
            check_field(1 <= n <= MAX_LOGIT_BIAS, "allowed_token_ids",
                        f"a list of 1..{MAX_LOGIT_BIAS} ids", n)
            for t in self.allowed_token_ids:
                check_field(isinstance(t, int) and t >= 0, "allowed_token_ids",
                            "non-negative ints", t)

    def _check_constraint(self) -> None:
        given = [name for name in CONSTRAINTS if getattr(self, name) not in (None, False)]
        check_field(len(given) <= 1, "constraint",
                    f"at most one of {', '.join(CONSTRAINTS)}", given)
        for name in ("json_schema", "regex", "grammar"):
            text = getattr(self, name)
            check_field(text is None or (isinstance(text, str)
                                         and 1 <= len(text) <= MAX_CONSTRAINT_CHARS),
                        name, f"a string of 1..{MAX_CONSTRAINT_CHARS} characters", text)
        if self.choice is not None:
            self.choice = list(self.choice)
            check_field(1 <= len(self.choice) <= MAX_CHOICES, "choice",
                        f"a list of 1..{MAX_CHOICES} strings", len(self.choice))
            for c in self.choice:
                check_field(isinstance(c, str) and 1 <= len(c) <= MAX_CONSTRAINT_CHARS,
                            "choice", f"strings of 1..{MAX_CONSTRAINT_CHARS} characters", c)

    @property
    def constraint(self) -> tuple[str, str | list[str] | bool] | None:
        """(kind, value) of the structured-output constraint, or None."""
        for name in CONSTRAINTS:
            value = getattr(self, name)
            if value not in (None, False):
                return name, value
        return None

    @property
    def uses_penalties(self) -> bool:
        """Sampling reads the output history (and the prompt's tokens)."""
        return (self.repetition_penalty != 1 or self.presence_penalty != 0
                or self.frequency_penalty != 0)


# models.config.DIFFUSION_ARCHITECTURES, for processes without the model code: a router
# tells a diffusion engine by its ModelInfo.architecture.
DIFFUSION_ARCHITECTURES = frozenset({"LLaDAModelLM", "DreamModel"})
# What a diffusion engine reads of SamplingParams besides `diffusion`; everything else shapes
# autoregressive sampling and must keep its default there.
_DIFFUSION_FIELDS = frozenset({"seed", "stop", "stop_token_ids", "ignore_eos",
                               "skip_special_tokens", "diffusion"})


def check_diffusion_request(params: SamplingParams, diffusion_engine: bool) -> None:
    """ValueError naming the first field that does not apply to this kind of engine."""
    if not diffusion_engine:
        check_field(params.diffusion is None, "diffusion",
                    "unset: this engine's model is autoregressive", "DiffusionParams(...)")
        return
    defaults = SamplingParams()
    for name in SamplingParams.__dataclass_fields__:
        if name not in _DIFFUSION_FIELDS and getattr(params, name) != getattr(defaults, name):
            raise ValueError(f"{name} applies to autoregressive models; this engine serves a "
                             f"diffusion model: leave it unset and use diffusion "
                             f"(gen_length, steps, block_length, temperature, ...), got "
                             f"{quote(getattr(params, name))}")
