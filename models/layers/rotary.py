"""Rotary position embedding, NeoX style (the two halves of each head are rotated pairs),
with Hugging Face's rope scaling: default, linear, llama3 and yarn.

The scaling formulas copy transformers' `modeling_rope_utils` (5.x) op for op, in float32,
so the cos/sin tables agree with transformers' to the last bit or two.
"""

from __future__ import annotations

import math

import torch
from torch import nn

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")

# Fields each type needs in the rope_scaling dict. llama3 and yarn also need
# original_max_position_embeddings, else the config's max_position_embeddings (as transformers).
_REQUIRED = {"default": (), "linear": ("factor",),
             "llama3": ("factor", "low_freq_factor", "high_freq_factor"), "yarn": ("factor",)}
_YARN_OPTIONAL = ("attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim")


def _rope_type(rope_scaling: dict | None) -> str:
    # transformers: rope_type wins over the legacy `type`; neither means default.
    if not rope_scaling:
        return "default"
    return rope_scaling.get("rope_type", rope_scaling.get("type", "default"))


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def check_rope_scaling(rope_scaling: dict | None) -> None:
    """Raise ValueError unless `rope_scaling` (config.json's rope_scaling or rope_parameters
    dict, or None) is a type and fields this module computes as transformers does."""
    supported = ", ".join(SUPPORTED_ROPE_TYPES)
    if rope_scaling is not None and not isinstance(rope_scaling, dict):
        raise ValueError(f"config rope_scaling must be a dict or null, got {rope_scaling!r}")
    kind = _rope_type(rope_scaling)
    if kind not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"config rope_scaling type {kind!r} is not supported; "
                         f"supported: {supported}")
    params = rope_scaling or {}
    for name in _REQUIRED[kind]:
        if name not in params or params[name] is None:
            raise ValueError(f"config rope_scaling field {name!r} is missing; rope type {kind!r} "
                             f"needs: {', '.join(_REQUIRED[kind])}")
        if not _is_number(params[name]) or params[name] <= 0:
            raise ValueError(f"config rope_scaling field {name!r} must be a number > 0 for rope "
                             f"type {kind!r}, got {params[name]!r}")
    for name in _YARN_OPTIONAL if kind == "yarn" else ():
        # None or 0 are allowed: transformers then falls back (`or` / `if mscale and ...`).
        if params.get(name) is not None and (not _is_number(params[name]) or params[name] < 0):
            raise ValueError(f"config rope_scaling field {name!r} must be a number >= 0 for rope "
                             f"type 'yarn', got {params[name]!r}")
    old_context = params.get("original_max_position_embeddings")
    if kind in ("llama3", "yarn") and old_context is not None and not (
            isinstance(old_context, int) and not isinstance(old_context, bool) and old_context > 0):
        raise ValueError(f"config rope_scaling field 'original_max_position_embeddings' must be "
                         f"a positive integer, got {old_context!r}")
    if kind == "llama3" and params["high_freq_factor"] <= params["low_freq_factor"]:
        raise ValueError(f"config rope_scaling field 'high_freq_factor' "
                         f"({params['high_freq_factor']}) must be greater than 'low_freq_factor' "
                         f"({params['low_freq_factor']}) for rope type 'llama3'")
    if kind == "yarn" and not isinstance(params.get("truncate", True), bool):
        raise ValueError(f"config rope_scaling field 'truncate' must be true or false, "
                         f"got {params['truncate']!r}")
    prf = params.get("partial_rotary_factor")
    if prf is not None and not (_is_number(prf) and 0 < prf <= 1):
        raise ValueError(f"config rope_scaling field 'partial_rotary_factor' must be in (0, 1], "
                         f"got {prf!r}")


def rope_inv_freq(rotary_dim: int, base: float, rope_scaling: dict | None = None,
                  original_max_position: int | None = None) -> tuple[torch.Tensor, float]:
    """(inv_freq [rotary_dim / 2] float32, attention factor), as transformers'
    ROPE_INIT_FUNCTIONS return them. `original_max_position`: see get_rope."""
    check_rope_scaling(rope_scaling)
    kind, params = _rope_type(rope_scaling), rope_scaling or {}
    exponent = torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim
    inv_freq = 1.0 / (base ** exponent)  # [rotary_dim / 2]
    if kind == "default":
        return inv_freq, 1.0
    factor = params["factor"]
    if kind == "linear":
        # Dividing inv_freq rather than the positions: the same angles, as transformers does.
        return inv_freq / factor, 1.0

    old_context = params.get("original_max_position_embeddings") or original_max_position
    if old_context is None:
        raise ValueError(f"config rope_scaling field 'original_max_position_embeddings' is "
                         f"missing for rope type {kind!r} and no max_position_embeddings was "
                         f"given to fall back on")
    if kind == "llama3":
        # Long wavelengths interpolated by `factor`, short ones kept, the band between blended.
        low, high = params["low_freq_factor"], params["high_freq_factor"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_context / low, inv_freq / factor, inv_freq)
        smooth = (old_context / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < old_context / high) * ~(wavelen > old_context / low)
        return torch.where(is_medium, smoothed, scaled), 1.0

    # yarn: dims that turn fewer than beta_slow times over the original context are
    # interpolated, those that turn more than beta_fast times extrapolated, a ramp between.
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        def get_mscale(scale: float, mscale: float = 1) -> float:
            return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)
        else:
            attention_factor = get_mscale(factor)
    beta_fast, beta_slow = params.get("beta_fast") or 32, params.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:
        return (rotary_dim * math.log(old_context / (num_rotations * 2 * math.pi))
                / (2 * math.log(base)))

    lo, hi = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, rotary_dim - 1)
    if lo == hi:
        hi += 0.001  # transformers' guard against a zero-width ramp
    pos_freqs = base ** exponent  # [rotary_dim / 2]
    ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float32) - lo) / (hi - lo)).clamp(0, 1)
    extrapolation = 1 - ramp  # 1: keep the dim's frequency, 0: divide it by factor
    inv_freq = (1.0 / (factor * pos_freqs) * (1 - extrapolation)
                + 1.0 / pos_freqs * extrapolation)
    return inv_freq, float(attention_factor)


class RotaryEmbedding(nn.Module):
    """cos | sin for every position up to max_position, float32, times the attention factor
    (yarn's; 1 otherwise); shared by all layers. Build the model under the target default
    dtype: `model.to(dtype)` would also cast this table."""

    def __init__(self, head_size: int, max_position: int, base: float,
                 rotary_dim: int | None = None, rope_scaling: dict | None = None,
                 original_max_position: int | None = None) -> None:
        super().__init__()
        self.head_size = head_size
        self.rotary_dim = rotary_dim or head_size
        if self.rotary_dim % 2 != 0 or self.rotary_dim > head_size:
            raise ValueError(f"rotary_dim must be even and <= head_size, got {self.rotary_dim}")
        inv_freq, self.attention_factor = rope_inv_freq(self.rotary_dim, base, rope_scaling,
                                                        original_max_position)
        t = torch.arange(max_position, dtype=torch.float32)
        freqs = t[:, None] * inv_freq[None, :]  # [max_position, rotary_dim / 2]
        cos_sin_cache = torch.cat([freqs.cos() * self.attention_factor,
                                   freqs.sin() * self.attention_factor], dim=-1)
        self.register_buffer("cos_sin_cache", cos_sin_cache, persistent=False)  # [max_pos, rd]


def get_rope(head_size: int, max_position: int, base: float, rope_scaling: dict | None = None,
             rotary_dim: int | None = None, *,
             original_max_position: int | None = None) -> RotaryEmbedding:
    """The rotary embedding a config.json asks for. rope_scaling: its `rope_scaling` or
    `rope_parameters` dict (rope_theta ignored: `base` is passed). rotary_dim: None takes the
    partial_rotary_factor of head_size. original_max_position: the config's
    max_position_embeddings, for llama3/yarn dicts without original_max_position_embeddings."""
    check_rope_scaling(rope_scaling)
    if rotary_dim is None and rope_scaling and rope_scaling.get("partial_rotary_factor"):
        rotary_dim = int(head_size * rope_scaling["partial_rotary_factor"])
    return RotaryEmbedding(head_size, max_position, base, rotary_dim, rope_scaling,
                           original_max_position)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
            rotary_dim: int) -> torch.Tensor:
    # x: [T, heads, head_size]; cos/sin: [T, 1, rotary_dim / 2] (float32)
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    x1, x2 = rot.float().chunk(2, dim=-1)
    out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)
    return torch.cat([out, rest], dim=-1) if rest.shape[-1] else out


def apply_rotary(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                 cos_sin_cache: torch.Tensor, rotary_dim: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    cos_sin = cos_sin_cache[positions].unsqueeze(1)  # [T, 1, rotary_dim]
    cos, sin = cos_sin.float().chunk(2, dim=-1)
    return _rotate(query, cos, sin, rotary_dim), _rotate(key, cos, sin, rotary_dim)
