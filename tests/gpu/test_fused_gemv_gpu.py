"""The fused [add +] RMSNorm -> GEMV [-> SiLU-and-mul] kernel (models/kernels/fused_gemv.py) on
CUDA at the Qwen3 decode shapes.

Reference: the unfused torch path on the same inputs: layernorm.rms_norm / add_rms_norm on the
GPU, then the linear in float64 rounded once to the dtype (what a float32-accumulating GEMV
gives, without cuBLAS's reduced-precision reductions), then SiLU-and-mul in float32 rounded
once (as torch.compile runs silu_and_mul). fp32 within 1e-5; bf16 within 1e-2 of the scale and
bit for bit on all but a few outputs (sums in another order flip a rounding now and then).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from benchmarks.gemv_bench import fused_candidates
from models.kernels.fused_gemv import FusedGemvConfig, fused_gemv, fused_gemv_supported
from models.layers.layernorm import add_rms_norm, rms_norm
from tests.test_fused_gemv_kernel import assert_matches

DEVICE = torch.device("cuda")
EPS = 1e-6

# (label, N weight rows, K, norm, residual, silu_mul): Qwen3-0.6B and 8B at TP=1 (add + norm
# folded in, and the first layer's norm without a residual), and the 8B gate_up shards at
# TP=2 and 4 (SiLU only: there the norm is fused into the all-reduce).
CASES = [
    ("0.6b-qkv", 4096, 1024, True, True, False),
    ("0.6b-qkv-first", 4096, 1024, True, False, False),
    ("0.6b-gate_up", 6144, 1024, True, True, True),
    ("8b-qkv", 6144, 4096, True, True, False),
    ("8b-qkv-first", 6144, 4096, True, False, False),
    ("8b-gate_up", 24576, 4096, True, True, True),
    ("8b-gate_up-tp2", 12288, 4096, False, False, True),
    ("8b-gate_up-tp4", 6144, 4096, False, False, True),
]
CONFIGS = [None, FusedGemvConfig(2, 1024), FusedGemvConfig(4, 2048, num_warps=8),
           FusedGemvConfig(1, 512)]


def _inputs(n: int, k: int, norm: bool, residual: bool, dtype: torch.dtype, seed: int
            ) -> dict[str, torch.Tensor | None]:
    gen = torch.Generator(device=DEVICE).manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=DEVICE)

    return dict(
        x=randn(1, k).to(dtype),
        weight=(randn(n, k) / k**0.5).to(dtype),
        norm_weight=(1 + 0.5 * randn(k)).to(dtype) if norm else None,
        residual=randn(1, k).to(dtype) if residual else None,
    )


def _reference(x: torch.Tensor, weight: torch.Tensor, norm_weight: torch.Tensor | None,
               residual: torch.Tensor | None, silu: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, new residual) of the unfused path."""
    h, new_residual = x, x
    if residual is not None:
        h, new_residual = add_rms_norm(x, residual, norm_weight, EPS)
    elif norm_weight is not None:
        h = rms_norm(x, norm_weight, EPS)
    y = F.linear(h.double(), weight.double()).to(x.dtype)
    if silu:
        gate, up = y.chunk(2, dim=-1)
        y = (F.silu(gate.float()) * up.float()).to(x.dtype)
    return y, new_residual


def _check(inp: dict, silu: bool, config: FusedGemvConfig | None, what: str) -> None:
    x, residual = inp["x"], inp["residual"]
    x_before = x.clone()
    residual_before = residual.clone() if residual is not None else None
    want, want_residual = _reference(**inp, silu=silu)
    got, new_residual = fused_gemv(**inp, eps=EPS, silu_mul=silu, config=config)
    assert_matches(got, want, what)
    assert torch.equal(x, x_before), f"{what}: x was written"
    if residual is None:
        assert new_residual is x, f"{what}: without a residual, x is the new residual"
    else:
        assert torch.equal(residual, residual_before), f"{what}: residual was written"
        assert torch.equal(new_residual, want_residual), f"{what}: new residual is not x + r"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c[0])
def test_fused_gemv_matches_unfused_path(case: tuple, dtype: torch.dtype) -> None:
    label, n, k, norm, residual, silu = case
    inp = _inputs(n, k, norm, residual, dtype, seed=n + k)
    assert fused_gemv_supported(inp["x"], inp["weight"], norm_weight=inp["norm_weight"],
                                residual=inp["residual"], silu_mul=silu)
    for config in CONFIGS:
        _check(inp, silu, config, f"{label} {dtype} {config}")


@pytest.mark.parametrize("case", [CASES[2], CASES[5]], ids=lambda c: c[0])
def test_benchmark_candidates_compile_and_are_right(case: tuple) -> None:
    label, n, k, norm, residual, silu = case
    inp = _inputs(n, k, norm, residual, torch.bfloat16, seed=1)
    for config in fused_candidates(k, torch.bfloat16):
        _check(inp, silu, config, f"{label} {config}")


@pytest.mark.parametrize("case", [CASES[2], CASES[7]], ids=lambda c: c[0])
def test_cuda_graph_replay_with_new_inputs(case: tuple) -> None:
    label, n, k, norm, residual, silu = case
    dtype = torch.bfloat16
    static = _inputs(n, k, norm, residual, dtype, seed=2)
    out = torch.empty(1, n // 2 if silu else n, dtype=dtype, device=DEVICE)
    residual_out = torch.empty(1, k, dtype=dtype, device=DEVICE) if residual else None

    def call() -> tuple[torch.Tensor, torch.Tensor]:
        return fused_gemv(**static, eps=EPS, silu_mul=silu, out=out, residual_out=residual_out)

    call()  # compile outside the capture
    torch.cuda.synchronize()
    before = torch.cuda.memory_stats()["allocation.all.allocated"]
    got, new_residual = call()
    assert got is out
    assert new_residual is (residual_out if residual else static["x"])
    assert torch.cuda.memory_stats()["allocation.all.allocated"] == before, (
        "fused_gemv allocated with out and residual_out given")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    for seed in (3, 4, 5):
        new = _inputs(n, k, norm, residual, dtype, seed=seed)
        for name in ("x", "residual"):  # the weights stay; the activations change per step
            if static[name] is not None:
                static[name].copy_(new[name])
        out.fill_(float("nan"))
        if residual_out is not None:
            residual_out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        want, want_residual = _reference(**static, silu=silu)
        assert_matches(out, want, f"{label} replay seed={seed}")
        if residual_out is not None:
            assert torch.equal(residual_out, want_residual), f"{label} replay residual"
