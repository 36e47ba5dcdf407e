"""The symmetric-memory all-reduce of `models.parallel` on two GPUs: `tp_all_reduce` with the
fast path on sums random inputs like NCCL and like the float32 sum of every rank's input
(gathered), eagerly and from a CUDA graph replayed with new inputs; with one-shot and with
two-shot; for aligned, offset and strided tensors; and what it does not cover (too large,
float16, odd sizes) still sums right through NCCL."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from benchmarks.allreduce_bench import launch
from models.parallel import init_fast_all_reduce, tp_all_reduce

pytestmark = pytest.mark.timeout(300)
WORLD_SIZE = 2
HIDDEN = 4096
SIGNIFICAND_BITS = {torch.bfloat16: 8, torch.float16: 11, torch.float32: 24}


def _random(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
            seed: int) -> torch.Tensor:
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    return torch.randn(shape, generator=gen, device=device, dtype=torch.float32).to(dtype)


def _assert_sum(got: torch.Tensor, x: torch.Tensor, what: str) -> None:
    """`got` (this rank's result for its input `x`) is every rank's x summed: within one
    rounding to x's dtype of the float32 sum of the gathered inputs, as NCCL's is."""
    parts = [torch.empty_like(x) for _ in range(WORLD_SIZE)]
    dist.all_gather(parts, x.contiguous())
    exact = torch.stack([p.float() for p in parts]).sum(0)
    nccl = x.clone()
    dist.all_reduce(nccl)
    ulp = exact.abs() * 2.0 ** (1 - SIGNIFICAND_BITS[x.dtype]) + 1e-30
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

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        body()  # warm-up outside the graph
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = body()
    for step in range(3):
        inputs = [_random(t.shape, t.dtype, device, seed=1000 * step + 10 * k + rank)
                  for k, t in enumerate((big, small, wide))]
        for static, new in zip((big, small, wide), inputs, strict=True):
            static.copy_(new)
        graph.replay()
        for name, out, x in zip(("b=64", "b=1", "strided"), outs,
                                (inputs[0], inputs[1], inputs[2][:, :HIDDEN]), strict=True):
            _assert_sum(out, x, f"{tag} graph replay {step} {name}")


def _rank(rank: int, world_size: int) -> None:
    device = torch.device("cuda", rank)
    # Default: one-shot for everything up to 8 MiB on two ranks.
    assert init_fast_all_reduce(device), "the fast path did not start (see the warning)"
    _eager_cases(device, rank, "one-shot")
    _graph_case(device, rank, "one-shot")
    # Two-shot for every size: a second buffer and rendezvous in the same processes.
    assert init_fast_all_reduce(device, one_shot_max_bytes=0)
    _eager_cases(device, rank, "two-shot")
    _graph_case(device, rank, "two-shot")
    # A small buffer: the 512 KiB message of the graph goes to NCCL, inside the graph too.
    assert init_fast_all_reduce(device, max_bytes=64 * 1024)
    _graph_case(device, rank, "64 KiB buffer")


def test_fast_all_reduce_sums_like_nccl():
    if torch.cuda.device_count() < WORLD_SIZE:
        pytest.skip(f"needs {WORLD_SIZE} GPUs, found {torch.cuda.device_count()}")
    launch(_rank, WORLD_SIZE)
