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

from tests.interpret import assert_check_passed, run_checks, run_interpreted

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                reason="triton is not installed")

# Max error relative to the largest |reference| entry: float32 accumulation vs float64, and
# one bf16/fp16 rounding of the output (2^-8 relative) plus float32 accumulation.
RTOL = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 1e-2}

CHECKS = ["fp32", "bf16", "fp16", "every_m", "out_given", "strided_x", "split_workspace",
          "edges", "default_config", "silu_mul", "silu_mul_vs_unfused", "silu_mul_bitwise"]
# act="silu_mul" against the unfused gemv of eager silu_and_mul: fp32 differs only where
# torch's exp and numpy's (the interpreter's) differ in the last bit. In bf16 an activation
# element may round differently (eager rounds twice, the interpreter truncates), and each
# output carries its own bf16 rounding (truncation here): two ulps at the largest output.
UNFUSED_RTOL = {torch.float32: 1e-6, torch.bfloat16: 2**-6}


def reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.nn.functional.linear(x.double(), weight.double(),
                                      None if bias is None else bias.double())


def assert_close(got: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, rtol: float,
                 what: str) -> None:
    """Max error at most rtol x the largest |ref| entry."""
    assert got.shape == ref.shape and got.dtype == dtype, (what, got.shape, got.dtype)
    scale = ref.double().abs().max().item()
    err = (got.double() - ref.double()).abs().max().item()
    assert err <= rtol * scale, f"{what}: max error {err:.3g} vs scale {scale:.3g}"


def assert_matches(got: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                   bias: torch.Tensor | None, what: str) -> None:
    assert_close(got, reference(x, weight, bias), x.dtype, RTOL[x.dtype], what)


@pytest.fixture(scope="module")
def interpreter_run() -> str:
    """One interpreter subprocess runs every check."""
    return run_interpreted(__file__)


@pytest.mark.parametrize("check", CHECKS)
def test_gemv_kernel_check_interpreted(interpreter_run: str, check: str) -> None:
    assert_check_passed(interpreter_run, check)


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


def test_silu_mul_host_rules() -> None:
    from models.kernels.gemv import GemvConfig, gemv, use_gemv

    x, w = torch.randn(1, 64), torch.randn(16, 32)
    assert not use_gemv(x, w, act="silu_mul")  # CPU
    with pytest.raises(ValueError, match="act"):
        use_gemv(x, w, act="gelu_mul")
    with pytest.raises(ValueError, match="act"):
        gemv(x, w, act="gelu_mul")
    with pytest.raises(AssertionError, match="2 \\* K"):
        gemv(torch.randn(1, 65), w, act="silu_mul")  # odd width: no gate | up halves
    with pytest.raises(AssertionError, match="fma"):
        gemv(x, w, act="silu_mul", config=GemvConfig(block_n=16, block_k=32, kind="mma"))


def test_linear_act_falls_back_to_silu_and_mul_then_linear() -> None:
    # Off the GEMV (here: CPU) the layer runs the old path: SiluAndMul, then F.linear.
    from models.layers.activation import silu_and_mul
    from models.layers.linear import RowParallelLinear, linear

    gen = torch.Generator().manual_seed(0)
    layer = RowParallelLinear(48, 20, bias=True)
    layer.weight.data.copy_(torch.randn(20, 48, generator=gen))
    layer.bias.data.copy_(torch.randn(20, generator=gen))
    for m in (1, 3):
        x = torch.randn(m, 96, generator=gen)  # [T, 2 * 48]: gate | up
        gate, up = x[:, :48].double(), x[:, 48:].double()
        ref = torch.nn.functional.linear(gate * torch.sigmoid(gate) * up,
                                         layer.weight.double(), layer.bias.double())
        torch.testing.assert_close(layer(x, act="silu_mul"), ref.float())
        assert torch.equal(linear(x, layer.weight, act="silu_mul"),
                           torch.nn.functional.linear(silu_and_mul(x), layer.weight))
    with pytest.raises(ValueError, match="gated activation"):
        linear(x, layer.weight, act="gelu_mul")


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
    import numpy as np

    from models.kernels.gemv import MAX_M, GemvConfig, gemv, gemv_workspace
    from models.layers.activation import silu_and_mul

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

    # act="silu_mul": x [M, 2K] = gate | up. K=64 fills whole 32-wide tiles; K=72 ends ragged
    # (masked gate and up lanes must add nothing); the split config splits K in 3.
    act_configs = {"fma": fma["fma"], "fma_split": fma["fma_split"]}
    act_shapes = [(m, 40, k) for m in (1, 2, 3, 8) for k in (64, 72)]

    def silu_mul_cases(dtype: torch.dtype):
        for name, cfg in act_configs.items():
            for i, (m, n, k) in enumerate(act_shapes):
                x2, w, b = inputs(m, n, 2 * k, dtype, with_bias=i % 2 == 0)
                w = w[:, :k].contiguous()
                yield f"{name} {dtype} M={m} K={k} bias={b is not None}", cfg, x2, w, b

    def check_silu_mul():
        for dtype in (torch.float32, torch.bfloat16):
            for what, cfg, x2, w, b in silu_mul_cases(dtype):
                got = gemv(x2, w, b, config=cfg, act="silu_mul")
                ref = reference(silu_and_mul(x2.double()), w, b)
                assert_close(got, ref, dtype, RTOL[dtype], what)
        # x a column window of a wider buffer (row stride != 2K), the default config.
        big = torch.randn(3, 200, generator=gen)
        x2, w = big[:, 30:174], torch.randn(24, 72, generator=gen)
        assert_close(gemv(x2, w, act="silu_mul"), reference(silu_and_mul(x2.double()), w, None),
                     torch.float32, RTOL[torch.float32], "strided x")

    def check_silu_mul_vs_unfused():
        for dtype in (torch.float32, torch.bfloat16):
            for what, cfg, x2, w, b in silu_mul_cases(dtype):
                got = gemv(x2, w, b, config=cfg, act="silu_mul")
                unfused = gemv(silu_and_mul(x2), w, b, config=cfg)
                assert_close(got, unfused, dtype, UNFUSED_RTOL[dtype], what)

    def check_silu_mul_bitwise():
        # Same activation values in, same sums in the same order: the unfused gemv of the
        # kernel's float32 formula (numpy's exp, as the interpreter's) rounded once to x's
        # dtype gives the same bits. Not bf16: the interpreter truncates float32 -> bf16.
        for dtype in (torch.float32, torch.float16):
            for what, cfg, x2, w, b in silu_mul_cases(dtype):
                k = w.shape[1]
                xf = x2.float().numpy()
                gate, up = xf[:, :k], xf[:, k:]
                act = torch.from_numpy(gate / (np.float32(1) + np.exp(-gate)) * up).to(dtype)
                got = gemv(x2, w, b, config=cfg, act="silu_mul")
                assert torch.equal(got, gemv(act, w, b, config=cfg)), what

    run_checks(list(zip(CHECKS, [check_fp32, check_bf16, check_fp16, check_every_m,
                                 check_out_given, check_strided_x, check_split_workspace,
                                 check_edges, check_default_config, check_silu_mul,
                                 check_silu_mul_vs_unfused, check_silu_mul_bitwise],
                        strict=True)))


if __name__ == "__main__":
    _main()
