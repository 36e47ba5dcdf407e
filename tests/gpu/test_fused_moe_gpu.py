"""The fused MoE Triton path (models/kernels/fused_moe.py) on CUDA at the Qwen3-30B-A3B expert
shape: E 128, top-8, hidden 2048, moe_intermediate 768.

Reference: FusedMoE's torch path in float32 on the same weights (bf16-rounded) and inputs,
given the routing the Triton layer chose (fused_topk, checked against select_experts on its
own: a near-tie may pick another expert, which would swamp the arithmetic being checked).
Errors are relative to the largest |reference| entry.
"""

from __future__ import annotations

import pytest
import torch

from models.kernels.fused_moe import choose_config, fused_topk
from models.layers.fused_moe import FusedMoE, select_experts
from tests.gpu.graphs import capture

DEVICE = torch.device("cuda")
E, TOP_K, HIDDEN, INTER = 128, 8, 2048, 768
RTOL = {torch.bfloat16: 1e-2, torch.float16: 1e-2, torch.float32: 1e-4}


@pytest.fixture(scope="module")
def weights() -> tuple[torch.Tensor, torch.Tensor]:
    """bf16 w13 [E, 2I, H], w2 [E, H, I], scaled like trained projections (unit outputs)."""
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    w13 = torch.randn(E, 2 * INTER, HIDDEN, generator=gen, device=DEVICE) / HIDDEN**0.5
    w2 = torch.randn(E, HIDDEN, INTER, generator=gen, device=DEVICE) / INTER**0.5
    return w13.bfloat16(), w2.bfloat16()


def _layer(weights: tuple[torch.Tensor, torch.Tensor], use_triton: bool, dtype: torch.dtype,
           tp_rank: int = 0, tp_size: int = 1) -> FusedMoE:
    with torch.device(DEVICE):
        layer = FusedMoE(E, TOP_K, HIDDEN, INTER, renormalize=True, use_triton=use_triton,
                         tp_rank=tp_rank, tp_size=tp_size).to(dtype)
    experts = slice(layer.first_expert, layer.first_expert + layer.num_local_experts)
    layer.w13_weight.data.copy_(weights[0][experts])
    layer.w2_weight.data.copy_(weights[1][experts])
    return layer


@pytest.fixture(scope="module")
def reference(weights: tuple[torch.Tensor, torch.Tensor]) -> FusedMoE:
    return _layer(weights, use_triton=False, dtype=torch.float32)


def _inputs(num_tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    x = torch.randn(num_tokens, HIDDEN, generator=gen, device=DEVICE)
    logits = 2 * torch.randn(num_tokens, E, generator=gen, device=DEVICE)
    return x, logits


def _reference(reference: FusedMoE, x: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """The float32 torch experts on fused_topk's routing."""
    weights, ids = fused_topk(logits, TOP_K, renormalize=True)
    return reference._torch_experts(x.float(), weights, ids)


def _assert_close(got: torch.Tensor, ref: torch.Tensor, rtol: float, what: str) -> None:
    assert got.shape == ref.shape, what
    scale = ref.abs().max().item()
    err = (got.float() - ref).abs().max().item()
    assert scale > 0 and err <= rtol * scale, f"{what}: max error {err:.3g}, scale {scale:.3g}"


@pytest.mark.parametrize("num_tokens", [1, 7, 256, 2048, 8192])
def test_bf16_matches_float32_torch_path(weights, reference, num_tokens: int) -> None:
    # 8192: prefill, the largest tiles of the config table.
    layer = _layer(weights, use_triton=True, dtype=torch.bfloat16)
    x, logits = _inputs(num_tokens, seed=num_tokens)
    with torch.no_grad():
        got = layer(x.bfloat16(), logits)
        ref = _reference(reference, x.bfloat16(), logits)
    assert got.dtype == torch.bfloat16
    _assert_close(got, ref, RTOL[torch.bfloat16], f"T={num_tokens}")


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("num_tokens", [5, 300])
def test_other_dtypes(weights, reference, num_tokens: int, dtype: torch.dtype) -> None:
    layer = _layer(weights, use_triton=True, dtype=dtype)
    x, logits = _inputs(num_tokens, seed=num_tokens + 1)
    with torch.no_grad():
        got = layer(x.to(dtype), logits)
        ref = _reference(reference, x.to(dtype), logits)
    assert got.dtype == dtype
    _assert_close(got, ref, RTOL[dtype], f"T={num_tokens} {dtype}")


@pytest.mark.parametrize("tp_size", [2, 4])
def test_tensor_parallel_partials_sum_to_full(weights, reference, tp_size: int) -> None:
    x, logits = _inputs(256, seed=3)
    x = x.bfloat16()
    with torch.no_grad():
        partials = [_layer(weights, True, torch.bfloat16, rank, tp_size)(x, logits).float()
                    for rank in range(tp_size)]
        ref = _reference(reference, x, logits)
        for rank, partial in enumerate(partials):
            ref_rank = _reference(_layer(weights, False, torch.float32, rank, tp_size), x, logits)
            _assert_close(partial, ref_rank, 1e-2, f"rank {rank} of {tp_size}")
    _assert_close(sum(partials), ref, 1e-2, f"sum of {tp_size} ranks")


@pytest.mark.parametrize("num_tokens", [1, 256, 8192])
def test_fused_topk_matches_select_experts(num_tokens: int) -> None:
    _, logits = _inputs(num_tokens, seed=num_tokens + 7)
    for renormalize in (True, False):
        weights, ids = fused_topk(logits, TOP_K, renormalize)
        ref_weights, ref_ids = select_experts(logits, TOP_K, renormalize)
        assert ids.dtype == torch.int32 and weights.dtype == torch.float32
        # Rows may differ only where two probabilities tie within float32 rounding.
        same = (ids.long() == ref_ids).all(1)
        assert same.sum().item() >= num_tokens - max(1, num_tokens // 1000)
        torch.testing.assert_close(weights[same], ref_weights[same], rtol=1e-5, atol=1e-7)


def test_cuda_graph_replay_matches_eager(weights) -> None:
    """Decode runs captured: no host sync, no data-dependent shape. A replay with other
    tokens and another routing gives what an eager call on them gives, bit for bit."""
    layer = _layer(weights, use_triton=True, dtype=torch.bfloat16)
    num_tokens = 8
    x_static, logits_static = (t.clone() for t in _inputs(num_tokens, seed=100))
    x_static = x_static.bfloat16()
    with torch.no_grad():
        graph, out = capture(lambda: layer(x_static, logits_static))
        previous = None
        for seed in (101, 102, 103):
            x, logits = _inputs(num_tokens, seed=seed)
            x = x.bfloat16()
            x_static.copy_(x)
            logits_static.copy_(logits)
            graph.replay()
            torch.cuda.synchronize()
            eager = layer(x, logits)
            assert torch.equal(out, eager), f"seed {seed}: replay differs from eager"
            assert previous is None or not torch.equal(out, previous), "stale output"
            previous = out.clone()


def test_config_table_covers_serving_sizes() -> None:
    """Every batch size gets a config whose M tile fits tl.dot, and bigger batches never get
    smaller M tiles."""
    previous = 0
    for num_tokens in (1, 2, 8, 64, 256, 512, 2048, 8192, 32768):
        config = choose_config(num_tokens, TOP_K, E, torch.bfloat16)
        assert config.block_m >= 16 and config.block_m >= previous
        previous = config.block_m
