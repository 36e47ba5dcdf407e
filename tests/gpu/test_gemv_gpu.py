"""The decode GEMV kernel (models/kernels/gemv.py) on CUDA at the Qwen3 shapes.

Reference: F.linear in float64 on the same inputs (the kernel accumulates in float32; bf16
outputs carry one bf16 rounding).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from benchmarks.gemv_bench import candidates, reference_shapes
from models.kernels.gemv import MAX_M, GemvConfig, gemv, gemv_workspace

DEVICE = torch.device("cuda")
# Max error relative to the largest |reference| entry.
RTOL = {torch.float32: 1e-4, torch.bfloat16: 1e-2}
# Qwen3-0.6B and 8B linears, plus the 8B tensor-parallel shards (N or K over 2 and 4).
SHAPES = [(n, k) for _, n, k in reference_shapes(["0.6b", "8b"], [1, 2, 4])]


def _inputs(m: int, n: int, k: int, dtype: torch.dtype, seed: int, bias: bool = True
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    x = torch.randn(m, k, generator=gen, device=DEVICE).to(dtype)
    w = (torch.randn(n, k, generator=gen, device=DEVICE) / k**0.5).to(dtype)
    b = torch.randn(n, generator=gen, device=DEVICE).to(dtype) if bias else None
    return x, w, b


def _assert_close(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor,
                  b: torch.Tensor | None, what: str) -> None:
    ref = F.linear(x.double(), w.double(), None if b is None else b.double())
    assert got.shape == ref.shape and got.dtype == x.dtype, what
    scale = ref.abs().max().item()
    err = (got.double() - ref).abs().max().item()
    assert err <= RTOL[x.dtype] * scale, f"{what}: max error {err:.3g}, scale {scale:.3g}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_gemv_matches_linear_at_qwen3_shapes(shape: tuple[int, int], dtype: torch.dtype) -> None:
    n, k = shape
    x, w, b = _inputs(MAX_M, n, k, dtype, seed=n + k)
    for m in (1, 2, 8):
        _assert_close(gemv(x[:m], w), x[:m], w, None, f"{n}x{k} M={m}")
    _assert_close(gemv(x[:3], w, b), x[:3], w, b, f"{n}x{k} M=3 bias")


FP32_CONFIGS = [GemvConfig(4, 512), GemvConfig(2, 1024, num_warps=8, split_k=2),
                GemvConfig(32, 64, kind="mma", num_stages=3),
                GemvConfig(16, 128, split_k=4, kind="mma", num_stages=4)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_benchmark_candidates_compile_and_are_right(dtype: torch.dtype) -> None:
    # K=3072 is no multiple of the 2048-wide tiles, and N=1024 splits K in many candidates.
    n, k = 1024, 3072
    num_sms = torch.cuda.get_device_properties(DEVICE).multi_processor_count
    configs = (candidates(n, k, dtype, num_sms, full=False) if dtype == torch.bfloat16
               else FP32_CONFIGS)
    x, w, b = _inputs(MAX_M, n, k, dtype, seed=1)
    ws = gemv_workspace(MAX_M, n, DEVICE)
    for cfg in configs:
        for m in (1, 5):
            got = gemv(x[:m], w, b, config=cfg, workspace=ws)
            _assert_close(got, x[:m], w, b, f"{cfg} M={m}")


@pytest.mark.parametrize("config", [None, GemvConfig(4, 1024, split_k=4),
                                    GemvConfig(32, 128, split_k=4, kind="mma", num_stages=4)],
                         ids=["default", "fma-split", "mma-split"])
def test_cuda_graph_replay_with_new_inputs(config: GemvConfig | None) -> None:
    n, k, m = 4096, 1024, 4
    x, w, b = _inputs(m, n, k, torch.bfloat16, seed=2)
    x_static = x.clone()
    out = torch.empty(m, n, dtype=torch.bfloat16, device=DEVICE)
    ws = gemv_workspace(MAX_M, n, DEVICE)
    gemv(x_static, w, b, out=out, config=config, workspace=ws)  # compile outside capture
    torch.cuda.synchronize()
    before = torch.cuda.memory_stats()["allocation.all.allocated"]
    gemv(x_static, w, b, out=out, config=config, workspace=ws)
    assert torch.cuda.memory_stats()["allocation.all.allocated"] == before, (
        "gemv allocated with out (and workspace) given")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gemv(x_static, w, b, out=out, config=config, workspace=ws)
    # Several replays: a split-K workspace must be zeroed again after each one.
    for seed in (3, 4, 5):
        new_x, _, _ = _inputs(m, 1, k, torch.bfloat16, seed=seed, bias=False)
        x_static.copy_(new_x)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        _assert_close(out, new_x, w, b, f"replay seed={seed}")
