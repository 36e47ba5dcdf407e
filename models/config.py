"""Model configuration read from a Hugging Face checkpoint directory, one dataclass for every
family. What nanoserve cannot run is refused here, before any weight is read, naming the field.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from models.layers.rotary import check_rope_scaling

DTYPES = ("float32", "bfloat16", "float16")
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
                           "Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "LLaDAModelLM",
                           "DreamModel")
# Masked-diffusion LLMs: bidirectional attention, decoding by unmasking `mask_token_id`s.
DIFFUSION_ARCHITECTURES = ("LLaDAModelLM", "DreamModel")
# Families whose q/k/v projections always carry biases (their configs do not say so) and
# whose o_proj never has one; elsewhere attention_bias sets all four.
_QKV_BIAS_ALWAYS = ("Qwen2ForCausalLM", "DreamModel")
# DreamConfig's mask token when config.json names none.
_DREAM_MASK_TOKEN_ID = 151666
# configuration_llada.py's ModelConfig defaults, which a LLaDA config.json key takes when it is
# absent: several of them select another architecture, which from_dir then refuses.
_LLADA_DEFAULTS: dict[str, object] = {
    "n_kv_heads": None, "multi_query_attention": None, "mlp_ratio": 4, "mlp_hidden_size": None,
    "activation_type": "swiglu", "block_type": "sequential", "block_group_size": 1,
    "alibi": False, "rope": False, "attention_layer_norm": False, "input_emb_norm": False,
    "layer_norm_type": "default", "layer_norm_with_affine": True, "bias_for_layer_norm": None,
    "include_bias": False, "include_qkv_bias": False, "scale_logits": False,
    "rms_norm_eps": 1e-5, "max_sequence_length": 1024, "rope_theta": 10000.0,
    "vocab_size": 50257, "embedding_size": 50304, "weight_tying": True,
    "mask_token_id": 50256,
}
# LLaDA's switches and the one setting of each that nanoserve runs (Llama's block: RMSNorm,
# SwiGLU through ff_proj/up_proj, RoPE, no biases but optional q/k/v ones).
_LLADA_SUPPORTED: dict[str, object] = {
    "block_type": "llama", "activation_type": "silu", "layer_norm_type": "rms", "rope": True,
    "alibi": False, "attention_layer_norm": False, "input_emb_norm": False,
    "scale_logits": False, "include_bias": False, "layer_norm_with_affine": True,
    "block_group_size": 1,
}


def _as_int_list(value: object) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]  # type: ignore[union-attr]


def _rope_theta(raw: dict) -> float:
    # transformers >= 5 nests it in rope_parameters; released checkpoints keep it on top.
    if "rope_theta" in raw:
        return float(raw["rope_theta"])
    return float((raw.get("rope_parameters") or {}).get("rope_theta", 10000.0))


def _rope_scaling(raw: dict) -> dict | None:
    scaling = raw.get("rope_scaling") or raw.get("rope_parameters") or None
    if scaling is None:
        return None
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return None
    return {k: v for k, v in scaling.items() if k != "rope_theta"}


def _sliding_window(raw: dict) -> int | None:
    """The sliding window the checkpoint asks for, or None where every layer attends fully."""
    layer_types = raw.get("layer_types") or []
    uses = "sliding_attention" in layer_types
    if "use_sliding_window" in raw:  # Qwen2/Qwen3: the window is set but off by default
        uses = uses or bool(raw["use_sliding_window"])
    else:  # Mistral: a window is in force whenever it is set
        uses = uses or raw.get("sliding_window") is not None
    return raw.get("sliding_window") if uses else None


@dataclass
class ModelConfig:
    """The fields of a config.json the engine uses, for every supported family."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    architecture: str = "Qwen3ForCausalLM"
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = False
    dtype: str = "bfloat16"
    eos_token_id: list[int] = field(default_factory=list)
    hidden_act: str = "silu"
    attention_bias: bool = False  # biases on q/k/v
    o_proj_bias: bool = False
    # Mixture of experts (Qwen3-MoE); num_experts 0 means dense.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)
    # Diffusion LLMs (LLaDA, Dream): False builds bidirectional attention; the engine fills
    # the positions it decodes with mask_token_id.
    causal: bool = True
    mask_token_id: int | None = None

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"config architectures {self.architecture!r} is not supported; "
                             f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
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
            raise ValueError(f"config hidden_act {self.hidden_act!r} is not supported; "
                             f"supported: silu")
        check_rope_scaling(self.rope_scaling)
        if self.is_moe:
            self._check_moe()
        self.eos_token_id = _as_int_list(self.eos_token_id)
        for tok in self.eos_token_id:
            if not 0 <= tok < self.vocab_size:
                raise ValueError(f"config eos_token_id {tok} is outside the vocabulary "
                                 f"[0, {self.vocab_size})")
        if self.is_diffusion and self.mask_token_id is None:
            raise ValueError(f"config mask_token_id must be set for {self.architecture}")
        if self.mask_token_id is not None and not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(f"config mask_token_id {self.mask_token_id} is outside the "
                             f"vocabulary [0, {self.vocab_size})")

    def _check_moe(self) -> None:
        for name in ("num_experts_per_tok", "moe_intermediate_size", "decoder_sparse_step"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"config {name} must be a positive integer, got {value!r}")
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError(f"config num_experts_per_tok ({self.num_experts_per_tok}) must be "
                             f"at most num_experts ({self.num_experts})")

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def is_diffusion(self) -> bool:
        """A masked-diffusion LLM (LLaDA, Dream): the autoregressive engine cannot serve it."""
        return self.architecture in DIFFUSION_ARCHITECTURES

    def is_moe_layer(self, layer_idx: int) -> bool:
        """Qwen3-MoE's rule: a sparse MLP every decoder_sparse_step layers, except the
        mlp_only_layers."""
        return (self.is_moe and layer_idx not in self.mlp_only_layers
                and (layer_idx + 1) % self.decoder_sparse_step == 0)

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        """Read config.json (and generation_config.json's eos ids, if present)."""
        model_dir = Path(model_dir)
        cfg_path = model_dir / "config.json"
        if not cfg_path.is_file():
            raise ValueError(f"model directory {str(model_dir)!r} has no config.json")
        raw = json.loads(cfg_path.read_text())
        architectures = list(raw.get("architectures") or [])
        if len(architectures) != 1:
            raise ValueError(f"config architectures must name one architecture, got "
                             f"{architectures}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        arch = architectures[0]
        eos = _as_int_list(raw.get("eos_token_id"))
        gen_path = model_dir / "generation_config.json"
        if gen_path.is_file():
            gen_eos = _as_int_list(json.loads(gen_path.read_text()).get("eos_token_id"))
            eos += [t for t in gen_eos if t not in eos]
        if arch == "LLaDAModelLM":
            return cls(**_llada_fields(raw), eos_token_id=eos)
        if raw.get("mlp_bias"):
            raise ValueError("config mlp_bias=true is not supported; supported: false")
        if arch == "DreamModel":
            raw = _dream_raw(raw)
        window = _sliding_window(raw)
        if window is not None:
            raise ValueError(f"config sliding_window={window} asks for sliding-window "
                             f"attention, which is not supported; supported: full attention "
                             f"(sliding_window null or use_sliding_window false)")
        heads = int(raw["num_attention_heads"])
        attention_bias = bool(raw.get("attention_bias", False))
        num_experts = int(raw.get("num_experts") or raw.get("num_local_experts") or 0)
        return cls(
            architecture=arch,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=int(raw["hidden_size"]),
            intermediate_size=int(raw["intermediate_size"]),
            num_hidden_layers=int(raw["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
            # Llama/Qwen2 configs may leave head_dim out: it is hidden_size / heads there.
            head_dim=int(raw.get("head_dim") or raw["hidden_size"] // heads),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=_rope_theta(raw),
            rope_scaling=_rope_scaling(raw),
            max_position_embeddings=int(raw.get("max_position_embeddings", 32768)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "bfloat16"),
            eos_token_id=eos,
            hidden_act=str(raw.get("hidden_act", "silu")),
            attention_bias=attention_bias or arch in _QKV_BIAS_ALWAYS,
            o_proj_bias=attention_bias and arch not in _QKV_BIAS_ALWAYS,
            num_experts=num_experts if arch == "Qwen3MoeForCausalLM" else 0,
            num_experts_per_tok=int(raw.get("num_experts_per_tok") or 0),
            moe_intermediate_size=int(raw.get("moe_intermediate_size") or 0),
            norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
            decoder_sparse_step=int(raw.get("decoder_sparse_step") or 1),
            mlp_only_layers=_as_int_list(raw.get("mlp_only_layers")),
            causal=arch not in DIFFUSION_ARCHITECTURES,
            mask_token_id=raw["mask_token_id"] if arch in DIFFUSION_ARCHITECTURES else None,
        )


def _dream_raw(raw: dict) -> dict:
    """A Dream config.json as from_dir reads it, with DreamConfig's defaults (use_sliding_window
    false, mask_token_id 151666); DreamModel sizes its heads hidden_size / heads whatever
    head_dim says, so a different head_dim is refused."""
    heads, hidden = int(raw["num_attention_heads"]), int(raw["hidden_size"])
    head_dim = raw.get("head_dim")
    if head_dim is not None and int(head_dim) * heads != hidden:
        raise ValueError(f"config head_dim={head_dim} is not supported for DreamModel, whose "
                         f"heads are hidden_size / num_attention_heads = {hidden // heads} "
                         f"wide; supported: null or {hidden // heads}")
    return {"use_sliding_window": False, "mask_token_id": _DREAM_MASK_TOKEN_ID, **raw}


def _llada_fields(raw: dict) -> dict:
    """ModelConfig fields (eos aside) from LLaDA's OLMo-style config.json: d_model, n_heads,
    n_kv_heads, n_layers, mlp_hidden_size (or mlp_ratio x d_model), embedding_size (or
    vocab_size), max_sequence_length, weight_tying, include_qkv_bias, mask_token_id, ..."""
    missing = [k for k in ("d_model", "n_heads", "n_layers") if raw.get(k) is None]
    if missing:
        raise ValueError(f"config has no {', '.join(missing)}: not a LLaDA config.json")
    cfg = {**_LLADA_DEFAULTS, **raw}
    for key, supported in _LLADA_SUPPORTED.items():
        if cfg[key] != supported:
            raise ValueError(f"config {key}={json.dumps(cfg[key])} is not supported for "
                             f"LLaDAModelLM; supported: {json.dumps(supported)}")
    if cfg["bias_for_layer_norm"]:
        raise ValueError("config bias_for_layer_norm=true is not supported for LLaDAModelLM; "
                         "supported: false or null")
    d_model, heads = int(cfg["d_model"]), int(cfg["n_heads"])
    if d_model % heads:
        raise ValueError(f"config d_model ({d_model}) must be a multiple of n_heads ({heads})")
    kv_heads = _llada_kv_heads(cfg, heads)
    vocab = int(cfg["vocab_size"])
    embedding_size = int(cfg["embedding_size"] or vocab)
    if embedding_size < vocab:
        raise ValueError(f"config embedding_size ({embedding_size}) must be at least "
                         f"vocab_size ({vocab})")
    mlp_hidden = cfg["mlp_hidden_size"]
    return dict(
        architecture="LLaDAModelLM",
        # The embedding and the output layer have embedding_size rows (vocab_size padded).
        vocab_size=embedding_size,
        hidden_size=d_model,
        # ff_proj (the gate) and up_proj are mlp_hidden_size wide: SiLU halves nothing.
        intermediate_size=int(mlp_hidden if mlp_hidden is not None
                              else int(cfg["mlp_ratio"]) * d_model),
        num_hidden_layers=int(cfg["n_layers"]),
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=d_model // heads,
        rms_norm_eps=float(cfg["rms_norm_eps"]),
        rope_theta=float(cfg["rope_theta"]),
        max_position_embeddings=int(cfg["max_sequence_length"]),
        tie_word_embeddings=bool(cfg["weight_tying"]),
        dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "bfloat16"),
        attention_bias=bool(cfg["include_qkv_bias"]),
        causal=False,
        mask_token_id=int(cfg["mask_token_id"]),
    )


def _llada_kv_heads(cfg: dict, heads: int) -> int:
    """configuration_llada.py's effective_n_kv_heads: n_kv_heads, else one head under
    multi_query_attention, else n_heads; both set must agree."""
    kv_heads, mqa = cfg["n_kv_heads"], cfg["multi_query_attention"]
    if kv_heads is None:
        return 1 if mqa else heads
    if mqa is not None and int(kv_heads) != (1 if mqa else heads):
        raise ValueError(f"config n_kv_heads={kv_heads} contradicts "
                         f"multi_query_attention={json.dumps(mqa)}")
    return int(kv_heads)
