"""The fused q_norm/k_norm/rotary/store_kv kernel on CUDA, at Qwen3-0.6B's attention layout.

Reference: the unfused torch path (rms_norm, apply_rotary, TorchAttentionBackend.store_kv) on
the same device and inputs, as in tests/test_qk_norm_rope_kernel.py (whose helpers this
reuses). Caches and a guard slot on either side start as NaN.
"""

from __future__ import annotations

import pytest
import torch

from tests.gpu.graphs import capture
from tests.test_qk_norm_rope_kernel import (
    TOL,
    Case,
    assert_close,
    check_case,
    clone_inputs,
    make_inputs,
    reference,
    run_kernel,
)

DEVICE = "cuda"
HEADS, KV_HEADS, HEAD_DIM = 16, 8, 128  # Qwen3-0.6B


@pytest.mark.parametrize("num_tokens", [1, 7, 256])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_matches_torch_reference(dtype: torch.dtype, num_tokens: int) -> None:
    gen = torch.Generator().manual_seed(num_tokens)
    check_case(Case(dtype, num_tokens, HEADS, KV_HEADS, HEAD_DIM), gen, DEVICE)
    check_case(Case(dtype, num_tokens, HEADS, KV_HEADS, HEAD_DIM, block_size=1, strided=True),
               gen, DEVICE)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_cuda_graph_replay_with_new_inputs(dtype: torch.dtype) -> None:
    """Captured once on static buffers; each replay after copying new qkv, positions and
    slots into them gives the reference result on those new inputs."""
    gen = torch.Generator().manual_seed(99)
    case = Case(dtype, 8, HEADS, KV_HEADS, HEAD_DIM)
    static = make_inputs(case, gen, DEVICE)
    out = torch.empty(case.num_tokens, HEADS, HEAD_DIM, dtype=dtype, device=DEVICE)
    graph, _ = capture(lambda: run_kernel(case, static, out=out))
    for _ in range(3):
        new = make_inputs(case, gen, DEVICE)
        static.qkv.copy_(new.qkv)
        static.positions.copy_(new.positions)
        static.slot_mapping.copy_(new.slot_mapping)
        static.storage.fill_(float("nan"))
        out.fill_(float("nan"))
        ref = clone_inputs(static)
        want_q = reference(case, ref)
        graph.replay()
        torch.cuda.synchronize()
        assert_close(out, want_q, TOL[dtype], "replayed q")
        assert_close(static.storage, ref.storage, TOL[dtype], "replayed cache")
