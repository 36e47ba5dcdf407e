"""The symmetric-memory all-reduce of `models.parallel` on two and on four GPUs:
`tp_all_reduce` with the fast path on sums random inputs like NCCL and like the float32 sum
of every rank's input (gathered), eagerly and from a CUDA graph replayed with new inputs;
with one-shot and with two-shot; for aligned, offset and strided tensors; the logits
all-gather built on it equals NCCL's bit for bit; and what it does
not cover (too large, float16, odd sizes) still sums right through NCCL. The
cross-rank argmax (`tp_argmax`) answers as a plain-Python reference over every rank's
candidates, and vocab-parallel sampling (race_partials on each rank's shard, then
tp_argmax) draws what race_argmax draws on the full row."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from models.kernels.sample import race_argmax, race_partials
from models.parallel import (
    init_fast_all_reduce,
    tp_all_gather_last_dim,
    tp_all_reduce,
    tp_argmax,
)
from tests.gpu.graphs import capture
from tests.ranks import launch
from tests.test_tp_argmax import SPECIAL_ROWS, candidates, expected

pytestmark = pytest.mark.timeout(300)
HIDDEN = 4096
SIGNIFICAND_BITS = {torch.bfloat16: 8, torch.float16: 11, torch.float32: 24}


def _random(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
            seed: int) -> torch.Tensor:
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    return torch.randn(shape, generator=gen, device=device, dtype=torch.float32).to(dtype)


def _assert_sum(got: torch.Tensor, x: torch.Tensor, what: str) -> None:
    """`got` (this rank's result for its input `x`) is every rank's x summed, as NCCL's is:
    on two ranks within one rounding to x's dtype of the float32 sum of the gathered inputs;
    on more, within the bound of a sum rounded after each of its W - 1 adds (in any order),
    (W - 1) ulps of the sum of magnitudes."""
    world = dist.get_world_size()
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x.contiguous())
    stacked = torch.stack([p.float() for p in parts])
    exact = stacked.sum(0)
    nccl = x.clone()
    dist.all_reduce(nccl)
    scale = exact.abs() if world == 2 else (world - 1) * stacked.abs().sum(0)
    ulp = scale * 2.0 ** (1 - SIGNIFICAND_BITS[x.dtype]) + 1e-30
    assert got.shape == x.shape and got.dtype == x.dtype, what
    assert torch.all((nccl.float() - exact).abs() <= ulp), f"{what}: the NCCL reference"
    err = (got.float() - exact).abs()
    assert torch.all(err <= ulp), f"{what}: off by up to {err.max().item()}"
    assert torch.all((got.float() - nccl.float()).abs() <= 2 * ulp), f"{what}: vs NCCL"


def _eager_cases(device: torch.device, rank: int, tag: str) -> None:
    shapes = {  # name: (shape, dtype)
        "decode b=1": ((1, HIDDEN), torch.bfloat16),
        "decode b=8": ((8, HIDDEN), torch.bfloat16),
        "decode b=512": ((512, HIDDEN), torch.bfloat16),
        "whole buffer": ((1024, HIDDEN), torch.bfloat16),  # 8 MiB
        "float32": ((3, HIDDEN), torch.float32),
        "over the buffer (NCCL)": ((1025, HIDDEN), torch.bfloat16),
        "float16 (NCCL)": ((8, HIDDEN), torch.float16),
        "odd size (NCCL)": ((3, 1001), torch.bfloat16),
    }
    for i, (name, (shape, dtype)) in enumerate(shapes.items()):
        x = _random(shape, dtype, device, seed=100 * i + rank)
        got = x.clone()
        assert tp_all_reduce(got) is got
        _assert_sum(got, x, f"{tag} {name}")
    # Views the one-kernel path cannot take: 2 bytes into their storage, and strided.
    base = _random((HIDDEN + 1,), torch.bfloat16, device, seed=7 + rank)
    x = base[1:].clone()
    got = base.clone()[1:]
    tp_all_reduce(got)
    _assert_sum(got, x, f"{tag} offset view")
    wide = _random((8, 2 * HIDDEN), torch.bfloat16, device, seed=9 + rank)
    got = wide.clone()[:, :HIDDEN]
    tp_all_reduce(got)
    _assert_sum(got, wide[:, :HIDDEN], f"{tag} strided view")


def _graph_case(device: torch.device, rank: int, tag: str) -> None:
    """A graph of back-to-back all-reduces of several sizes (as a decode step's), replayed
    with new inputs copied into its static input buffers."""
    big = torch.zeros(64, HIDDEN, dtype=torch.bfloat16, device=device)
    small = torch.zeros(1, HIDDEN, dtype=torch.bfloat16, device=device)
    wide = torch.zeros(8, 2 * HIDDEN, dtype=torch.bfloat16, device=device)

    def body() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        out_big = tp_all_reduce(big * 1)
        out_small = tp_all_reduce(small * 1)
        out_strided = tp_all_reduce((wide * 1)[:, :HIDDEN])
        return out_big, out_small, out_strided

    graph, outs = capture(body)
    for step in range(3):
        inputs = [_random(t.shape, t.dtype, device, seed=1000 * step + 10 * k + rank)
                  for k, t in enumerate((big, small, wide))]
        for static, new in zip((big, small, wide), inputs, strict=True):
            static.copy_(new)
        graph.replay()
        for name, out, x in zip(("b=64", "b=1", "strided"), outs,
                                (inputs[0], inputs[1], inputs[2][:, :HIDDEN]), strict=True):
            _assert_sum(out, x, f"{tag} graph replay {step} {name}")


def _gather_cases(device: torch.device, rank: int, tag: str) -> None:
    """tp_all_gather_last_dim equals NCCL's all-gather bit for bit: through the fast path
    (a sum of zero-padded copies) where it fits, through NCCL where it does not."""
    world = dist.get_world_size()
    cases = {  # name: (shape of this rank's part, dtype)
        "logits b=1 (Qwen3 vocab)": ((1, 151936 // world), torch.bfloat16),
        "logits b=3 float32": ((3, 4096), torch.float32),
        "over the buffer (NCCL)": ((64, 65536), torch.bfloat16),
        "float16 (NCCL)": ((2, 1024), torch.float16),
    }
    for i, (name, (shape, dtype)) in enumerate(cases.items()):
        x = _random(shape, dtype, device, seed=700 + 10 * i + rank)
        # inf and -inf come through the sum as they are; -0.0 may come back +0.0, which
        # torch.equal (like every comparison) takes as equal.
        x[0, :3] = torch.tensor([float("inf"), float("-inf"), -0.0])
        parts = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(parts, x)
        got = tp_all_gather_last_dim(x)
        want = torch.cat(parts, dim=-1)
        assert got.shape == want.shape and got.dtype == dtype, f"{tag} {name}"
        assert torch.equal(got, want), f"{tag} {name}: differs from NCCL's all-gather"


def _argmax_cases(device: torch.device, rank: int) -> None:
    """tp_argmax over NCCL against a plain-Python reference over every rank's candidates
    (tests/test_tp_argmax.py builds them: ties within and across ranks, -inf and NaN rows,
    NO_INDEX), several calls in a row; and vocab-parallel sampling end to end."""
    world = dist.get_world_size()
    calls = [(SPECIAL_ROWS + 3, 38), (1, 38), (3, 1), (2, 256), (64, 7)]
    for seed, (num_rows, num_candidates) in enumerate(calls):
        values, indices = (t.to(device) for t in candidates(rank, world, num_rows,
                                                             num_candidates, seed))
        want = expected(world, num_rows, num_candidates, seed)
        assert tp_argmax(values, indices).tolist() == want, f"call {seed}"

    # Vocab-parallel sampling: every rank races its shard of the same logits and the
    # exchange gives race_argmax of the full row, on every rank.
    vocab = 151936
    shard = vocab // world
    gen = torch.Generator(device=device).manual_seed(31)
    logits = (torch.randn(3, vocab, generator=gen, device=device) * 4).to(torch.bfloat16)
    temps = torch.tensor([0.0, 0.7, 1.0], device=device)
    seeds = torch.tensor([5, -6, 2**40], device=device)
    steps = torch.tensor([0, 17, 3], device=device)
    part_val, part_idx = race_partials(logits[:, rank * shard:(rank + 1) * shard], temps, seeds,
                                       steps, vocab_offset=rank * shard)
    got = tp_argmax(part_val, part_idx)
    assert torch.equal(got, race_argmax(logits, temps, seeds, steps)), "vocab-parallel draw"


def _rank(rank: int, world_size: int) -> None:
    device = torch.device("cuda", rank)
    # Default: one-shot for everything up to 8 MiB on two ranks (512 KiB on four).
    assert init_fast_all_reduce(device), "the fast path did not start (see the warning)"
    _argmax_cases(device, rank)
    _gather_cases(device, rank, "one-shot")
    _eager_cases(device, rank, "one-shot")
    _graph_case(device, rank, "one-shot")
    # Two-shot for every size: a second buffer and rendezvous in the same processes.
    assert init_fast_all_reduce(device, one_shot_max_bytes=0)
    _gather_cases(device, rank, "two-shot")
    _eager_cases(device, rank, "two-shot")
    _graph_case(device, rank, "two-shot")
    # A small buffer: the 512 KiB message of the graph goes to NCCL, inside the graph too.
    assert init_fast_all_reduce(device, max_bytes=64 * 1024)
    _graph_case(device, rank, "64 KiB buffer")


@pytest.mark.parametrize("world_size", [2, 4])
def test_fast_all_reduce_sums_like_nccl(world_size: int):
    if torch.cuda.device_count() < world_size:
        pytest.skip(f"needs {world_size} GPUs, found {torch.cuda.device_count()}")
    launch(_rank, world_size)
