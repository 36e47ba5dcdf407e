"""Model configuration read from a Hugging Face checkpoint directory (torch-free)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

DTYPES = ("float32", "bfloat16", "float16")


def _as_int_list(value: object) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]  # type: ignore[union-attr]


def _rope_theta(raw: dict) -> float:
    # transformers >= 5 writes rope_parameters={"rope_theta": ...}; released Qwen3
    # checkpoints keep rope_theta at the top level.
    params = raw.get("rope_parameters") or {}
    if "rope_theta" in raw:
        return float(raw["rope_theta"])
    return float(params.get("rope_theta", 10000.0))


def _rope_scaling(raw: dict) -> dict | None:
    scaling = raw.get("rope_scaling") or raw.get("rope_parameters") or None
    if scaling is None:
        return None
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    return None if kind == "default" else dict(scaling)


@dataclass
class Qwen3Config:
    """The fields of a Qwen3 (also Qwen2/Llama-shaped) config.json the engine uses."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = False
    dtype: str = "bfloat16"
    eos_token_id: list[int] = field(default_factory=list)
    bos_token_id: int | None = None
    architectures: list[str] = field(default_factory=lambda: ["Qwen3ForCausalLM"])
    model_type: str = "qwen3"
    hidden_act: str = "silu"
    attention_bias: bool = False
    rope_scaling: dict | None = None

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim",
                     "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"config {name} must be a positive integer, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError(
                f"config num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})")
        if self.head_dim % 2 != 0:
            raise ValueError(f"config head_dim must be even for rotary embeddings, "
                             f"got {self.head_dim}")
        if not self.rms_norm_eps > 0:
            raise ValueError(f"config rms_norm_eps must be > 0, got {self.rms_norm_eps}")
        if not self.rope_theta > 0:
            raise ValueError(f"config rope_theta must be > 0, got {self.rope_theta}")
        if self.dtype not in DTYPES:
            raise ValueError(f"config torch_dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.hidden_act != "silu":
            raise ValueError(f"config hidden_act must be 'silu', got {self.hidden_act!r}")
        if self.rope_scaling is not None:
            raise ValueError(f"config rope_scaling is not supported yet, got {self.rope_scaling}")
        self.eos_token_id = _as_int_list(self.eos_token_id)
        for tok in self.eos_token_id:
            if not 0 <= tok < self.vocab_size:
                raise ValueError(f"config eos_token_id {tok} is outside the vocabulary "
                                 f"[0, {self.vocab_size})")

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> Qwen3Config:
        """Read config.json (and generation_config.json's eos ids, if present)."""
        model_dir = Path(model_dir)
        cfg_path = model_dir / "config.json"
        if not cfg_path.is_file():
            raise ValueError(f"model directory {str(model_dir)!r} has no config.json")
        raw = json.loads(cfg_path.read_text())
        eos = _as_int_list(raw.get("eos_token_id"))
        gen_path = model_dir / "generation_config.json"
        if gen_path.is_file():
            gen_eos = _as_int_list(json.loads(gen_path.read_text()).get("eos_token_id"))
            eos += [t for t in gen_eos if t not in eos]
        heads = int(raw["num_attention_heads"])
        dtype = raw.get("torch_dtype") or raw.get("dtype") or "bfloat16"
        return cls(
            vocab_size=int(raw["vocab_size"]),
            hidden_size=int(raw["hidden_size"]),
            intermediate_size=int(raw["intermediate_size"]),
            num_hidden_layers=int(raw["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
            # Qwen2/Llama configs leave head_dim out: it is hidden_size / heads there.
            head_dim=int(raw.get("head_dim") or raw["hidden_size"] // heads),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=_rope_theta(raw),
            max_position_embeddings=int(raw.get("max_position_embeddings", 32768)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            dtype=str(dtype),
            eos_token_id=eos,
            bos_token_id=raw.get("bos_token_id"),
            architectures=list(raw.get("architectures") or []),
            model_type=str(raw.get("model_type", "")),
            hidden_act=str(raw.get("hidden_act", "silu")),
            # Qwen2 always has q/k/v biases and its configs do not say so.
            attention_bias=bool(raw.get("attention_bias", raw.get("model_type") == "qwen2")),
            rope_scaling=_rope_scaling(raw),
        )
