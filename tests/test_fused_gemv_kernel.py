"""The fused [add +] RMSNorm -> GEMV [-> SiLU-and-mul] kernel (models/kernels/fused_gemv.py) on
CPU, under TRITON_INTERPRET=1.

The interpreter must be on before triton is first imported, so the kernel checks run this file
as a script in a fresh subprocess (tests/interpret.py). Reference: the unfused torch path on the
same inputs: models.layers.layernorm's rms_norm / add_rms_norm, F.linear, and
models.layers.activation's silu_and_mul. Half-precision outputs are also compared bit for bit
with that path (SiLU in float32 and rounded once, as torch.compile runs it): a rounding step
the kernel skipped or added moves a large share of the outputs by an ulp, which a 1e-2 error
bound alone would not see.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from tests.interpret import (
    interpreted_check_test,
    round_bf16_like_the_gpu,
    run_checks,
)

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                reason="triton is not installed")

HALF = (torch.bfloat16, torch.float16)
# Max abs error relative to the reference's max abs value, for half-precision outputs.
HALF_RTOL = 1e-2
# Share of half-precision outputs (or one output) allowed to differ from the torch path at all:
# the kernel's float32 sums run in another order than torch's, which flips a rounding now and
# then (~0.2% of outputs seen here).
MAX_MISMATCH = 0.03

CHECKS = ["float32", "bfloat16", "float16", "eps", "out_given", "edges", "default_config"]


@dataclass(frozen=True)
class Combo:
    """Which neighbours are fused in."""

    norm: bool
    residual: bool
    silu: bool


COMBOS = [Combo(False, False, False), Combo(False, False, True), Combo(True, False, False),
          Combo(True, False, True), Combo(True, True, False), Combo(True, True, True)]


@dataclass
class Inputs:
    x: torch.Tensor  # [1, K]
    weight: torch.Tensor  # [N, K]
    norm_weight: torch.Tensor | None  # [K]
    residual: torch.Tensor | None  # [1, K]


def make_inputs(combo: Combo, n: int, k: int, dtype: torch.dtype, gen: torch.Generator,
                scale: float = 1.0) -> Inputs:
    x = (scale * torch.randn(1, k, generator=gen)).to(dtype)
    weight = (torch.randn(n, k, generator=gen) / k**0.5).to(dtype)
    # Far from 1, so a norm weight read at the wrong index shows.
    norm_weight = (1 + 0.5 * torch.randn(k, generator=gen)).to(dtype) if combo.norm else None
    residual = (scale * torch.randn(1, k, generator=gen)).to(dtype) if combo.residual else None
    return Inputs(x, weight, norm_weight, residual)


def reference(inp: Inputs, eps: float, silu: bool
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out with SiLU in float32 and one rounding, out through activation.silu_and_mul,
    new residual) of the unfused path."""
    from models.layers.activation import silu_and_mul
    from models.layers.layernorm import add_rms_norm, rms_norm

    h, new_residual = inp.x, inp.x
    if inp.residual is not None:
        h, new_residual = add_rms_norm(inp.x, inp.residual, inp.norm_weight, eps)
    elif inp.norm_weight is not None:
        h = rms_norm(inp.x, inp.norm_weight, eps)
    y = F.linear(h, inp.weight)
    if not silu:
        return y, y, new_residual
    gate, up = y.chunk(2, dim=-1)
    return (F.silu(gate.float()) * up.float()).to(y.dtype), silu_and_mul(y), new_residual


def run(inp: Inputs, eps: float, silu: bool, config=None, out=None, residual_out=None
        ) -> tuple[torch.Tensor, torch.Tensor]:
    from models.kernels.fused_gemv import fused_gemv

    return fused_gemv(inp.x, inp.weight, norm_weight=inp.norm_weight, eps=eps,
                      residual=inp.residual, silu_mul=silu, out=out, residual_out=residual_out,
                      config=config)


def assert_matches(got: torch.Tensor, exact: torch.Tensor, what: str,
                   composed: torch.Tensor | None = None) -> None:
    """got vs the torch path's output `exact`: float32 within 1e-5; half precision within
    HALF_RTOL of the scale of `composed` (default: exact) and bit for bit on all but
    MAX_MISMATCH of the outputs. Shared with tests/gpu/test_fused_gemv_gpu.py."""
    composed = exact if composed is None else composed
    assert got.shape == exact.shape and got.dtype == exact.dtype, (what, got.shape, got.dtype)
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, exact, atol=1e-5, rtol=1e-5, msg=what)
        return
    scale = composed.double().abs().max().item()
    err = (got.double() - composed.double()).abs().max().item()
    assert err < HALF_RTOL * scale, f"{what}: max error {err:.3g} vs scale {scale:.3g}"
    mismatches = int((got != exact).sum())
    assert mismatches <= max(1, MAX_MISMATCH * got.numel()), (
        f"{what}: {mismatches} of {got.numel()} outputs differ from the torch path (rounding?)")


def assert_out_matches(got: torch.Tensor, inp: Inputs, eps: float, silu: bool, what: str
                       ) -> None:
    exact, composed, _ = reference(inp, eps, silu)
    assert_matches(got, exact, what, composed)


def check_call(inp: Inputs, combo: Combo, eps: float, config, what: str) -> None:
    """One kernel call against the reference, and what it must leave alone."""
    x_before = inp.x.clone()
    res_before = inp.residual.clone() if inp.residual is not None else None
    out, new_residual = run(inp, eps, combo.silu, config)
    assert_out_matches(out, inp, eps, combo.silu, what)
    assert torch.equal(inp.x, x_before), f"{what}: x was written"
    if inp.residual is None:
        assert new_residual is inp.x, f"{what}: without a residual, x is the new residual"
    else:
        assert torch.equal(inp.residual, res_before), f"{what}: residual was written"
        assert torch.equal(new_residual, inp.x + inp.residual), f"{what}: residual_out"


test_fused_gemv_kernel_check_interpreted = interpreted_check_test(__file__, CHECKS)


# --------------------------------------------------------------------------- host-side rules


def test_refuses_what_it_cannot_serve() -> None:
    from models.kernels.fused_gemv import fused_gemv, fused_gemv_supported

    k = 64
    x, w, nw = torch.randn(1, k), torch.randn(32, k), torch.randn(k)
    res = torch.randn(1, k)
    assert not fused_gemv_supported(x, w, norm_weight=nw, residual=res)  # CPU tensors
    bad_calls = {
        "must be \\[1, K\\]": dict(x=torch.randn(2, k)),
        "must match": dict(weight=w.double()),
        "contiguous \\[N": dict(weight=torch.randn(k, 32).t()),
        "even number": dict(weight=torch.randn(31, k), silu_mul=True),
        "pass norm_weight": dict(norm_weight=None, residual=res),
        "only written when residual": dict(residual_out=torch.empty(1, k)),
        "must not overlap": dict(residual=res, residual_out=res),
        "norm_weight .* x's dtype": dict(norm_weight=nw.double()),
        "out must be \\[1, 16\\]": dict(silu_mul=True, out=torch.empty(1, 32)),
    }
    for match, override in bad_calls.items():
        args = dict(x=x, weight=w, norm_weight=nw) | override
        with pytest.raises(AssertionError, match=match):
            fused_gemv(args.pop("x"), args.pop("weight"), **args)


def test_config_validation_and_choice() -> None:
    from models.kernels.fused_gemv import TUNED, FusedGemvConfig, choose_fused_config

    for bad in (dict(block_n=3, block_k=64), dict(block_n=4, block_k=8),
                dict(block_n=4, block_k=96), dict(block_n=4, block_k=64, num_warps=6)):
        with pytest.raises(ValueError):
            FusedGemvConfig(**bad)
    for key, cfg in TUNED.items():
        assert isinstance(cfg, FusedGemvConfig) and len(key) == 4, (key, cfg)
    # Qwen3-0.6B / 8B and the 8B TP shards: valid configs with K tiles no wider than K.
    shapes = [(4096, 1024, False), (6144, 1024, True), (6144, 4096, False), (24576, 4096, True),
              (12288, 4096, True), (6144, 4096, True), (64, 48, True)]
    for n, k, silu in shapes:
        for dtype in (torch.bfloat16, torch.float32):
            cfg = choose_fused_config(n, k, dtype, silu)
            assert cfg.block_k <= max(16, 1 << (k - 1).bit_length()), (n, k, cfg)


# --------------------------------------------------------------------------- subprocess side


def _main() -> None:
    from models.kernels.fused_gemv import FusedGemvConfig

    round_bf16_like_the_gpu()
    gen = torch.Generator().manual_seed(0)
    configs = {
        "n4_k64": FusedGemvConfig(block_n=4, block_k=64, num_warps=2),  # several K tiles
        "n16_k256": FusedGemvConfig(block_n=16, block_k=256),  # one K tile: the early path
    }
    # (N, K): K=208 ends every multi-tile loop in a ragged tile and is one ragged 256 tile;
    # K=256 takes the EVEN_K paths. Neither N (nor N/2 with silu) is a multiple of BLOCK_N.
    shapes = [(100, 208), (38, 256)]

    def sweep(dtype: torch.dtype, shapes: list[tuple[int, int]], eps: float = 1e-6,
              scale: float = 1.0) -> None:
        for combo in COMBOS:
            for name, cfg in configs.items():
                for n, k in shapes:
                    inp = make_inputs(combo, n, k, dtype, gen, scale)
                    check_call(inp, combo, eps, cfg, f"{combo} {name} {dtype} N={n} K={k}")

    def check_float32() -> None:
        sweep(torch.float32, shapes)

    def check_bfloat16() -> None:
        sweep(torch.bfloat16, shapes)

    def check_float16() -> None:
        sweep(torch.float16, shapes[:1])

    def check_eps() -> None:
        # Qwen3's eps of 1e-6 is invisible next to a mean square of ~1; here it is half the
        # mean square, so a dropped or misplaced eps fails.
        sweep(torch.float32, shapes[:1], eps=1e-4, scale=0.01)

    def check_out_given() -> None:
        # out and residual_out are column windows of NaN buffers: written in place, returned,
        # and nothing around them touched.
        combo = Combo(True, True, True)
        inp = make_inputs(combo, 100, 208, torch.bfloat16, gen)
        out_buf = torch.full((1, 70), float("nan"), dtype=torch.bfloat16)
        res_buf = torch.full((1, 230), float("nan"), dtype=torch.bfloat16)
        out, res_out = out_buf[:, 10:60], res_buf[:, 16:224]
        got, new_residual = run(inp, 1e-6, True, configs["n4_k64"], out, res_out)
        assert got is out and new_residual is res_out
        assert_out_matches(out, inp, 1e-6, True, "out given")
        assert torch.equal(res_out, inp.x + inp.residual)
        for rest in (out_buf[:, :10], out_buf[:, 60:], res_buf[:, :16], res_buf[:, 224:]):
            assert rest.isnan().all(), "a write outside out / residual_out"

    def check_edges() -> None:
        # One output column (silu over two weight rows, and a single row); K = 72, not a
        # multiple of 16 (fused_gemv_supported refuses it on the GPU, but the kernel is still
        # right); a K smaller than one 16-byte vector group of the tile.
        cfg = configs["n4_k64"]
        for combo, n, k in [(Combo(True, True, True), 2, 64), (Combo(True, True, False), 1, 72),
                            (Combo(True, False, True), 10, 72), (Combo(True, True, True), 6, 5)]:
            for dtype in (torch.float32, torch.bfloat16):
                inp = make_inputs(combo, n, k, dtype, gen)
                check_call(inp, combo, 1e-6, cfg, f"edge {combo} {dtype} N={n} K={k}")

    def check_default_config() -> None:
        for dtype, combo in [(torch.float32, Combo(True, True, True)),
                             (torch.bfloat16, Combo(True, False, False))]:
            inp = make_inputs(combo, 40, 96, dtype, gen)
            check_call(inp, combo, 1e-6, None, f"default {dtype}")

    run_checks(list(zip(CHECKS, [check_float32, check_bfloat16, check_float16, check_eps,
                                 check_out_given, check_edges, check_default_config],
                        strict=True)))


if __name__ == "__main__":
    _main()
