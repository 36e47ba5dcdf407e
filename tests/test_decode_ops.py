"""models/layers/decode_ops.py on CPU, and its Triton kernels (models/kernels/decode_gemv.py,
models/kernels/rope_store.py) under TRITON_INTERPRET=1.

In process: each wrapper's torch path (what CPU runs) against a plain float64 reference
written out here (the rotary angles from the base, not from RotaryEmbedding's cache; the cache
store as a Python loop). In an interpreter subprocess (tests/interpret.py): the kernels on CPU
tensors against the torch path, float32 (plus one bf16 case each): the GEMV within float32
rounding (its sums run in another order), rope_store bit for bit without the q/k norm (within
an ulp or two with it: torch's mean sums in another order). Caches start as NaN, with a NaN
guard slot on either side, so a missed, stray or skipped-slot write shows.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.nn.functional as F

from tests.interpret import interpreted_check_test, round_bf16_like_the_gpu, run_checks

EPS = 1e-6
THETA = 1e6
MAX_POSITION = 512


# --------------------------------------------------------------------------- references


def ref_rms_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    x = x.double()
    return weight.double() * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + EPS)


def ref_norm_linear(x, residual, norm_weight, weight, bias, silu_mul):
    s = x if residual is None else x + residual
    y = ref_rms_norm(s, norm_weight) @ weight.double().T
    if bias is not None:
        y = y + bias.double()
    if silu_mul:
        gate, up = y.chunk(2, dim=-1)
        y = gate * torch.sigmoid(gate) * up
    return y, s


def ref_rope(qkv, positions, rotary_dim, q_norm_weight, k_norm_weight, num_heads,
             num_kv_heads, head_dim):
    """(q, k, v) float64 [T, heads, D]: per-head RMSNorm, NeoX rotary from the base."""
    t = qkv.shape[0]
    heads = qkv.double().reshape(t, num_heads + 2 * num_kv_heads, head_dim)
    q, k, v = heads.split([num_heads, num_kv_heads, num_kv_heads], dim=1)
    if q_norm_weight is not None:
        q, k = ref_rms_norm(q, q_norm_weight), ref_rms_norm(k, k_norm_weight)
    half = rotary_dim // 2
    inv_freq = THETA ** (-torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)
    angle = positions.double()[:, None, None] * inv_freq  # [T, 1, half]

    def rotate(x):
        x1, x2, rest = x[..., :half], x[..., half:rotary_dim], x[..., rotary_dim:]
        return torch.cat([x1 * angle.cos() - x2 * angle.sin(),
                          x2 * angle.cos() + x1 * angle.sin(), rest], dim=-1)

    return rotate(q), rotate(k), v


def make_cache(num_slots: int, block_size: int, num_kv_heads: int, head_dim: int,
               dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(storage, kv_cache): a NaN [2, num_blocks, block_size, Hkv, D] cache viewed inside a
    NaN buffer with one guard slot before and after it (what slot -1 would hit)."""
    guard = num_kv_heads * head_dim
    storage = torch.full((2 * num_slots * guard + 2 * guard,), float("nan"), dtype=dtype)
    kv_cache = storage[guard:-guard].view(2, num_slots // block_size, block_size,
                                          num_kv_heads, head_dim)
    return storage, kv_cache


def rope_inputs(num_tokens, num_heads, num_kv_heads, head_dim, rotary_dim, norm, dtype,
                seed, strided=False):
    from models.layers.rotary import RotaryEmbedding

    gen = torch.Generator().manual_seed(seed)
    width = (num_heads + 2 * num_kv_heads) * head_dim
    if strided:  # a column slice of a wider tensor (row stride > width)
        qkv = (torch.randn(num_tokens, width + 48, generator=gen) * 2).to(dtype)[:, 16:16 + width]
    else:
        qkv = (torch.randn(num_tokens, width, generator=gen) * 2).to(dtype)
    positions = torch.randperm(MAX_POSITION, generator=gen)[:num_tokens]
    cos_sin = RotaryEmbedding(head_dim, MAX_POSITION, THETA, rotary_dim).cos_sin_cache
    # Far from 1 and different for q and k, so a mixed-up weight shows.
    q_w = (1 + 0.5 * torch.randn(head_dim, generator=gen)).to(dtype) if norm else None
    k_w = (1 + 0.5 * torch.randn(head_dim, generator=gen)).to(dtype) if norm else None
    block_size = 4
    num_slots = block_size * (num_tokens // block_size + 2)
    slots = torch.randperm(num_slots, generator=gen)[:num_tokens]
    slots[1::3] = -1
    return qkv, positions, cos_sin, q_w, k_w, slots, num_slots, block_size


def stored_rows(kv_cache: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, ...]:
    _, nb, bs, hkv, d = kv_cache.shape
    flat = kv_cache.reshape(2, nb * bs, hkv, d)
    return flat[0, slots], flat[1, slots]


# --------------------------------------------------------------------------- torch paths


def test_linear_torch_path() -> None:
    from models.layers.decode_ops import linear

    gen = torch.Generator().manual_seed(0)
    x, w, b = (torch.randn(3, 64, generator=gen), torch.randn(96, 64, generator=gen),
               torch.randn(96, generator=gen))
    assert torch.equal(linear(x, w, b), F.linear(x, w, b))
    ref = x.double() @ w.double().T + b.double()
    torch.testing.assert_close(linear(x, w, b).double(), ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(linear(x[:1], w).double(), ref[:1] - b.double(),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("silu_mul", [False, True], ids=["plain", "silu_mul"])
@pytest.mark.parametrize("with_residual", [False, True], ids=["no_res", "res"])
@pytest.mark.parametrize("with_bias", [False, True], ids=["no_bias", "bias"])
def test_norm_linear_torch_path(dtype, silu_mul, with_residual, with_bias) -> None:
    from models.layers.decode_ops import norm_linear

    gen = torch.Generator().manual_seed(1)
    m, k, n = 3, 128, 96

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(dtype)

    x, residual = randn(m, k), randn(m, k) if with_residual else None
    norm_weight, weight = (1 + 0.5 * torch.randn(k, generator=gen)).to(dtype), randn(n, k)
    bias = randn(n) if with_bias else None
    x_before = x.clone()
    out, new_residual = norm_linear(x, residual, norm_weight, EPS, weight, bias, silu_mul)
    want, want_residual = ref_norm_linear(x, residual, norm_weight, weight, bias, silu_mul)
    assert out.shape == (m, n // 2 if silu_mul else n) and out.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    err = (out.double() - want).abs().max() / want.abs().max()
    assert err < tol, err
    assert torch.equal(x, x_before)
    if residual is None:
        assert new_residual is x
    else:
        assert torch.equal(new_residual, x + residual)


@pytest.mark.parametrize("with_cache", [True, False], ids=["cache", "no_cache"])
@pytest.mark.parametrize("rotary_dim", [32, 16], ids=lambda r: f"rotary{r}")
@pytest.mark.parametrize("norm", [True, False], ids=["qk_norm", "no_norm"])
def test_rope_store_torch_path(norm, rotary_dim, with_cache) -> None:
    from models.layers.decode_ops import rope_store

    h, hkv, d, t = 4, 2, 32, 7
    qkv, pos, cos_sin, q_w, k_w, slots, num_slots, bs = rope_inputs(
        t, h, hkv, d, rotary_dim, norm, torch.float32, seed=2, strided=True)
    storage, kv_cache = make_cache(num_slots, bs, hkv, d, torch.float32)
    want_q, want_k, want_v = ref_rope(qkv, pos, rotary_dim, q_w, k_w, h, hkv, d)
    q, k, v = rope_store(qkv, pos, cos_sin, rotary_dim, q_w, k_w, EPS,
                         kv_cache if with_cache else None, slots, h, hkv, d)
    tol = dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(q.double(), want_q, **tol)
    if not with_cache:
        torch.testing.assert_close(k.double(), want_k, **tol)
        torch.testing.assert_close(v.double(), want_v, **tol)
        assert storage.isnan().all()
        return
    assert k is None and v is None
    keep = slots >= 0
    k_rows, v_rows = stored_rows(kv_cache, slots[keep])
    torch.testing.assert_close(k_rows.double(), want_k[keep], **tol)
    torch.testing.assert_close(v_rows.double(), want_v[keep], **tol)
    # Everything else (the skipped tokens' would-be slots, the guards) is untouched.
    assert storage.isnan().sum() == storage.numel() - 2 * int(keep.sum()) * hkv * d


def test_choices() -> None:
    pytest.importorskip("triton")
    from models.kernels.decode_gemv import choose_config, pdl_enabled
    from models.kernels.rope_store import choose_heads_per_program

    for dtype in (torch.bfloat16, torch.float32):
        for k in (64, 1024, 2048, 4096, 12288):
            for n in (1024, 4096, 151936):
                for norm in (False, True):
                    cfg = choose_config(n, k, dtype, norm)
                    for value in (cfg.block_n, cfg.block_k, cfg.num_warps):
                        assert value & (value - 1) == 0, cfg
                    assert 16 // dtype.itemsize <= cfg.block_k <= max(16, k), cfg
    assert choose_heads_per_program(1, 16, 8) == 1  # a decode token spreads over heads
    assert choose_heads_per_program(256, 16, 8) == 8
    assert choose_heads_per_program(256, 12, 2) == 2  # divides both counts
    assert not pdl_enabled(torch.device("cpu"))


# --------------------------------------------------------------------------- interpreter

CHECKS = ["gemv", "gemv_ragged", "norm_gemv", "silu_gemv", "gemv_bf16", "rope",
          "rope_grouped", "rope_bf16", "wrappers_on_cpu"]

test_kernels_interpreted = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="triton is not installed")(
    interpreted_check_test(__file__, CHECKS))


def _main() -> None:
    round_bf16_like_the_gpu()
    from models.kernels.decode_gemv import GemvConfig, decode_gemv
    from models.kernels.rope_store import rope_store_kernel
    from models.layers.activation import silu_and_mul
    from models.layers.decode_ops import _norm_linear_torch, rope_store

    gen = torch.Generator().manual_seed(3)

    def randn(*shape, dtype=torch.float32, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(dtype)

    def close(got, want, what, tol=1e-5):
        assert got.shape == want.shape and got.dtype == want.dtype, (what, got.shape, got.dtype)
        err = ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()
        assert err <= tol, f"{what}: relative error {err}"

    # Interpreted programs cost milliseconds each: wide tiles keep the grids small; the
    # launcher's own choice (one weight row a program) runs on the smallest shape.
    wide = GemvConfig(block_n=32, block_k=128, num_warps=1)
    looped = GemvConfig(block_n=16, block_k=32, num_warps=1)  # several K steps

    def check_gemv():
        for m, k, n, cfg in ((1, 64, 96, None), (1, 128, 256, wide), (3, 128, 256, wide),
                             (3, 64, 96, looped), (1, 128, 256, looped)):
            x, w = randn(m, k), randn(n, k, scale=k**-0.5)
            for bias in (None, randn(n)):
                what = f"M={m} K={k} N={n} {cfg} bias={bias is not None}"
                out, new_residual = decode_gemv(x, w, bias, config=cfg)
                close(out, F.linear(x, w, bias), what)
                assert new_residual is x, what

    def check_gemv_ragged():
        # K not a multiple of BLOCK_K (masked K steps), N not of BLOCK_N (a partial tile).
        m, k, n = 3, 80, 96
        x, w, b = randn(m, k), randn(n, k, scale=k**-0.5), randn(n)
        r, nw = randn(m, k), 1 + randn(k, scale=0.5)
        cfg = GemvConfig(block_n=64, block_k=32, num_warps=1)
        close(decode_gemv(x, w, b, config=cfg)[0], F.linear(x, w, b), "plain")
        out, new_residual = decode_gemv(x, w, b, residual=r, norm_weight=nw, eps=EPS,
                                        silu_mul=True, config=cfg)
        want, want_residual = _norm_linear_torch(x, r, nw, EPS, w, b, True)
        close(out, want, "norm silu")
        assert torch.equal(new_residual, want_residual)

    def check_norm_gemv():
        for m, k, n, cfg in ((1, 64, 96, None), (1, 128, 256, wide), (3, 128, 256, looped)):
            x, w, nw = randn(m, k), randn(n, k, scale=k**-0.5), 1 + randn(k, scale=0.5)
            for residual in (None, randn(m, k)):
                for bias in (None, randn(n)):
                    what = f"M={m} K={k} N={n} {cfg} res={residual is not None}"
                    x_before = x.clone()
                    r_before = residual.clone() if residual is not None else None
                    out, new_residual = decode_gemv(x, w, bias, residual=residual,
                                                    norm_weight=nw, eps=EPS, config=cfg)
                    want, want_residual = _norm_linear_torch(x, residual, nw, EPS, w, bias,
                                                             False)
                    close(out, want, what)
                    assert torch.equal(x, x_before), what
                    if residual is None:
                        assert new_residual is x, what
                    else:
                        assert torch.equal(residual, r_before), what
                        assert torch.equal(new_residual, want_residual), what

    def check_silu_gemv():
        for m, k, n, cfg in ((1, 64, 96, None), (3, 128, 256, wide), (1, 128, 256, looped)):
            x, w, nw, r = (randn(m, k), randn(n, k, scale=k**-0.5), 1 + randn(k, scale=0.5),
                           randn(m, k))
            what = f"M={m} K={k} N={n} {cfg}"
            out, _ = decode_gemv(x, w, config=cfg, silu_mul=True)
            close(out, silu_and_mul(F.linear(x, w)), f"{what} no norm")
            b = randn(n)
            out, new_residual = decode_gemv(x, w, b, residual=r, norm_weight=nw, eps=EPS,
                                            silu_mul=True, config=cfg)
            want, want_residual = _norm_linear_torch(x, r, nw, EPS, w, b, True)
            close(out, want, f"{what} norm")
            assert torch.equal(new_residual, want_residual), what

    def check_gemv_bf16():
        m, k, n, dt = 1, 128, 256, torch.bfloat16
        x, w, r = randn(m, k, dtype=dt), randn(n, k, dtype=dt, scale=k**-0.5), randn(m, k, dtype=dt)
        nw = (1 + randn(k, scale=0.5)).to(dt)
        for silu in (False, True):
            out, new_residual = decode_gemv(x, w, residual=r, norm_weight=nw, eps=EPS,
                                            silu_mul=silu, config=wide)
            want, want_residual = _norm_linear_torch(x, r, nw, EPS, w, None, silu)
            close(out, want, f"silu={silu}", tol=1e-2)
            assert torch.equal(new_residual, want_residual)

    def rope_case(t, h, hkv, d, rotary_dim, norm, dtype, heads_per_program=None,
                  strided=False):
        qkv, pos, cos_sin, q_w, k_w, slots, num_slots, bs = rope_inputs(
            t, h, hkv, d, rotary_dim, norm, dtype, seed=t + h + rotary_dim, strided=strided)
        storage, kv_cache = make_cache(num_slots, bs, hkv, d, dtype)
        ref_storage, ref_cache = make_cache(num_slots, bs, hkv, d, dtype)
        q = rope_store_kernel(qkv, pos, cos_sin, rotary_dim, q_w, k_w, EPS, kv_cache[0],
                              kv_cache[1], slots, h, hkv, d,
                              heads_per_program=heads_per_program)
        want_q, k, v = rope_store(qkv, pos, cos_sin, rotary_dim, q_w, k_w, EPS, ref_cache,
                                  slots, h, hkv, d)
        assert k is None and v is None
        what = f"T={t} H={h} Hkv={hkv} D={d} rd={rotary_dim} norm={norm} {dtype}"
        # Same NaNs: nothing stored at skipped slots, nothing outside the cache.
        assert torch.equal(storage.isnan(), ref_storage.isnan()), what
        got_cache, want_cache = storage.nan_to_num(7.0), ref_storage.nan_to_num(7.0)
        if norm or dtype != torch.float32:
            tol = 2e-6 if dtype == torch.float32 else 1e-2
            close(q, want_q, what, tol)
            close(got_cache, want_cache, what, tol)
        else:
            assert torch.equal(q, want_q), what
            assert torch.equal(got_cache, want_cache), what

    def check_rope():
        for norm in (True, False):
            for rotary_dim in (32, 16):
                rope_case(5, 4, 2, 32, rotary_dim, norm, torch.float32, strided=True)  # GQA
        rope_case(3, 2, 2, 16, 16, True, torch.float32)  # MHA

    def check_rope_grouped():
        # Two heads a program (the large-batch grouping), with and without the norm.
        rope_case(4, 4, 2, 32, 32, True, torch.float32, heads_per_program=2)
        rope_case(4, 4, 2, 32, 16, False, torch.float32, heads_per_program=2)

    def check_rope_bf16():
        rope_case(4, 4, 2, 32, 32, True, torch.bfloat16)
        rope_case(4, 4, 2, 32, 16, False, torch.bfloat16)

    def check_wrappers_on_cpu():
        # CPU tensors never take the kernels (they are for CUDA): the wrappers' torch paths.
        from models.layers.decode_ops import linear, norm_linear

        x, w = randn(1, 64), randn(96, 64)
        assert torch.equal(linear(x, w), F.linear(x, w))
        nw = 1 + randn(64, scale=0.5)
        out, _ = norm_linear(x, None, nw, EPS, w)
        assert torch.equal(out, _norm_linear_torch(x, None, nw, EPS, w, None, False)[0])

    run_checks(list(zip(CHECKS, [check_gemv, check_gemv_ragged, check_norm_gemv,
                                 check_silu_gemv, check_gemv_bf16, check_rope,
                                 check_rope_grouped, check_rope_bf16, check_wrappers_on_cpu],
                        strict=True)))


if __name__ == "__main__":
    _main()
