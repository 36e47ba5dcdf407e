"""models/layers/decode_ops.py's Triton paths on CUDA, bf16, at the decode shapes of
Qwen3-0.6B, Llama-3.2-1B and Qwen3-8B.

Reference: the torch path of each op run eagerly on the same GPU inputs (rms_norm /
add_rms_norm, F.linear through cuBLAS, silu_and_mul, apply_rotary, the torch backend's store_kv):
within 1e-2 of the reference's largest magnitude (the GEMV sums in another order), the new
residual and everything the cache holds outside the stored rows bit for bit. CUDA-graph
capture + replay with new inputs must equal eager calls on those inputs bit for bit (no
kernel here is nondeterministic), with and without programmatic dependent launch.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from models.backends.torch_backend import store_kv
from models.kernels import decode_gemv as decode_gemv_module
from models.layers import decode_ops
from models.layers.activation import silu_and_mul
from models.layers.layernorm import add_rms_norm, rms_norm
from models.layers.rotary import RotaryEmbedding, apply_rotary
from tests.gpu.graphs import capture

DEVICE = torch.device("cuda")
DTYPE = torch.bfloat16
EPS = 1e-6
TOL = 1e-2

# hidden, heads, kv heads, head_dim, intermediate, q/k norm, rope theta
MODELS = {
    "qwen3-0.6b": (1024, 16, 8, 128, 3072, True, 1e6),
    "llama-3.2-1b": (2048, 32, 8, 64, 8192, False, 5e5),
    "qwen3-8b": (4096, 32, 8, 128, 12288, True, 1e6),
}


def _randn(gen: torch.Generator, *shape: int, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=gen, device=DEVICE) * scale).to(DTYPE)


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    assert got.shape == want.shape and got.dtype == want.dtype, (got.shape, want.shape)
    return ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()


def _torch_norm_linear(x, residual, norm_weight, weight, bias, silu_mul):
    if residual is None:
        h, new_residual = rms_norm(x, norm_weight, EPS), x
    else:
        h, new_residual = add_rms_norm(x, residual, norm_weight, EPS)
    out = F.linear(h, weight, bias)
    return (silu_and_mul(out) if silu_mul else out), new_residual


def _linear_shapes(model: str) -> dict[str, tuple[int, int, bool, bool]]:
    """name -> (N weight rows, K, norm in front, silu_mul behind)."""
    hidden, heads, kv_heads, head_dim, inter, _, _ = MODELS[model]
    return {
        "qkv": ((heads + 2 * kv_heads) * head_dim, hidden, True, False),
        "o_proj": (hidden, heads * head_dim, False, False),
        "gate_up": (2 * inter, hidden, True, True),
        "down": (hidden, inter, False, False),
    }


@pytest.mark.parametrize("model", list(MODELS))
def test_linears_match_torch(model: str) -> None:
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    for name, (n, k, norm, silu) in _linear_shapes(model).items():
        x, weight = _randn(gen, 1, k), _randn(gen, n, k, scale=k**-0.5)
        for bias in (None, _randn(gen, n)):
            what = f"{model} {name} bias={bias is not None}"
            if not norm:
                assert decode_ops._gemv_serves(x, weight, bias), what
                err = _rel_err(decode_ops.linear(x, weight, bias), F.linear(x, weight, bias))
                assert err < TOL, (what, err)
                continue
            norm_weight = (1 + _randn(gen, k, scale=0.5)).to(DTYPE)
            for residual in (None, _randn(gen, 1, k)):
                x_before = x.clone()
                out, new_residual = decode_ops.norm_linear(x, residual, norm_weight, EPS,
                                                           weight, bias, silu)
                want, want_residual = _torch_norm_linear(x, residual, norm_weight, weight,
                                                         bias, silu)
                err = _rel_err(out, want)
                assert err < TOL, (what, residual is not None, err)
                assert torch.equal(x, x_before), what
                if residual is None:
                    assert new_residual is x, what
                else:
                    assert torch.equal(new_residual, want_residual), what


def test_lm_head_gemv_matches_torch() -> None:
    gen = torch.Generator(device=DEVICE).manual_seed(1)
    x, weight = _randn(gen, 1, 1024), _randn(gen, 151936, 1024, scale=1024**-0.5)
    assert _rel_err(decode_ops.linear(x, weight), F.linear(x, weight)) < TOL


def test_kernel_choice() -> None:
    """The GEMV serves one bf16/fp16 row; anything else is F.linear / the torch path."""
    gen = torch.Generator(device=DEVICE).manual_seed(2)
    weight = _randn(gen, 256, 1024)
    assert decode_ops._gemv_serves(_randn(gen, 1, 1024), weight, None)
    assert not decode_ops._gemv_serves(_randn(gen, 2, 1024), weight, None)
    assert not decode_ops._gemv_serves(_randn(gen, 1, 1024).float(), weight.float(), None)
    odd = _randn(gen, 256, 1000)
    assert not decode_ops._gemv_serves(_randn(gen, 1, 1000), odd, None)
    # The torch path at M > 1 is the composition itself.
    x, nw = _randn(gen, 3, 1024), (1 + _randn(gen, 1024, scale=0.5))
    out, _ = decode_ops.norm_linear(x, None, nw, EPS, weight)
    # (torch.compile'd there: it rounds differently from the eager reference, in the last bit)
    assert _rel_err(out, _torch_norm_linear(x, None, nw, weight, None, False)[0]) < TOL


def _rope_inputs(model: str, num_tokens: int, rotary_dim: int, seed: int):
    hidden, heads, kv_heads, head_dim, _, qk_norm, theta = MODELS[model]
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    qkv = _randn(gen, num_tokens, (heads + 2 * kv_heads) * head_dim, scale=2.0)
    positions = torch.randint(0, 4096, (num_tokens,), generator=gen, device=DEVICE)
    cos_sin = RotaryEmbedding(head_dim, 4096, theta, rotary_dim).to(DEVICE).cos_sin_cache
    q_w = (1 + _randn(gen, head_dim, scale=0.5)) if qk_norm else None
    k_w = (1 + _randn(gen, head_dim, scale=0.5)) if qk_norm else None
    block_size = 16
    num_blocks = num_tokens // block_size + 2
    slots = torch.randperm(num_blocks * block_size, generator=gen, device=DEVICE)[:num_tokens]
    slots[1::4] = -1
    kv_cache = torch.full((2, num_blocks, block_size, kv_heads, head_dim), float("nan"),
                          dtype=DTYPE, device=DEVICE)
    return dict(qkv=qkv, positions=positions, cos_sin_cache=cos_sin, rotary_dim=rotary_dim,
                q_norm_weight=q_w, k_norm_weight=k_w, eps=EPS, kv_cache=kv_cache,
                slot_mapping=slots, num_heads=heads, num_kv_heads=kv_heads,
                head_dim=head_dim)


def _torch_rope_store(qkv, positions, cos_sin_cache, rotary_dim, q_norm_weight,
                      k_norm_weight, eps, kv_cache, slot_mapping, num_heads, num_kv_heads,
                      head_dim):
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim,
                         num_kv_heads * head_dim], dim=-1)
    q = q.reshape(-1, num_heads, head_dim)
    k = k.reshape(-1, num_kv_heads, head_dim)
    v = v.reshape(-1, num_kv_heads, head_dim)
    if q_norm_weight is not None:
        q, k = rms_norm(q, q_norm_weight, eps), rms_norm(k, k_norm_weight, eps)
    q, k = apply_rotary(positions, q, k, cos_sin_cache, rotary_dim)
    store_kv(k, v, kv_cache, slot_mapping)
    return q


@pytest.mark.parametrize("num_tokens", [1, 5, 100])
@pytest.mark.parametrize("model", list(MODELS))
def test_rope_store_matches_torch(model: str, num_tokens: int) -> None:
    head_dim = MODELS[model][3]
    for rotary_dim in (head_dim, head_dim // 2):
        inp = _rope_inputs(model, num_tokens, rotary_dim, seed=num_tokens)
        ref_cache = inp["kv_cache"].clone()
        want_q = _torch_rope_store(**{**inp, "kv_cache": ref_cache})
        q, k, v = decode_ops.rope_store(**inp)
        what = f"{model} T={num_tokens} rotary_dim={rotary_dim}"
        assert k is None and v is None, what
        assert _rel_err(q, want_q) < TOL, what
        cache = inp["kv_cache"]
        assert torch.equal(cache.isnan(), ref_cache.isnan()), f"{what}: stored slots differ"
        assert _rel_err(cache.nan_to_num(0.0), ref_cache.nan_to_num(0.0)) < TOL, what
        # v is copied as is.
        assert torch.equal(cache[1].nan_to_num(0.0), ref_cache[1].nan_to_num(0.0)), what


def test_rope_store_without_cache_returns_k_v() -> None:
    inp = _rope_inputs("qwen3-0.6b", 3, 128, seed=3)
    ref_cache = inp["kv_cache"].clone()
    want_q = _torch_rope_store(**{**inp, "kv_cache": ref_cache})
    q, k, v = decode_ops.rope_store(**{**inp, "kv_cache": None})
    assert _rel_err(q, want_q) < TOL
    assert k.shape == v.shape == (3, 8, 128)


def _graph_matches_eager(make_inputs, call) -> tuple[dict, dict]:
    """Capture call(static) once, refill the static inputs with new values, replay: the
    outputs equal an eager call on the new values, bit for bit."""
    static = make_inputs(0)
    graph, outputs = capture(lambda: call(static))
    fresh = make_inputs(1)
    for key, value in static.items():
        if isinstance(value, torch.Tensor) and key not in ("cos_sin_cache",):
            value.copy_(fresh[key])
    graph.replay()
    torch.cuda.synchronize()
    want = call(fresh)
    for got, ref in zip(outputs, want, strict=True):
        if got is None:
            assert ref is None
        else:
            assert torch.equal(got.nan_to_num(0.0), ref.nan_to_num(0.0))
    return static, fresh


@pytest.mark.parametrize("pdl", ["1", "0"], ids=["pdl", "no_pdl"])
def test_cuda_graph_replay(pdl: str, monkeypatch: pytest.MonkeyPatch) -> None:
    launch_pdl = decode_gemv_module.pdl_enabled
    monkeypatch.setattr(decode_gemv_module, "pdl_enabled",
                        lambda device: pdl == "1" and launch_pdl(device))
    hidden, _, _, _, inter, _, _ = MODELS["qwen3-0.6b"]
    weights = torch.Generator(device=DEVICE).manual_seed(4)
    w_qkv = _randn(weights, 4096, hidden, scale=hidden**-0.5)
    w_gate_up = _randn(weights, 2 * inter, hidden, scale=hidden**-0.5)
    w_down = _randn(weights, hidden, inter, scale=inter**-0.5)
    norm_weight = 1 + _randn(weights, hidden, scale=0.5)

    def rows(seed: int) -> dict[str, torch.Tensor]:
        gen = torch.Generator(device=DEVICE).manual_seed(10 + seed)
        return dict(x=_randn(gen, 1, hidden), residual=_randn(gen, 1, hidden),
                    act=_randn(gen, 1, inter))

    def chain(inp: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        # A decode layer's GEMV chain: PDL edges between consecutive kernels.
        qkv, residual = decode_ops.norm_linear(inp["x"], inp["residual"], norm_weight, EPS,
                                               w_qkv)
        act, residual2 = decode_ops.norm_linear(qkv[:, :hidden], residual, norm_weight, EPS,
                                                w_gate_up, silu_mul=True)
        return qkv, residual, act, residual2, decode_ops.linear(act, w_down)

    _graph_matches_eager(rows, chain)

    def rope(seed: int) -> dict:
        inp = _rope_inputs("qwen3-0.6b", 1, 128, seed=20 + seed)
        inp["slot_mapping"].fill_(7 + seed)
        return inp

    static, fresh = _graph_matches_eager(rope, lambda inp: decode_ops.rope_store(**inp))
    assert torch.equal(static["kv_cache"].nan_to_num(0.0), fresh["kv_cache"].nan_to_num(0.0))


def test_pdl_is_on_for_hopper() -> None:
    major = torch.cuda.get_device_capability()[0]
    assert decode_gemv_module.pdl_enabled(DEVICE) == (major >= 9)
