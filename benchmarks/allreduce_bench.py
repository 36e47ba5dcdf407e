"""All-reduce micro-benchmark: NCCL against the symmetric-memory fast path of
`models.parallel` on one host's GPUs.

    python -m benchmarks.allreduce_bench --world-size 2 [--hidden 4096] [--batch-sizes 1,8]

One process per GPU. For each [B, hidden] bf16 message (the all-reduce of one decode step's
row-parallel layer): the per-call latency of NCCL `all_reduce` and of `tp_all_reduce` with
the fast path on, eagerly and replayed from a CUDA graph of 32 back-to-back calls (replay
time / 32), medians of several runs; the graph latency with one-shot and with two-shot
forced (to place the cut-off between them); a layer's epilogue (all-reduce, then add +
RMSNorm) against the fused all-reduce + add + RMSNorm kernel; and the largest
|fast - NCCL| on random inputs, eagerly and from a graph replayed with new inputs. Rank 0
prints the table last.
"""

from __future__ import annotations

import argparse
import socket
import statistics
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from models.parallel import (
    DEFAULT_FAST_ALL_REDUCE_BYTES,
    NCCL,
    choose_algorithm,
    close_fast_all_reduce,
    default_one_shot_max_bytes,
    disable_nvlink_multicast,
    init_fast_all_reduce,
    tp_all_reduce,
    tp_all_reduce_add_rms_norm,
)

GRAPH_CALLS = 32  # all-reduces per graph: 2 per layer of a decode step, as in the engine
EAGER_CALLS = 20  # per timed run
BATCH_SIZES = (1, 8, 32, 128, 256, 512)


# ------------------------------------------------------------------ processes


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(fn: Callable[..., Any], world_size: int, *args: Any, backend: str = "nccl") -> Any:
    """Run `fn(rank, world_size, *args)` in `world_size` spawned processes that joined one
    default process group (NCCL with rank i on GPU i, or gloo); returns rank 0's result.
    Raises when any rank fails (the others are then killed)."""
    disable_nvlink_multicast()  # the ranks inherit it, before NCCL starts
    results = mp.get_context("spawn").SimpleQueue()
    mp.spawn(_rank_main, args=(fn, world_size, _free_port(), backend, results, args),
             nprocs=world_size, join=True)
    return None if results.empty() else results.get()


def _rank_main(rank: int, fn: Callable[..., Any], world_size: int, port: int, backend: str,
               results: Any, args: tuple) -> None:
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size)
    result = fn(rank, world_size, *args)
    # Only on success: after a failure a peer may sit in a collective that a destroy would
    # wait for; the process exits instead and spawn kills the others.
    close_fast_all_reduce()
    dist.destroy_process_group()
    if rank == 0:
        results.put(result)


# ------------------------------------------------------------------ timing


def _median_us(run: Callable[[], None], calls: int, reps: int) -> float:
    """Median over `reps` runs of the GPU time of `run()` divided by `calls`."""
    times = []
    for _ in range(reps):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(times)


def _eager_us(reduce: Callable[[torch.Tensor], Any], x: torch.Tensor, reps: int) -> float:
    def run() -> None:
        for _ in range(EAGER_CALLS):
            reduce(x)

    run()  # warm-up
    return _median_us(run, EAGER_CALLS, reps)


def _capture(reduce: Callable[[torch.Tensor], Any], x: torch.Tensor,
             calls: int) -> torch.cuda.CUDAGraph:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        reduce(x)  # warm-up outside the graph
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            reduce(x)
    return graph


def _graph_us(reduce: Callable[[torch.Tensor], Any], x: torch.Tensor, reps: int) -> float:
    graph = _capture(reduce, x, GRAPH_CALLS)
    graph.replay()  # warm-up
    return _median_us(graph.replay, GRAPH_CALLS, reps)


def _max_diffs(shape: tuple[int, int], device: torch.device, rank: int) -> tuple[float, float]:
    """Largest |fast - NCCL| on random inputs: eager, and from a graph replayed with them."""
    gen = torch.Generator(device=device)
    gen.manual_seed(1000 + rank)
    x = torch.randn(shape, generator=gen, device=device, dtype=torch.bfloat16)
    ref = x.clone()
    dist.all_reduce(ref)
    eager = tp_all_reduce(x.clone())
    static = torch.zeros_like(x)
    graph = _capture(tp_all_reduce, static, 1)
    static.copy_(x)
    graph.replay()
    return ((eager.float() - ref.float()).abs().max().item(),
            (static.float() - ref.float()).abs().max().item())


# ------------------------------------------------------------------ the benchmark


def _bench_rank(rank: int, world_size: int, hidden: int, batch_sizes: list[int],
                reps: int) -> bool:
    device = torch.device("cuda", rank)
    dist.all_reduce(torch.zeros(1, device=device))  # NCCL's communicator, before any timing
    if not init_fast_all_reduce(device):
        if rank == 0:
            print("the symmetric-memory all-reduce did not start (see the warning above); "
                  "nothing to compare", flush=True)
        return False
    one_shot_max = default_one_shot_max_bytes(world_size, DEFAULT_FAST_ALL_REDUCE_BYTES)
    rows: list[dict[str, Any]] = []
    for b in batch_sizes:
        x = torch.zeros(b, hidden, dtype=torch.bfloat16, device=device)  # sums stay 0
        nbytes = x.numel() * x.element_size()
        diff_eager, diff_graph = _max_diffs((b, hidden), device, rank)
        rows.append({
            "B": b, "KiB": nbytes / 1024,
            "algo": choose_algorithm(x.dtype, nbytes, DEFAULT_FAST_ALL_REDUCE_BYTES,
                                     one_shot_max),
            "nccl eager": _eager_us(dist.all_reduce, x, reps),
            "fast eager": _eager_us(tp_all_reduce, x, reps),
            "nccl graph": _graph_us(dist.all_reduce, x, reps),
            "fast graph": _graph_us(tp_all_reduce, x, reps),
            "max|d| eager": diff_eager, "max|d| graph": diff_graph,
        })
    _fused_columns(rows, hidden, device, reps)
    # Each algorithm forced (a fresh buffer and rendezvous each), graph latency only.
    for column, limit in (("1-shot graph", DEFAULT_FAST_ALL_REDUCE_BYTES),
                          ("2-shot graph", 0)):
        on = init_fast_all_reduce(device, one_shot_max_bytes=limit)
        for row in rows:
            x = torch.zeros(row["B"], hidden, dtype=torch.bfloat16, device=device)
            row[column] = _graph_us(tp_all_reduce, x, reps) if on else float("nan")
    if rank == 0:
        _print_table(rows, world_size, hidden)
    return True


def _fused_columns(rows: list[dict[str, Any]], hidden: int, device: torch.device,
                   reps: int) -> None:
    """A decoder layer's epilogue from a graph: the fast all-reduce then the compiled
    add + RMSNorm, against the fused kernel (NaN where it does not cover the size)."""
    from models.layers.fusion import fused
    from models.layers.layernorm import add_rms_norm

    weight = torch.ones(hidden, dtype=torch.bfloat16, device=device)
    for row in rows:
        x = torch.zeros(row["B"], hidden, dtype=torch.bfloat16, device=device)
        residual = torch.zeros_like(x)
        add_norm = fused(add_rms_norm, x)

        def unfused(t: torch.Tensor, residual: torch.Tensor = residual,
                    add_norm: Callable = add_norm) -> Any:
            return add_norm(tp_all_reduce(t), residual, weight, 1e-6)

        def one_kernel(t: torch.Tensor, residual: torch.Tensor = residual) -> Any:
            return tp_all_reduce_add_rms_norm(t, residual, weight, 1e-6)

        row["AR+norm graph"] = _graph_us(unfused, x, reps)
        row["fused graph"] = (_graph_us(one_kernel, x, reps) if one_kernel(x) is not None
                              else float("nan"))


def _print_table(rows: list[dict[str, Any]], world_size: int, hidden: int) -> None:
    print(f"\nall-reduce of [B, {hidden}] bf16 over {world_size} x "
          f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}; latency per call in "
          f"us (graph: replay of {GRAPH_CALLS} calls / {GRAPH_CALLS}); algo = the fast "
          f"path's choice ({NCCL} = not covered)")
    columns = ["B", "KiB", "algo", "nccl eager", "fast eager", "nccl graph", "fast graph",
               "1-shot graph", "2-shot graph", "graph x", "AR+norm graph", "fused graph",
               "max|d| eager", "max|d| graph"]
    print(" | ".join(f"{c:>12}" for c in columns))
    for row in rows:
        row["graph x"] = row["nccl graph"] / row["fast graph"]
        cells = []
        for c in columns:
            v = row[c]
            cells.append(f"{v:>12}" if isinstance(v, (int, str))
                         else f"{v:>12.3g}" if c.startswith("max") else f"{v:>12.1f}")
        print(" | ".join(cells))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--batch-sizes", default=",".join(map(str, BATCH_SIZES)))
    p.add_argument("--reps", type=int, default=10, help="timed runs per figure (median)")
    args = p.parse_args()
    if torch.cuda.device_count() < args.world_size:
        print(f"needs {args.world_size} GPUs, found {torch.cuda.device_count()}")
        return 2
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    ok = launch(_bench_rank, args.world_size, args.hidden, batch_sizes, args.reps)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
