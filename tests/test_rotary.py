"""Rope scaling (models/layers/rotary.py) against transformers: inv_freq and attention factor
against ROPE_INIT_FUNCTIONS, rotated q/k against LlamaRotaryEmbedding + apply_rotary_pos_emb,
and the config errors."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from models.layers.rotary import (
    SUPPORTED_ROPE_TYPES,
    RotaryEmbedding,
    apply_rotary,
    check_rope_scaling,
    get_rope,
    rope_inv_freq,
)

MAX_POSITION = 16384


@dataclasses.dataclass(frozen=True)
class Case:
    rope_scaling: dict | None
    base: float
    head_size: int = 128
    max_position_embeddings: int = MAX_POSITION  # the HF config's


CASES = {
    "default": Case(None, 1_000_000.0),
    "default_explicit": Case({"rope_type": "default"}, 10_000.0, head_size=64),
    "linear": Case({"rope_type": "linear", "factor": 4.0}, 10_000.0),
    "linear_legacy_type": Case({"type": "linear", "factor": 2}, 10_000.0, head_size=64),
    # Llama-3.1's block.
    "llama3": Case({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
                   500_000.0, max_position_embeddings=131072),
    "yarn": Case({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096},
                 10_000.0, max_position_embeddings=MAX_POSITION),
    # DeepSeek-style: the attention factor is the ratio of two mscales (not 1 here).
    "yarn_mscale": Case({"rope_type": "yarn", "factor": 40.0,
                         "original_max_position_embeddings": 4096, "beta_fast": 32,
                         "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.707},
                        10_000.0, head_size=64, max_position_embeddings=163840),
    # gpt-oss's: no truncation of the ramp bounds.
    "yarn_no_truncate": Case({"rope_type": "yarn", "factor": 32.0,
                              "original_max_position_embeddings": 4096, "beta_fast": 32.0,
                              "beta_slow": 1.0, "truncate": False},
                             150_000.0, head_size=64, max_position_embeddings=131072),
    "yarn_attention_factor": Case({"rope_type": "yarn", "factor": 4.0,
                                   "original_max_position_embeddings": 32768,
                                   "attention_factor": 0.8}, 1_000_000.0,
                                  max_position_embeddings=131072),
}


def hf_config(case: Case, rope_scaling: dict | None = None) -> LlamaConfig:
    params = dict(rope_scaling if rope_scaling is not None else case.rope_scaling or {})
    params["rope_theta"] = case.base
    return LlamaConfig(hidden_size=case.head_size * 4, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=case.head_size,
                       max_position_embeddings=case.max_position_embeddings,
                       rope_parameters=params)


def hf_inv_freq(config: LlamaConfig) -> tuple[torch.Tensor, float]:
    kind = config.rope_parameters["rope_type"]
    if kind == "default":
        return LlamaRotaryEmbedding.compute_default_rope_parameters(config)
    return ROPE_INIT_FUNCTIONS[kind](config)


@pytest.mark.parametrize("name", CASES)
def test_inv_freq_and_attention_factor_match_transformers(name: str) -> None:
    case = CASES[name]
    inv_freq, attention_factor = rope_inv_freq(case.head_size, case.base, case.rope_scaling)
    ref_inv_freq, ref_factor = hf_inv_freq(hf_config(case))
    assert inv_freq.dtype == torch.float32 and inv_freq.shape == (case.head_size // 2,)
    torch.testing.assert_close(inv_freq, ref_inv_freq.float(), rtol=1e-6, atol=0)
    assert attention_factor == pytest.approx(ref_factor, rel=1e-12)
    if name == "yarn_mscale":
        assert attention_factor != pytest.approx(1.0)  # the case exercises the mscale ratio


@pytest.mark.parametrize("name", CASES)
def test_rotated_qk_match_transformers(name: str) -> None:
    case = CASES[name]
    gen = torch.Generator().manual_seed(0)
    num_tokens, heads, kv_heads, d = 64, 4, 2, case.head_size
    positions = torch.randint(0, MAX_POSITION, (num_tokens,), generator=gen)
    positions[:2] = torch.tensor([0, MAX_POSITION - 1])
    query = torch.randn(num_tokens, heads, d, generator=gen)
    key = torch.randn(num_tokens, kv_heads, d, generator=gen)

    rope = get_rope(d, MAX_POSITION, case.base, case.rope_scaling)
    assert rope.cos_sin_cache.shape == (MAX_POSITION, d)
    assert rope.cos_sin_cache.dtype == torch.float32
    q, k = apply_rotary(positions, query, key, rope.cos_sin_cache, rope.rotary_dim)

    hf_rope = LlamaRotaryEmbedding(hf_config(case))
    cos, sin = hf_rope(query, positions[None])  # [1, T, D]
    ref_q, ref_k = apply_rotary_pos_emb(query.transpose(0, 1)[None], key.transpose(0, 1)[None],
                                        cos, sin)  # [1, heads, T, D]
    torch.testing.assert_close(q, ref_q[0].transpose(0, 1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k, ref_k[0].transpose(0, 1), rtol=1e-5, atol=1e-5)


def test_default_cache_is_plain_neox_rotary() -> None:
    # The layout the Triton kernels read: [max_pos, rotary_dim] = cos | sin of pos * inv_freq.
    rope = RotaryEmbedding(64, 512, 10_000.0, rotary_dim=32)
    inv_freq = 1.0 / 10_000.0 ** (torch.arange(0, 32, 2, dtype=torch.float32) / 32)
    freqs = torch.arange(512, dtype=torch.float32)[:, None] * inv_freq
    assert torch.equal(rope.cos_sin_cache, torch.cat([freqs.cos(), freqs.sin()], dim=-1))
    assert rope.rotary_dim == 32 and rope.attention_factor == 1.0
    assert torch.equal(get_rope(64, 512, 10_000.0, {"rope_type": "default", "rope_theta": 1.0},
                                rotary_dim=32).cos_sin_cache, rope.cos_sin_cache)


def test_rope_theta_in_dict_is_ignored() -> None:
    scaling = {"rope_type": "linear", "factor": 4.0}
    plain = get_rope(64, 256, 10_000.0, scaling).cos_sin_cache
    with_theta = get_rope(64, 256, 10_000.0, {**scaling, "rope_theta": 1.0}).cos_sin_cache
    assert torch.equal(plain, with_theta)


@pytest.mark.parametrize("name", ["llama3", "yarn"])
def test_original_max_position_falls_back_to_config(name: str) -> None:
    # HF fills a missing original_max_position_embeddings from max_position_embeddings.
    case = CASES[name]
    old = case.rope_scaling["original_max_position_embeddings"]
    missing = {k: v for k, v in case.rope_scaling.items()
               if k != "original_max_position_embeddings"}
    inv_freq, factor = rope_inv_freq(case.head_size, case.base, missing, original_max_position=old)
    ref_config = hf_config(dataclasses.replace(case, max_position_embeddings=old), missing)
    ref_inv_freq, ref_factor = hf_inv_freq(ref_config)
    torch.testing.assert_close(inv_freq, ref_inv_freq.float(), rtol=1e-6, atol=0)
    assert factor == pytest.approx(ref_factor, rel=1e-12)
    with pytest.raises(ValueError, match="original_max_position_embeddings"):
        get_rope(case.head_size, 256, case.base, missing)


def test_partial_rotary_factor() -> None:
    case = CASES["yarn"]
    scaling = {**case.rope_scaling, "partial_rotary_factor": 0.5}
    rope = get_rope(case.head_size, 1024, case.base, scaling)
    assert rope.rotary_dim == case.head_size // 2
    ref_inv_freq, ref_factor = hf_inv_freq(hf_config(case, scaling))
    freqs = torch.arange(1024, dtype=torch.float32)[:, None] * ref_inv_freq
    ref_cache = torch.cat([freqs.cos() * ref_factor, freqs.sin() * ref_factor], dim=-1)
    torch.testing.assert_close(rope.cos_sin_cache, ref_cache, rtol=1e-6, atol=1e-7)
    # An explicit rotary_dim wins over the dict's factor.
    assert get_rope(case.head_size, 16, case.base, scaling, rotary_dim=96).rotary_dim == 96


LLAMA3 = CASES["llama3"].rope_scaling
YARN = CASES["yarn"].rope_scaling


@pytest.mark.parametrize("rope_scaling, message", [
    ({"rope_type": "dynamic", "factor": 2.0},
     "config rope_scaling type 'dynamic' is not supported; supported: default, linear, llama3, "
     "yarn"),
    ({"type": "longrope", "factor": 2.0}, "type 'longrope' is not supported"),
    ({k: v for k, v in LLAMA3.items() if k != "low_freq_factor"},
     "field 'low_freq_factor' is missing; rope type 'llama3' needs: factor, low_freq_factor, "
     "high_freq_factor"),
    ({"rope_type": "linear"}, "field 'factor' is missing"),
    ({"rope_type": "linear", "factor": "4"}, "field 'factor' must be a number > 0"),
    ({"rope_type": "yarn", "factor": None, "original_max_position_embeddings": 4096},
     "field 'factor' is missing"),
    ({**LLAMA3, "high_freq_factor": 1.0}, "'high_freq_factor' .* must be greater than"),
    ({**LLAMA3, "original_max_position_embeddings": 8192.5},
     "'original_max_position_embeddings' must be a positive integer"),
    ({**YARN, "beta_fast": "32"}, "field 'beta_fast' must be a number"),
    ({**YARN, "truncate": "no"}, "field 'truncate' must be true or false"),
    ({**YARN, "partial_rotary_factor": 1.5}, "'partial_rotary_factor' must be in"),
    (["linear", 2.0], "rope_scaling must be a dict"),
])
def test_invalid_rope_scaling_raises(rope_scaling: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        check_rope_scaling(rope_scaling)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=message):
        get_rope(128, 16, 10_000.0, rope_scaling)  # type: ignore[arg-type]


def test_supported_types_all_accepted() -> None:
    assert SUPPORTED_ROPE_TYPES == ("default", "linear", "llama3", "yarn")
    check_rope_scaling(None)
    check_rope_scaling({})
    for case in CASES.values():
        check_rope_scaling(case.rope_scaling)
    # None/0 optional yarn fields fall back as in transformers, they are not errors.
    check_rope_scaling({**YARN, "beta_fast": None, "mscale": 0, "attention_factor": None})
    assert math.isclose(rope_inv_freq(64, 1e4, {**YARN, "beta_fast": None})[1],
                        rope_inv_freq(64, 1e4, YARN)[1])
