"""The decode GEMV kernel (models/kernels/gemv.py) on CPU, under TRITON_INTERPRET=1.

The interpreter must be on before triton is first imported, so the kernel checks run this file
as a script in a fresh subprocess (tests/interpret.py). Reference: `F.linear` in float64 on the
same (already rounded) inputs. The interpreter multiplies bf16 tl.dot operands as raw bits, so
the "mma" kind is checked here in fp32 and fp16 only (tests/gpu covers bf16 on the GPU).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from tests.interpret import interpreted_check_test, run_checks

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                reason="triton is not installed")

# Max error relative to the largest |reference| entry: float32 accumulation vs float64, and
# one bf16/fp16 rounding of the output (2^-8 relative) plus float32 accumulation.
RTOL = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 1e-2}

CHECKS = ["fp32", "bf16", "fp16", "every_m", "out_given", "strided_x", "split_workspace",
          "edges", "default_config"]


def reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.nn.functional.linear(x.double(), weight.double(),
                                      None if bias is None else bias.double())


def assert_matches(got: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                   bias: torch.Tensor | None, what: str) -> None:
    ref = reference(x, weight, bias)
    assert got.shape == ref.shape and got.dtype == x.dtype, (what, got.shape, got.dtype)
    scale = ref.abs().max().item()
    err = (got.double() - ref).abs().max().item()
    assert err <= RTOL[x.dtype] * scale, f"{what}: max error {err:.3g} vs scale {scale:.3g}"


test_gemv_kernel_check_interpreted = interpreted_check_test(__file__, CHECKS)


# --------------------------------------------------------------------------- host-side rules


def test_use_gemv_refuses_what_it_cannot_serve() -> None:
    from models.kernels.gemv import MAX_M, TUNED, TUNED_MAX_M, gemv, gemv_supported, use_gemv

    w = torch.randn(64, 32)
    assert not use_gemv(torch.randn(1, 32), w)  # CPU tensors go to F.linear
    n, k = 1024, 2048  # a measured winner (0.6B o_proj)
    assert TUNED[(n, k, 2)] is not None
    assert gemv_supported(1, n, k, torch.bfloat16)
    assert not gemv_supported(TUNED_MAX_M + 1, n, k, torch.bfloat16)  # unmeasured batch
    assert not gemv_supported(0, n, k, torch.bfloat16)
    assert not gemv_supported(1, n, k, torch.int8)
    assert not gemv_supported(1, n, k, torch.float32)  # unmeasured dtype size
    assert not gemv_supported(1, 6144, 1024, torch.bfloat16)  # cuBLAS won (0.6B gate_up)
    assert not gemv_supported(1, n + 1, k, torch.bfloat16)  # unmeasured shape
    with pytest.raises(AssertionError, match="at most"):
        gemv(torch.randn(MAX_M + 1, 32), w)


def test_config_validation() -> None:
    from models.kernels.gemv import GemvConfig, choose_config

    for bad in (dict(block_n=3, block_k=64), dict(block_n=4, block_k=8),
                dict(block_n=4, block_k=64, split_k=0), dict(block_n=4, block_k=64, kind="x"),
                dict(block_n=8, block_k=64, kind="mma")):
        with pytest.raises(ValueError):
            GemvConfig(**bad)
    # The default for every reference shape is a valid config with K tiles no wider than K.
    for n, k in [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072), (6144, 4096),
                 (4096, 12288), (1536, 4096), (4096, 1024)]:
        for dtype in (torch.bfloat16, torch.float32):
            cfg = choose_config(n, k, dtype)
            assert isinstance(cfg, GemvConfig) and cfg.block_k <= k, (n, k, cfg)


# --------------------------------------------------------------------------- subprocess side


def _main() -> None:
    from models.kernels.gemv import MAX_M, GemvConfig, gemv, gemv_workspace

    gen = torch.Generator().manual_seed(0)

    def inputs(m: int, n: int, k: int, dtype: torch.dtype, with_bias: bool
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        x = torch.randn(m, k, generator=gen).to(dtype)
        w = (torch.randn(n, k, generator=gen) / k**0.5).to(dtype)
        b = torch.randn(n, generator=gen).to(dtype) if with_bias else None
        return x, w, b

    # N=100, K=72: neither is a multiple of any block; every K loop ends in a ragged tile.
    fma = {
        "fma": GemvConfig(block_n=16, block_k=32),
        "fma_wide_k": GemvConfig(block_n=8, block_k=128, num_warps=2),
        "fma_split": GemvConfig(block_n=16, block_k=16, split_k=3),  # last split ragged
    }
    mma = {
        "mma": GemvConfig(block_n=16, block_k=32, kind="mma", num_stages=3),
        "mma_split": GemvConfig(block_n=32, block_k=16, kind="mma", split_k=2),
    }

    def sweep(configs: dict[str, GemvConfig], dtype: torch.dtype, shapes) -> None:
        for name, cfg in configs.items():
            for i, (m, n, k) in enumerate(shapes):
                x, w, b = inputs(m, n, k, dtype, with_bias=i % 2 == 0)
                assert_matches(gemv(x, w, b, config=cfg), x, w, b, f"{name} {dtype} M={m}")

    # K=64 with 32-wide tiles takes the EVEN_K path (no K masks).
    ragged = [(1, 100, 72), (3, 100, 72), (8, 100, 72), (3, 40, 64)]

    def check_fp32():
        sweep(fma | mma, torch.float32, ragged)

    def check_bf16():
        sweep(fma, torch.bfloat16, ragged)

    def check_fp16():
        sweep(mma | {"fma": fma["fma"]}, torch.float16, ragged)

    def check_every_m():
        # Each runtime row bucket (1, 2, 4, 8), the rows a bucket pads past M included.
        for m in range(1, MAX_M + 1):
            x, w, b = inputs(m, 24, 48, torch.float32, with_bias=m % 2 == 1)
            for name in ("fma", "mma"):
                cfg = (fma | mma)[name]
                assert_matches(gemv(x, w, b, config=cfg), x, w, b, f"{name} M={m}")

    def check_out_given():
        # `out` a column window of a wider buffer (row stride != N); the rest stays as it was.
        for cfg in (fma["fma"], fma["fma_split"], mma["mma"]):
            x, w, b = inputs(3, 100, 72, torch.float32, with_bias=True)
            buf = torch.full((3, 130), float("nan"))
            out = buf[:, 10:110]
            ws = gemv_workspace(MAX_M, 100, "cpu") if cfg.split_k > 1 else None
            got = gemv(x, w, b, out=out, config=cfg, workspace=ws)
            assert got.data_ptr() == out.data_ptr()
            assert_matches(out, x, w, b, f"out given {cfg}")
            assert buf[:, :10].isnan().all() and buf[:, 110:].isnan().all()

    def check_strided_x():
        big = torch.randn(8, 100, generator=gen)
        w = torch.randn(50, 72, generator=gen)
        for x in (big[1:4, 8:80], big[2:3, :72], big[:, 20:92]):
            assert x.stride(0) == 100 and x.stride(1) == 1
            for cfg in (fma["fma"], mma["mma"]):
                assert_matches(gemv(x, w, None, config=cfg), x, w, None, f"strided {x.shape}")
        rows = torch.randn(6, 72, generator=gen)[2:5]  # a row slice of a contiguous tensor
        assert_matches(gemv(rows, w, None, config=fma["fma"]), rows, w, None, "row slice")

    def check_split_workspace():
        # One workspace serves calls of any M <= its rows: each call leaves it zeroed.
        ws = gemv_workspace(MAX_M, 100, "cpu")
        for m, cfg in [(8, fma["fma_split"]), (2, mma["mma_split"]), (5, fma["fma_split"])]:
            x, w, b = inputs(m, 100, 72, torch.float32, with_bias=m != 2)
            assert_matches(gemv(x, w, b, config=cfg, workspace=ws), x, w, b, f"ws M={m}")
            assert torch.count_nonzero(ws) == 0, "the workspace was not left zeroed"

    def check_edges():
        x, w, b = inputs(0, 20, 32, torch.float32, with_bias=True)
        assert gemv(x, w, b).shape == (0, 20)
        # One output row; K smaller than one vector group of a tile.
        for n, k in [(1, 40), (20, 5)]:
            x, w, b = inputs(2, n, k, torch.float32, with_bias=True)
            assert_matches(gemv(x, w, b, config=fma["fma"]), x, w, b, f"N={n} K={k}")

    def check_default_config():
        for m, dtype in [(2, torch.float32), (1, torch.bfloat16)]:
            x, w, b = inputs(m, 40, 96, dtype, with_bias=True)
            assert_matches(gemv(x, w, b), x, w, b, f"default {dtype}")

    run_checks(list(zip(CHECKS, [check_fp32, check_bf16, check_fp16, check_every_m,
                                 check_out_given, check_strided_x, check_split_workspace,
                                 check_edges, check_default_config], strict=True)))


if __name__ == "__main__":
    _main()
