"""The mixture-of-experts layer (models/layers/fused_moe.py) on CPU.

The torch path against transformers' Qwen3MoeSparseMoeBlock (float32, bit for bit), routing,
weight loading and simulated tensor parallelism in one process; then the Triton kernels
(models/kernels/fused_moe.py) under TRITON_INTERPRET=1 against the torch path: the interpreter
must be on before triton is first imported, so those checks run this file as a script in a
fresh subprocess (tests/interpret.py).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from models.layers.fused_moe import FusedMoE, select_experts
from tests.interpret import interpreted_check_test, run_checks

E, K, HIDDEN, INTER = 8, 2, 32, 16


def _hf_block(norm_topk_prob: bool, seed: int = 0):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    config = Qwen3MoeConfig(hidden_size=HIDDEN, moe_intermediate_size=INTER, num_experts=E,
                            num_experts_per_tok=K, norm_topk_prob=norm_topk_prob)
    config._experts_implementation = "eager"  # the reference loop, whatever is installed
    block = Qwen3MoeSparseMoeBlock(config).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in block.parameters():
            param.copy_(torch.randn(param.shape, generator=gen) / param.shape[-1] ** 0.5)
    return block


def _hub_tensors(block) -> dict[str, torch.Tensor]:
    """The block's experts under their hub checkpoint names (per-expert [out, in] tensors)."""
    gate_up, down = block.experts.gate_up_proj.detach(), block.experts.down_proj.detach()
    tensors = {}
    for e in range(E):
        tensors[f"mlp.experts.{e}.gate_proj.weight"] = gate_up[e, :INTER].clone()
        tensors[f"mlp.experts.{e}.up_proj.weight"] = gate_up[e, INTER:].clone()
        tensors[f"mlp.experts.{e}.down_proj.weight"] = down[e].clone()
    return tensors


def _load(layer: FusedMoE, tensors: dict) -> None:
    """What the model's loader does: each hub tensor to its parameter's weight_loader."""
    params = {f"mlp.experts.{name}": p for name, p in layer.named_parameters()}
    for hub_name in tensors:
        param_name, shard_id = FusedMoE.checkpoint_target(hub_name)
        param = params[param_name]
        param.weight_loader(param, tensors[hub_name], shard_id)


def _layer(block, renormalize: bool, tp_rank: int = 0, tp_size: int = 1,
           tensors: dict | None = None) -> FusedMoE:
    layer = FusedMoE(E, K, HIDDEN, INTER, renormalize=renormalize, use_triton=False,
                     tp_rank=tp_rank, tp_size=tp_size)
    _load(layer, _hub_tensors(block) if tensors is None else tensors)
    return layer


def _inputs(block, num_tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(num_tokens, HIDDEN, generator=torch.Generator().manual_seed(seed))
    return x, torch.nn.functional.linear(x, block.gate.weight)


@pytest.mark.parametrize("norm", [True, False], ids=["norm_topk", "no_norm"])
def test_select_experts_matches_router(norm: bool) -> None:
    block = _hf_block(norm)
    x, logits = _inputs(block, 37, seed=1)
    with torch.no_grad():
        ref_logits, ref_weights, ref_ids = block.gate(x)
    weights, ids = select_experts(logits, K, renormalize=norm)
    assert torch.equal(ref_logits, logits)
    assert weights.dtype == torch.float32 and ids.shape == (37, K)
    assert torch.equal(ids, ref_ids) and torch.equal(weights, ref_weights)
    if norm:
        torch.testing.assert_close(weights.sum(-1), torch.ones(37))
    else:
        assert (weights.sum(-1) < 1).all()


@pytest.mark.parametrize("norm", [True, False], ids=["norm_topk", "no_norm"])
def test_torch_path_matches_transformers(norm: bool, tmp_path: Path) -> None:
    block = _hf_block(norm, seed=2)
    # Weights arrive as lazy safetensors slices, as the model loader hands them over.
    save_file(_hub_tensors(block), str(tmp_path / "experts.safetensors"))
    with safe_open(str(tmp_path / "experts.safetensors"), framework="pt") as f:
        layer = _layer(block, norm, tensors={name: f.get_slice(name) for name in f.keys()})  # noqa: SIM118
    for num_tokens in (1, 5, 64):
        x, logits = _inputs(block, num_tokens, seed=num_tokens)
        with torch.no_grad():
            ref = block(x[None])[0]
            got = layer(x, logits)
        assert got.shape == (num_tokens, HIDDEN) and got.dtype == torch.float32
        assert ref.abs().max() > 0.1
        assert torch.equal(got, ref), f"T={num_tokens}: max diff {(got - ref).abs().max()}"


@pytest.mark.parametrize("tp_size", [2, 4])
def test_tensor_parallel_partials_sum_to_full(tp_size: int) -> None:
    block = _hf_block(True, seed=3)
    tensors = _hub_tensors(block)
    full = _layer(block, True)
    x, logits = _inputs(block, 29, seed=4)
    partials = []
    for rank in range(tp_size):
        layer = _layer(block, True, rank, tp_size, tensors)
        per_rank = E // tp_size
        assert layer.w13_weight.shape == (per_rank, 2 * INTER, HIDDEN)
        assert layer.w2_weight.shape == (per_rank, HIDDEN, INTER)
        experts = slice(rank * per_rank, (rank + 1) * per_rank)
        assert torch.equal(layer.w13_weight, full.w13_weight[experts])
        assert torch.equal(layer.w2_weight, full.w2_weight[experts])
        with torch.no_grad():
            partials.append(layer(x, logits))
    with torch.no_grad():
        ref = full(x, logits)
    # Each rank holds part of the answer, and the all-reduce (a sum) gives the whole of it.
    assert all((p - ref).abs().max() > 1e-3 for p in partials)
    torch.testing.assert_close(sum(partials), ref, rtol=1e-6, atol=1e-6)


class _Unreadable:
    """A checkpoint slice that fails the test if read (or even measured)."""

    def __getattr__(self, name: str):
        raise AssertionError(f"a non-local expert's tensor was accessed ({name})")

    def __getitem__(self, index):
        raise AssertionError("a non-local expert's tensor was read")


def test_loader_skips_other_ranks_experts_without_reading() -> None:
    layer = FusedMoE(E, K, HIDDEN, INTER, True, False, tp_rank=1, tp_size=2)
    layer.w13_weight.data.fill_(7.0)
    for e in range(4):  # rank 1 holds experts 4..7
        for kind, param in (("gate", layer.w13_weight), ("up", layer.w13_weight),
                            ("down", layer.w2_weight)):
            layer.weight_loader(param, _Unreadable(), (e, kind))
    assert (layer.w13_weight == 7.0).all()
    gate = torch.randn(INTER, HIDDEN)
    layer.weight_loader(layer.w13_weight, gate, (5, "gate"))
    assert torch.equal(layer.w13_weight[1, :INTER], gate)
    assert (layer.w13_weight[1, INTER:] == 7.0).all()


def test_bad_expert_sharding_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match=r"num_experts \(6\).*tensor_parallel_size \(4\)"):
        FusedMoE(6, 2, HIDDEN, INTER, True, False, tp_rank=0, tp_size=4)
    with pytest.raises(ValueError, match="top_k"):
        FusedMoE(8, 9, HIDDEN, INTER, True, False, tp_rank=0, tp_size=1)


def test_loader_rejects_bad_shards() -> None:
    layer = FusedMoE(E, K, HIDDEN, INTER, True, False, tp_rank=0, tp_size=1)
    with pytest.raises(ValueError, match=r"expert 0 gate_proj.*\[16, 32\]"):
        layer.weight_loader(layer.w13_weight, torch.zeros(INTER + 1, HIDDEN), (0, "gate"))
    with pytest.raises(ValueError, match="shard_id"):
        layer.weight_loader(layer.w13_weight, torch.zeros(INTER, HIDDEN), (0, "gate_up"))
    with pytest.raises(ValueError, match="w2_weight"):
        layer.weight_loader(layer.w13_weight, torch.zeros(HIDDEN, INTER), (0, "down"))
    with pytest.raises(ValueError, match="out of range"):
        layer.weight_loader(layer.w13_weight, torch.zeros(INTER, HIDDEN), (E, "up"))


def test_checkpoint_mapping_names_every_projection() -> None:
    hub_names = [f"mlp.experts.{e}.{proj}.weight" for e in range(E)
                 for proj in ("gate_proj", "up_proj", "down_proj")]
    mapping = {name: FusedMoE.checkpoint_target(name) for name in hub_names}
    assert len(set(mapping.values())) == 3 * E
    assert FusedMoE.checkpoint_target("mlp.gate.weight") is None
    assert mapping["mlp.experts.3.gate_proj.weight"] == ("mlp.experts.w13_weight", (3, "gate"))
    assert mapping["mlp.experts.7.up_proj.weight"] == ("mlp.experts.w13_weight", (7, "up"))
    assert mapping["mlp.experts.0.down_proj.weight"] == ("mlp.experts.w2_weight", (0, "down"))
    layer = FusedMoE(E, K, HIDDEN, INTER, True, False, tp_rank=0, tp_size=1)
    names = {f"mlp.experts.{n}" for n, _ in layer.named_parameters()}
    assert {param for param, _ in mapping.values()} == names


# ------------------------------------------------------------ Triton kernels, interpreted

CHECKS = ["topk", "align", "align_tp", "fp32_vs_torch", "fp32_empty_experts",
          "fp32_tp_partials", "16bit_vs_torch", "layer", "no_tokens"]

test_triton_interpreted = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="triton is not installed")(
    interpreted_check_test(__file__, CHECKS))


def _moe_case(num_tokens: int, seed: int, tp_rank: int = 0, tp_size: int = 1,
              banned: tuple[int, ...] = ()) -> tuple[FusedMoE, torch.Tensor, torch.Tensor]:
    """A torch-path layer with random weights (the same for every rank of a seed), tokens and
    router logits; experts in `banned` are never chosen."""
    gen = torch.Generator().manual_seed(seed)
    w13 = torch.randn(E, 2 * INTER, HIDDEN, generator=gen) / HIDDEN**0.5
    w2 = torch.randn(E, HIDDEN, INTER, generator=gen) / INTER**0.5
    x = torch.randn(num_tokens, HIDDEN, generator=gen)
    logits = torch.randn(num_tokens, E, generator=gen)
    logits[:, list(banned)] = float("-inf")
    layer = FusedMoE(E, K, HIDDEN, INTER, True, False, tp_rank=tp_rank, tp_size=tp_size)
    experts = slice(layer.first_expert, layer.first_expert + layer.num_local_experts)
    layer.w13_weight.data.copy_(w13[experts])
    layer.w2_weight.data.copy_(w2[experts])
    return layer, x, logits


def _kernel_out(layer: FusedMoE, x: torch.Tensor, logits: torch.Tensor, config=None):
    from models.kernels.fused_moe import fused_moe

    weights, ids = select_experts(logits, K, renormalize=True)
    return fused_moe(x, layer.w13_weight.to(x.dtype), layer.w2_weight.to(x.dtype), weights, ids,
                     first_expert=layer.first_expert, config=config)


def _tiny_config(block_m: int = 16):
    from models.kernels.fused_moe import GemmTile, MoeConfig

    # hidden 32 / intermediate 16: one or two 16-wide tiles along N and K.
    return MoeConfig(block_m, GemmTile(16, 16, 4, 1), GemmTile(16, 32, 4, 1), group_m=2)


def _check_align(first_expert: int, num_local: int) -> None:
    from models.kernels.fused_moe import max_sorted_slots, moe_align

    # max_chunk 16: several chunks of slots (a counting launch, then one program each).
    cases = [(1, 16, 1024), (5, 16, 1024), (19, 16, 1024), (40, 32, 1024), (19, 16, 16),
             (40, 16, 16), (300, 32, 16)]
    for num_tokens, block_m, max_chunk in cases:
        ids = torch.stack([torch.randperm(E)[:K] for _ in range(num_tokens)])
        ids = ids.to(torch.int32) if first_expert else ids  # the kernels take either
        num_slots = num_tokens * K
        sorted_slots, block_experts = moe_align(ids, first_expert, num_local, block_m,
                                                max_chunk)
        assert sorted_slots.numel() == max_sorted_slots(num_tokens, K, num_local, block_m)
        assert block_experts.numel() * block_m == sorted_slots.numel()
        flat = ids.flatten() - first_expert
        local = (flat >= 0) & (flat < num_local)
        used = int((block_experts >= 0).sum())
        assert (block_experts[:used] >= 0).all() and (block_experts[used:] == -1).all()
        blocks = sorted_slots[:used * block_m].view(used, block_m)
        seen = []
        for b in range(used):
            expert = int(block_experts[b])
            if b > 0:
                assert expert >= int(block_experts[b - 1]), "blocks not sorted by expert"
            real = blocks[b][blocks[b] < num_slots]
            assert (blocks[b][len(real):] == num_slots).all(), "padding inside a block"
            assert (real.diff() > 0).all(), "an expert's slots out of slot order"
            assert (flat[real.long()] == expert).all(), "slot in another expert's block"
            seen += real.tolist()
        assert sorted(seen) == local.nonzero().flatten().tolist(), "slot lost or repeated"
        counts = torch.bincount(flat[local], minlength=num_local)
        assert used == int(((counts + block_m - 1) // block_m).sum()), "a block too many"


def _check_vs_torch(num_tokens: int, seed: int, tol: float, dtype=torch.float32,
                    banned: tuple[int, ...] = (), config=None) -> None:
    layer, x, logits = _moe_case(num_tokens, seed, banned=banned)
    with torch.no_grad():
        ref = layer(x, logits)
        got = _kernel_out(layer, x.to(dtype), logits, config or _tiny_config())
    assert got.shape == ref.shape and got.dtype == dtype
    err = (got.float() - ref).abs().max().item()
    scale = ref.abs().max().item()
    assert scale > 0.1 and err <= tol * scale, f"T={num_tokens}: error {err:.3g}, scale {scale:.3g}"


def check_fp32_vs_torch() -> None:
    for num_tokens in (1, 5, 19):
        _check_vs_torch(num_tokens, seed=num_tokens, tol=1e-5)
    # Uneven K tiles (hidden 32 in steps of 64 is one masked step) and 32-row blocks.
    from models.kernels.fused_moe import GemmTile, MoeConfig

    _check_vs_torch(19, seed=7, tol=1e-5,
                    config=MoeConfig(32, GemmTile(16, 64, 4, 1), GemmTile(32, 16, 4, 1)))
    # Alignment in several chunks of 16 slots.
    import models.kernels.fused_moe as kernels

    saved, kernels._ALIGN_CHUNK = kernels._ALIGN_CHUNK, 16
    try:
        _check_vs_torch(19, seed=8, tol=1e-5)
    finally:
        kernels._ALIGN_CHUNK = saved


def check_fp32_empty_experts() -> None:
    # Experts 0, 3 and 6 get no token at all; with T = 1 five more stay empty too.
    for num_tokens in (1, 19):
        _check_vs_torch(num_tokens, seed=11, tol=1e-5, banned=(0, 3, 6))


def check_fp32_tp_partials() -> None:
    full, x, logits = _moe_case(19, seed=5)
    with torch.no_grad():
        ref = full(x, logits)
        partials = []
        for rank in range(2):
            layer, _, _ = _moe_case(19, seed=5, tp_rank=rank, tp_size=2)
            partials.append(_kernel_out(layer, x, logits, _tiny_config()))
            torch.testing.assert_close(partials[-1], layer(x, logits), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(partials[0] + partials[1], ref, rtol=1e-5, atol=1e-5)


def _dot_bf16_like_the_gpu() -> None:
    """Script side: Triton 3.x's interpreter multiplies bfloat16 dot operands as their raw
    16-bit patterns (numpy has no bfloat16). Widen them to float32 first, which is what the
    tensor cores do (exact products, float32 accumulation)."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    original = builder.create_dot

    def widen(x):
        if x.dtype.scalar != tl.bfloat16:
            return x
        bits = np.asarray(x.data).view(np.uint16).astype(np.uint32) << 16
        return interpreter.TensorHandle(bits.view(np.float32), tl.float32)

    def create_dot(self, a, b, d, *args):
        return original(self, widen(a), widen(b), d, *args)

    builder.create_dot = create_dot


def check_16bit_vs_torch() -> None:
    from tests.interpret import round_bf16_like_the_gpu

    round_bf16_like_the_gpu()
    _dot_bf16_like_the_gpu()
    for dtype in (torch.bfloat16, torch.float16):
        for num_tokens in (1, 19):
            _check_vs_torch(num_tokens, seed=num_tokens + 100, tol=2e-2, dtype=dtype)


def check_topk() -> None:
    from models.kernels.fused_moe import fused_topk

    gen = torch.Generator().manual_seed(0)
    for num_experts, top_k in ((8, 2), (60, 4), (128, 8)):
        for num_tokens in (1, 5, 37):
            logits = 2 * torch.randn(num_tokens, num_experts, generator=gen)
            for renormalize in (True, False):
                weights, ids = fused_topk(logits, top_k, renormalize)
                ref_weights, ref_ids = select_experts(logits, top_k, renormalize)
                assert ids.dtype == torch.int32 and weights.dtype == torch.float32
                assert torch.equal(ids.long(), ref_ids), (num_experts, num_tokens)
                torch.testing.assert_close(weights, ref_weights, rtol=1e-6, atol=1e-7)
    # All equal: k distinct experts, the lowest ids, equal weights.
    weights, ids = fused_topk(torch.zeros(3, 8), 2, renormalize=False)
    assert ids.tolist() == [[0, 1]] * 3
    torch.testing.assert_close(weights, torch.full((3, 2), 1 / 8))


def check_layer() -> None:
    """FusedMoE(use_triton=True) end to end (routing kernel included) against the torch
    layer on the same weights."""
    for num_tokens in (1, 19):
        ref_layer, x, logits = _moe_case(num_tokens, seed=num_tokens + 200)
        layer = FusedMoE(E, K, HIDDEN, INTER, True, use_triton=True, tp_rank=0, tp_size=1)
        layer.load_state_dict(ref_layer.state_dict())
        with torch.no_grad():
            torch.testing.assert_close(layer(x, logits), ref_layer(x, logits),
                                       rtol=1e-5, atol=1e-5)


def check_no_tokens() -> None:
    layer, x, logits = _moe_case(0, seed=0)
    assert _kernel_out(layer, x, logits).shape == (0, HIDDEN)
    assert layer(x, logits).shape == (0, HIDDEN)


if __name__ == "__main__":
    torch.manual_seed(0)
    run_checks([
        ("topk", check_topk),
        ("align", lambda: _check_align(0, E)),
        ("align_tp", lambda: _check_align(4, 4)),
        ("fp32_vs_torch", check_fp32_vs_torch),
        ("fp32_empty_experts", check_fp32_empty_experts),
        ("fp32_tp_partials", check_fp32_tp_partials),
        ("16bit_vs_torch", check_16bit_vs_torch),
        ("layer", check_layer),
        ("no_tokens", check_no_tokens),
    ])
