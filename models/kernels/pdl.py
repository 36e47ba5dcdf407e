"""Programmatic dependent launch (PDL) for the chains of small decode kernels.

A batch-1 decode step is ~170 kernels in a row, each a few microseconds long, and each waits
for the previous one to finish entirely before its first program even starts: the launch,
the ramp-up of its first loads and the previous kernel's tail add up to a gap per kernel.
With PDL (sm_90+) a kernel launched with `launch_pdl=True` may start as soon as every program
of the kernel before it has called `gdc_launch_dependents`; it then runs whatever does not
depend on that kernel (loading or prefetching its own weights, which no kernel writes) and
calls `gdc_wait`, which returns once the previous kernel has completed and its memory is
visible. Everything that reads an activation or writes any output comes after the wait;
the one exception is the pushed all-reduce (models/kernels/all_reduce_norm.py), which polls
rows that carry their own arrival signal and reads what kernels before the previous one
wrote, and still waits before its stores.

Why the ordering stays total: every PDL kernel here waits unconditionally, before any early
exit, so a kernel's completion implies its predecessor's; kernels launched without the
attribute (torch's, cuBLAS) keep ordinary stream order on both sides. CUDA-graph capture
keeps the programmatic edges (checked on the H200: identical bits with and without PDL).

`pdl_enabled` is the launchers' switch: a Hopper-or-newer CUDA device, not Triton's
interpreter, and NANOSERVE_PDL not "0" (for A/B benchmarks).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

# Bytes per bulk prefetch request: one thread's share of a program's weight slice.
PREFETCH_CHUNK = tl.constexpr(1024)
# GEMV programs that prefetch their weight slice: those that can start while the previous
# kernel still runs, about two per SM. Later ones start as earlier ones retire, with the
# launch already streaming, and prefetching there only added work: decode step device time
# (`benchmarks.decode_graph`, batch 1, H200) went 725 -> 715 us on Qwen3-0.6B with this
# limit, but 4332 -> 4851 us on Qwen3-8B with every program prefetching. Having these
# programs prefetch a whole small weight between them instead of their own rows came out
# even for the Qwen3-8B TP=4 qkv shard (12.6 MB) and lost 5% with the down shard (25 MB)
# too (session 20). Having o_proj's programs also prefetch the first 12 / 24 MB of the
# layer's gate_up weight, while HBM idles through attention and the all-reduce, lost too:
# TP=4 551.6-552.4 / 548.7-549.5 against 554.0-554.4 tok/s, TP=1 224.7 (24 MB) against
# 230.4 (session 21).
PREFETCH_PROGRAMS = tl.constexpr(264)


@functools.cache
def _device_supports_pdl(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def pdl_enabled(device: torch.device) -> bool:
    """Whether kernels launched on `device` should use programmatic dependent launch."""
    if device.type != "cuda" or os.environ.get("NANOSERVE_PDL", "1") == "0":
        return False
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        return False
    return _device_supports_pdl(device.index if device.index is not None
                                else torch.cuda.current_device())


def pdl_for_weight(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """pdl_enabled for a GEMV launch, which bulk-prefetches weight rows: those need 16-byte
    aligned starts (else the launch goes without PDL)."""
    row_bytes = weight.stride(0) * weight.element_size()
    return pdl_enabled(x.device) and weight.data_ptr() % 16 == 0 and row_bytes % 16 == 0


@triton.jit
def wait_for_prior_kernel(PDL: tl.constexpr):
    """Block until the previous kernel in the stream has completed (its writes visible), then
    let the next PDL kernel launch. A no-op without PDL."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def bulk_prefetch(addrs, sizes):
    """cp.async.bulk.prefetch of `sizes` bytes at `addrs` into L2, per element; sizes <= 0
    issue nothing. Fire and forget: no barrier, no register holds the data."""
    return tl.inline_asm_elementwise(
        "{ .reg .pred %p; setp.gt.s32 %p, $2, 0; "
        "@%p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r", [addrs, sizes], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def prefetch_l2(ptr, num_bytes):
    """Ask L2 for `num_bytes` contiguous bytes at `ptr` (16-byte aligned, a multiple of 16
    bytes), PREFETCH_CHUNK bytes per request. One element per thread of the program (a
    1-D tensor of num_threads elements holds exactly one per thread), so no request is
    issued twice."""
    THREADS: tl.constexpr = tl.extra.cuda.num_threads()
    base = ptr.to(tl.pointer_type(tl.int8))
    starts = tl.arange(0, THREADS) * PREFETCH_CHUNK
    for c0 in range(0, num_bytes, THREADS * PREFETCH_CHUNK):
        offs = c0 + starts
        bulk_prefetch(base + offs, tl.minimum(num_bytes - offs, PREFETCH_CHUNK))


@triton.jit
def prefetch_weight_rows(w_ptr, row0, num_rows, K):
    """A GEMV program's weight rows [row0, row0 + num_rows) of K elements (one contiguous
    slice) into L2, by the first PREFETCH_PROGRAMS programs of the launch only."""
    row_bytes = K * (w_ptr.dtype.element_ty.primitive_bitwidth // 8)
    nbytes = tl.where(tl.program_id(0) < PREFETCH_PROGRAMS, num_rows * row_bytes, 0)
    prefetch_l2(w_ptr + row0.to(tl.int64) * K, nbytes)
