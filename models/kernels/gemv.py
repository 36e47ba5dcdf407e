"""GEMV for decode linears at tiny batch sizes: `out = x @ weight.T (+ bias)` for M <= 8 rows.

At batch 1-8 a linear layer is one pass over its weight ([N, K], nn.Linear layout), so its
time is the weight's bytes over the bandwidth reached. cuBLAS picks GEMM tiles built for
larger M and, on the Qwen3 decode shapes, reaches 1-1.6 TB/s of the H200's ~4.8. Here each
program owns BLOCK_N output rows and streams their weight rows once along K, and every weight
tile it loads serves all M rows of x, so M = 8 reads the same bytes as M = 1.

Two tile kinds, picked per shape by `GemvConfig.kind` (the benchmark decides which wins):
- "fma": the weight tile is `[BLOCK_N, BLOCK_K // VEC, VEC]` with VEC elements = 16 bytes
  contiguous along K, so each thread issues 16-byte loads and multiplies them into per-thread
  float32 partials `[BLOCK_N, BLOCK_K // VEC]` with an in-thread sum over VEC; the lanes and
  warps that split K are reduced only once, after the loop. x rows are separate accumulators
  (registers grow with M), one compiled kernel per row bucket (1, 2, 4, 8; M itself stays a
  runtime value). A runtime branch over the buckets inside one kernel would size every
  launch's registers for the largest: at M = 1 that was 42 registers a thread with 1024-wide
  K steps and 96 with 2048-wide ones, against 32 (sm_90 compile), i.e. 10 or 5 resident
  programs per SM instead of 16, and as many fewer weight bytes in flight.
- "mma": swap A/B so the weight is the big operand of a tensor-core dot,
  `acc[BLOCK_N, 8] = W[BLOCK_N, BLOCK_K] @ x^T[BLOCK_K, 8]` (x padded to MAX_M rows), which
  lets Triton's pipeliner stage weight tiles through shared memory (cp.async, num_stages
  deep), so many bytes are in flight per SM without registers to hold them. (fp32 takes
  Triton's exact FMA dot: TF32 would miss a 1e-4 tolerance.)

Either kind may split K over `split_k` programs per row tile (enough programs for N = 1024):
partials go to a float32 workspace by atomic_add and a second small kernel adds the bias,
casts into `out` and zeroes the workspace again, so one zeroed workspace (gemv_workspace)
serves every later call and CUDA-graph replay without a memset.

`gemv_push` is the row-parallel variant for tensor-parallel decode: its programs store their
outputs, the rank's partial sums, straight into every rank's fused all-reduce + RMSNorm
buffer (models/kernels/all_reduce_norm.py) instead of into a tensor.

Nothing here reads device values on the host, and with `out` and `workspace` given nothing
is allocated, so calls can be captured in CUDA graphs (a caller can keep one workspace of
MAX_M x the widest N per device and pass it to every call; unused when K is not split).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from models.kernels.all_reduce_norm import NormBuffers, push_partial
from models.kernels.pdl import pdl_for_weight, prefetch_weight_rows, wait_for_prior_kernel
from models.parallel import PushedPartial

MAX_M = 8
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# x rows in the tensor-core dot (N of the mma tile); rows past M re-read row M-1.
_MMA_ROWS = tl.constexpr(MAX_M)
_FINALIZE_BLOCK = 1024

# Heuristic defaults, used for shapes missing from TUNED.
# Programs to aim for: two per SM of an H100/H200 (132 SMs).
TARGET_PROGRAMS = 264
# Weight rows per program at most: each thread holds all of them (16 bytes of each per K
# step), so registers grow with it; 4 rows is ~128 registers at M = 8.
MAX_BLOCK_N = 4


def check_fma_tile(block_n: int, block_k: int, num_warps: int) -> None:
    """A GEMV tile's sizes: powers of two, and K steps of at least 16 elements."""
    for name, value in (("block_n", block_n), ("block_k", block_k), ("num_warps", num_warps)):
        if value < 1 or value & (value - 1):
            raise ValueError(f"{name} must be a power of two, got {value}")
    if block_k < 16:
        raise ValueError(f"block_k must be >= 16, got {block_k}")


@dataclass(frozen=True)
class GemvConfig:
    """Launch choice of `gemv`; a pure function of (N, K, dtype) via `choose_config`."""

    block_n: int  # output rows (weight rows) per program
    block_k: int  # K elements per inner-loop step
    num_warps: int = 4
    split_k: int = 1  # programs per row tile along K (> 1: workspace + finalize kernel)
    kind: str = "fma"  # "fma" (CUDA cores) or "mma" (tensor cores, x padded to MAX_M rows)
    # Triton's software pipelining of the K loop's loads; only "mma" loops get it (Triton
    # leaves the fma loop's loads alone).
    num_stages: int = 1

    def __post_init__(self) -> None:
        check_fma_tile(self.block_n, self.block_k, self.num_warps)
        if self.split_k < 1 or self.num_stages < 1:
            raise ValueError(f"split_k and num_stages must be >= 1, got {self}")
        if self.kind not in ("fma", "mma"):
            raise ValueError(f"kind must be 'fma' or 'mma', got {self.kind!r}")
        if self.kind == "mma" and self.block_n < 16:
            raise ValueError(f"mma needs block_n >= 16 (tl.dot), got {self.block_n}")


# Measured winners per (N, K, element size in bytes) at M = 1 (batch-1 decode), where cuBLAS
# picks slow kernels for several of these shapes; None or absent: cuBLAS. From
# `python -m benchmarks.gemv_bench --m 1 --rep 2` on an H200 (bf16, cold weights, CUDA
# graphs, us per call: cuBLAS -> this entry; benchmarks/RESULTS.md, sessions 5 and 9).
# Split-K configs won a few percent on some 8B shapes but their atomics make logits differ
# from run to run, so the table keeps to the best deterministic config; shapes it gained
# under ~5% on stay with cuBLAS. The 2048-wide K steps won on most 8B shapes only once each
# row bucket got its own compile (before, their registers halved the programs per SM).
_FMA_K1024 = GemvConfig(block_n=1, block_k=1024)
_FMA_K2048 = GemvConfig(block_n=1, block_k=2048)
_FMA_K2048_W8 = GemvConfig(block_n=1, block_k=2048, num_warps=8)
TUNED: dict[tuple[int, int, int], GemvConfig | None] = {
    (1024, 2048, 2): _FMA_K2048,  # 0.6B o_proj: 12.82 -> 3.52
    (1024, 3072, 2): _FMA_K1024,  # 0.6B down: 7.66 -> 4.13
    (6144, 4096, 2): _FMA_K2048_W8,  # 8B qkv (and gate_up at TP=4, unfused): 15.67 -> 12.78
    (3072, 4096, 2): _FMA_K2048_W8,  # 8B qkv TP=2: 11.53 -> 7.27
    (1536, 4096, 2): _FMA_K2048_W8,  # 8B qkv TP=4: 8.21 -> 4.72
    (4096, 4096, 2): _FMA_K2048_W8,  # 8B o_proj: 13.66 -> 9.28
    (4096, 2048, 2): _FMA_K2048,  # 8B o_proj TP=2: 7.39 -> 5.72
    # 8B o_proj TP=4: 5.37 -> 4.38 (the fma tile: 5.79). Here the Triton GEMV matters more
    # than its time alone says: in the decode chain a cuBLAS launch can neither start early
    # (PDL) nor let the all-reduce after it (TP=4 batch-1 device time per step 2.218 ->
    # 2.131 ms with the fma tile, `bench offline --single --tensor-parallel-size 4`).
    (4096, 1024, 2): GemvConfig(block_n=32, block_k=256, kind="mma", num_stages=4),
    (12288, 4096, 2): _FMA_K1024,  # 8B gate_up TP=2 (unfused): 28.00 -> 26.15
    (4096, 12288, 2): _FMA_K2048_W8,  # 8B down: 29.98 -> 24.88
    (4096, 6144, 2): _FMA_K1024,  # 8B down TP=2: 17.72 -> 14.69
    (4096, 3072, 2): _FMA_K1024,  # 8B down TP=4: 11.44 -> 9.59
    (151936, 4096, 2): _FMA_K2048_W8,  # 8B LM head: 293.83 -> 269.98
    (75968, 4096, 2): _FMA_K2048_W8,  # 8B LM head TP=2: 143.82 -> 135.92
    (37984, 4096, 2): _FMA_K2048_W8,  # 8B LM head TP=4: 81.40 -> 68.80
}
# The batch size TUNED was measured at: larger batches keep cuBLAS.
TUNED_MAX_M = 1


def default_config(n: int, k: int, dtype: torch.dtype) -> GemvConfig:
    """Unmeasured shapes: 16-byte loads by 32 lanes x 4 warps along K, and as many weight rows
    per program (up to MAX_BLOCK_N) as keeps TARGET_PROGRAMS programs busy."""
    vec = 16 // dtype.itemsize
    num_warps = 4
    block_k = min(32 * vec * num_warps, max(16, triton.next_power_of_2(k)))
    block_n = MAX_BLOCK_N
    while block_n > 1 and triton.cdiv(n, block_n) < TARGET_PROGRAMS:
        block_n //= 2
    return GemvConfig(block_n=block_n, block_k=block_k, num_warps=num_warps)


def choose_config(n: int, k: int, dtype: torch.dtype) -> GemvConfig:
    tuned = TUNED.get((n, k, dtype.itemsize))
    return tuned if tuned is not None else default_config(n, k, dtype)


def gemv_supported(m: int, n: int, k: int, dtype: torch.dtype) -> bool:
    """Host-int half of `use_gemv`: a batch gemv serves, in a dtype it serves, on a shape
    where it was measured (or, untuned, is expected) to beat cuBLAS. K must be a multiple of
    16 elements: Triton vectorizes the weight rows only when it knows they are aligned."""
    if not 1 <= m <= TUNED_MAX_M or dtype not in _DTYPES or n < 1 or k < 1 or k % 16:
        return False
    return TUNED.get((n, k, dtype.itemsize)) is not None


def use_gemv(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """True where gemv should replace F.linear: CUDA, 2-D x with M <= MAX_M rows and a
    contiguous last dim, a contiguous [N, K] weight of x's dtype (bf16/fp16/fp32), and a shape
    where gemv wins."""
    if not (x.is_cuda and weight.is_cuda) or x.dim() != 2 or weight.dim() != 2:
        return False
    if weight.dtype != x.dtype or not weight.is_contiguous() or x.stride(-1) != 1:
        return False
    if weight.shape[1] != x.shape[1]:
        return False
    return gemv_supported(x.shape[0], weight.shape[0], weight.shape[1], x.dtype)


def gemv_workspace(max_m: int, n: int, device: torch.device | str) -> torch.Tensor:
    """Zeroed float32 split-K workspace for calls with M <= max_m rows and N <= n outputs.
    gemv leaves it zeroed again, so one buffer serves every call and graph replay (calls on
    different streams must not share one)."""
    return torch.zeros(max_m * n, dtype=torch.float32, device=device)


# --------------------------------------------------------------------------- kernels


@triton.jit
def _store_out(out_ptr, ws_ptr, b_ptr, m, n, vals, M, N, stride_om,
               push_ptrs, epochs_ptr, data_rows, HAS_BIAS: tl.constexpr,
               SPLIT_K: tl.constexpr, PUSH: tl.constexpr, RANK: tl.constexpr,
               WORLD: tl.constexpr):
    """Write float32 `vals` at rows `m`, columns `n` (broadcastable to vals): the split-K
    workspace by atomic_add, else bias + cast into out, or with PUSH into every rank's
    fused all-reduce buffer instead (push_ptrs, epochs_ptr, data_rows: its layout)."""
    mask = n < tl.where(m < M, N, 0)  # rows past M store nothing
    if SPLIT_K:
        tl.atomic_add(ws_ptr + m * N + n, vals, mask=mask, sem="relaxed")
    else:
        if HAS_BIAS:
            vals += tl.load(b_ptr + n, mask=n < N, other=0.0).to(tl.float32)
        vals = vals.to(out_ptr.dtype.element_ty)
        if PUSH:
            push_partial(push_ptrs, epochs_ptr, data_rows, m, n, vals, mask, N, RANK, WORLD)
        else:
            tl.store(out_ptr + m * stride_om + n, vals, mask=mask)


@triton.jit
def _fma_row(w, x_ptrs, in_k, m: tl.constexpr, M, stride_xm, EVEN_K: tl.constexpr):
    """Row m's partials [BLOCK_N, KV]: the sum over VEC stays inside each thread. Rows of
    the bucket past M re-read row M-1 (their results are not stored), so x loads need no
    row mask and stay 16-byte vectors."""
    row_ptrs = x_ptrs + tl.minimum(m, M - 1) * stride_xm  # [1, KV, VEC]
    xm = tl.load(row_ptrs) if EVEN_K else tl.load(row_ptrs, mask=in_k, other=0.0)
    return tl.sum(w * xm.to(tl.float32), axis=2)


@triton.jit
def _fma_tile(x_ptr, w_ptr, b_ptr, out_ptr, ws_ptr, M, N, K, stride_xm, stride_om,
              offs_n, rows, k_start, k_end, push_ptrs, epochs_ptr, data_rows,
              ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
              VEC: tl.constexpr, EVEN_K: tl.constexpr, HAS_BIAS: tl.constexpr,
              SPLIT_K: tl.constexpr, PUSH: tl.constexpr, RANK: tl.constexpr,
              WORLD: tl.constexpr):
    KV: tl.constexpr = BLOCK_K // VEC
    k_in = tl.arange(0, KV)[:, None] * VEC + tl.arange(0, VEC)[None, :]  # [KV, VEC]
    w_ptrs = w_ptr + rows[:, None, None] * K + k_in[None, :, :]  # [BLOCK_N, KV, VEC]
    x_ptrs = x_ptr + k_in[None, :, :]  # [1, KV, VEC], row 0
    # One accumulator per x row (a list of tensors cannot be loop-carried); rows past ROWS
    # are never updated, so they cost nothing.
    acc0 = tl.zeros([BLOCK_N, KV], dtype=tl.float32)
    acc1 = tl.zeros([BLOCK_N, KV], dtype=tl.float32)
    acc2 = tl.zeros([BLOCK_N, KV], dtype=tl.float32)
    acc3 = tl.zeros([BLOCK_N, KV], dtype=tl.float32)
    acc4 = tl.zeros([BLOCK_N, KV], dtype=tl.float32)
    acc5 = tl.zeros([BLOCK_N, KV], dtype=tl.float32)
    acc6 = tl.zeros([BLOCK_N, KV], dtype=tl.float32)
    acc7 = tl.zeros([BLOCK_N, KV], dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        if EVEN_K:
            in_k = None
            w = tl.load(w_ptrs + k0)
        else:
            in_k = (k0 + k_in < k_end)[None, :, :]
            w = tl.load(w_ptrs + k0, mask=in_k, other=0.0)
        w = w.to(tl.float32)
        acc0 += _fma_row(w, x_ptrs + k0, in_k, 0, M, stride_xm, EVEN_K)
        if ROWS > 1:
            acc1 += _fma_row(w, x_ptrs + k0, in_k, 1, M, stride_xm, EVEN_K)
        if ROWS > 2:
            acc2 += _fma_row(w, x_ptrs + k0, in_k, 2, M, stride_xm, EVEN_K)
            acc3 += _fma_row(w, x_ptrs + k0, in_k, 3, M, stride_xm, EVEN_K)
        if ROWS > 4:
            acc4 += _fma_row(w, x_ptrs + k0, in_k, 4, M, stride_xm, EVEN_K)
            acc5 += _fma_row(w, x_ptrs + k0, in_k, 5, M, stride_xm, EVEN_K)
            acc6 += _fma_row(w, x_ptrs + k0, in_k, 6, M, stride_xm, EVEN_K)
            acc7 += _fma_row(w, x_ptrs + k0, in_k, 7, M, stride_xm, EVEN_K)
    # The cross-lane / cross-warp part of the K reduction, once per program.
    _store_out(out_ptr, ws_ptr, b_ptr, 0, offs_n, tl.sum(acc0, axis=1), M, N, stride_om,
               push_ptrs, epochs_ptr, data_rows, HAS_BIAS, SPLIT_K, PUSH, RANK, WORLD)
    if ROWS > 1:
        _store_out(out_ptr, ws_ptr, b_ptr, 1, offs_n, tl.sum(acc1, axis=1), M, N, stride_om,
                   push_ptrs, epochs_ptr, data_rows, HAS_BIAS, SPLIT_K, PUSH, RANK, WORLD)
    if ROWS > 2:
        _store_out(out_ptr, ws_ptr, b_ptr, 2, offs_n, tl.sum(acc2, axis=1), M, N, stride_om,
                   push_ptrs, epochs_ptr, data_rows, HAS_BIAS, SPLIT_K, PUSH, RANK, WORLD)
        _store_out(out_ptr, ws_ptr, b_ptr, 3, offs_n, tl.sum(acc3, axis=1), M, N, stride_om,
                   push_ptrs, epochs_ptr, data_rows, HAS_BIAS, SPLIT_K, PUSH, RANK, WORLD)
    if ROWS > 4:
        _store_out(out_ptr, ws_ptr, b_ptr, 4, offs_n, tl.sum(acc4, axis=1), M, N, stride_om,
                   push_ptrs, epochs_ptr, data_rows, HAS_BIAS, SPLIT_K, PUSH, RANK, WORLD)
        _store_out(out_ptr, ws_ptr, b_ptr, 5, offs_n, tl.sum(acc5, axis=1), M, N, stride_om,
                   push_ptrs, epochs_ptr, data_rows, HAS_BIAS, SPLIT_K, PUSH, RANK, WORLD)
        _store_out(out_ptr, ws_ptr, b_ptr, 6, offs_n, tl.sum(acc6, axis=1), M, N, stride_om,
                   push_ptrs, epochs_ptr, data_rows, HAS_BIAS, SPLIT_K, PUSH, RANK, WORLD)
        _store_out(out_ptr, ws_ptr, b_ptr, 7, offs_n, tl.sum(acc7, axis=1), M, N, stride_om,
                   push_ptrs, epochs_ptr, data_rows, HAS_BIAS, SPLIT_K, PUSH, RANK, WORLD)


@triton.jit
def _mma_tile(x_ptr, w_ptr, M, K, stride_xm, rows, k_start, k_end,
              BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
              DOT_PRECISION: tl.constexpr):
    """acc [BLOCK_N, MAX_M] = W tile @ x^T tile: acc[n, m] is out[m, n]."""
    offs_k = tl.arange(0, BLOCK_K)
    cols = tl.arange(0, _MMA_ROWS)
    w_ptrs = w_ptr + rows[:, None] * K + offs_k[None, :]  # [BLOCK_N, BLOCK_K]
    # Padding rows re-read row M-1 (not stored): no row mask on the pipelined loads.
    x_rows = tl.minimum(cols, M - 1)
    x_ptrs = x_ptr + x_rows[None, :] * stride_xm + offs_k[:, None]  # [BLOCK_K, MAX_M]
    acc = tl.zeros([BLOCK_N, _MMA_ROWS], dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        if EVEN_K:
            w = tl.load(w_ptrs + k0)
            xt = tl.load(x_ptrs + k0)
        else:
            in_k = k0 + offs_k < k_end
            w = tl.load(w_ptrs + k0, mask=in_k[None, :], other=0.0)
            xt = tl.load(x_ptrs + k0, mask=in_k[:, None], other=0.0)
        acc = tl.dot(w, xt, acc, input_precision=DOT_PRECISION)
    return acc


@triton.jit(do_not_specialize=["M"])
def _gemv_kernel(
    x_ptr, w_ptr, b_ptr, out_ptr, ws_ptr, push_ptrs, epochs_ptr,
    M, N, K, stride_xm, stride_om, k_chunk, data_rows,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, VEC: tl.constexpr, USE_MMA: tl.constexpr,
    DOT_PRECISION: tl.constexpr, EVEN_K: tl.constexpr, HAS_BIAS: tl.constexpr,
    SPLIT_K: tl.constexpr, PDL: tl.constexpr, ROWS: tl.constexpr,
    PUSH: tl.constexpr, RANK: tl.constexpr, WORLD: tl.constexpr,
):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    # The last tile re-reads row N-1 instead of masking every weight load; its stores are
    # masked.
    rows = tl.minimum(offs_n, N - 1).to(tl.int64)
    k_start = tl.program_id(1) * k_chunk
    k_end = tl.minimum(k_start + k_chunk, K)
    if PDL and not SPLIT_K:
        # The program's weight rows are one contiguous slice, and no kernel writes weights:
        # L2 fetches them while the previous kernel finishes.
        row0 = tl.program_id(0) * BLOCK_N
        prefetch_weight_rows(w_ptr, row0, tl.minimum(N - row0, BLOCK_N), K)
    # Not the first weight tile itself into registers here (as fused_gemv does): on every
    # fma GEMV that lost 4.4% at TP=2 and 3.8% at TP=1, and kept to o_proj (its whole
    # slice in one 4-row tile, every program resident) 2% at TP=2 (Qwen3-8B batch 1,
    # session 21).
    wait_for_prior_kernel(PDL)
    if USE_MMA:
        acc = _mma_tile(x_ptr, w_ptr, M, K, stride_xm, rows, k_start, k_end,
                        BLOCK_N, BLOCK_K, EVEN_K, DOT_PRECISION)
        cols = tl.arange(0, _MMA_ROWS)
        _store_out(out_ptr, ws_ptr, b_ptr, cols[None, :], offs_n[:, None], acc, M, N,
                   stride_om, push_ptrs, epochs_ptr, data_rows, HAS_BIAS, SPLIT_K, PUSH,
                   RANK, WORLD)
    else:
        _fma_tile(x_ptr, w_ptr, b_ptr, out_ptr, ws_ptr, M, N, K, stride_xm, stride_om,
                  offs_n, rows, k_start, k_end, push_ptrs, epochs_ptr, data_rows, ROWS,
                  BLOCK_N, BLOCK_K, VEC, EVEN_K, HAS_BIAS, SPLIT_K, PUSH, RANK, WORLD)


@triton.jit(do_not_specialize=["M"])
def _split_k_finalize_kernel(ws_ptr, b_ptr, out_ptr, M, N, stride_om,
                             HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """out = workspace (+ bias), then zero the workspace for the next call."""
    wait_for_prior_kernel(PDL)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < M * N
    m = offs // N
    n = offs % N
    vals = tl.load(ws_ptr + offs, mask=mask, other=0.0)
    if HAS_BIAS:
        vals += tl.load(b_ptr + n, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + m * stride_om + n, vals.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(ws_ptr + offs, tl.zeros_like(vals), mask=mask)


# --------------------------------------------------------------------------- launcher


def row_bucket(cfg: GemvConfig, m: int) -> int:
    """The kernel's ROWS for M rows of x: for "fma" the next of 1, 2, 4, 8 (rows past M
    re-read row M - 1 and store nothing); for "mma" always MAX_M, which it ignores (x is
    padded to MAX_M rows there), so one compile serves every M."""
    if cfg.kind == "mma":
        return MAX_M
    return 1 if m <= 1 else triton.next_power_of_2(m)


def gemv(
    x: torch.Tensor,  # [M, K], M <= MAX_M, last dim contiguous
    weight: torch.Tensor,  # [N, K] contiguous (nn.Linear weight)
    bias: torch.Tensor | None = None,  # [N]
    out: torch.Tensor | None = None,  # [M, N], last dim contiguous
    *,
    config: GemvConfig | None = None,  # None: choose_config(N, K, dtype)
    workspace: torch.Tensor | None = None,  # float32 [>= M * N] zeros, when split_k > 1
) -> torch.Tensor:
    """`F.linear(x, weight, bias)` in x's dtype with float32 accumulation, for M <= MAX_M.

    Allocates nothing when `out` is given and, for configs that split K, `workspace`
    (gemv_workspace) too; the workspace is left zeroed. Split-K adds partials in whatever
    order programs finish, so those results may differ between calls in the last bits.
    """
    num_rows, k = _check_operands(x, weight, bias)
    n = weight.shape[0]
    if out is None:
        out = torch.empty(num_rows, n, dtype=x.dtype, device=x.device)
    assert out.shape == (num_rows, n) and out.dtype == x.dtype and out.stride(-1) == 1
    if num_rows == 0 or n == 0:
        return out
    if k == 0:
        return out.copy_(bias.expand(num_rows, n)) if bias is not None else out.zero_()
    cfg = config or choose_config(n, k, x.dtype)
    k_chunk = _k_chunk(k, cfg)
    split = k_chunk < k
    if split:
        if workspace is None:
            workspace = gemv_workspace(num_rows, n, x.device)
        assert workspace.dtype == torch.float32 and workspace.is_contiguous()
        assert workspace.numel() >= num_rows * n, "workspace smaller than M * N"
    _launch(x, weight, bias, out, workspace if split else out, cfg, k_chunk)
    if split:
        pdl = pdl_for_weight(x, weight)
        _split_k_finalize_kernel[(triton.cdiv(num_rows * n, _FINALIZE_BLOCK),)](
            workspace, bias if bias is not None else out, out, num_rows, n, out.stride(0),
            HAS_BIAS=bias is not None, BLOCK=_FINALIZE_BLOCK, PDL=pdl, num_warps=4,
            launch_pdl=pdl,
        )
    return out


def gemv_push(
    x: torch.Tensor,  # [M, K], 1 <= M <= MAX_M, last dim contiguous
    weight: torch.Tensor,  # [N, K] contiguous: a row-parallel shard, N = hidden size
    bias: torch.Tensor | None,  # [N], on one rank only (it is added once to the sum)
    buffers: NormBuffers,
) -> PushedPartial:
    """`gemv` whose output rows, this rank's partial sums, go straight into slot [parity]
    [rank][row] of every rank's fused all-reduce buffer instead of into a tensor. The next
    launch on the stream must be `all_reduce_add_rms_norm` of the returned PushedPartial
    (collective, like it: every rank pushes the same shape). Never split along K: the
    workspace would need a finalize kernel between the two."""
    num_rows, k = _check_operands(x, weight, bias)
    n = weight.shape[0]
    cfg = choose_config(n, k, x.dtype)
    assert 0 < num_rows <= buffers.rows(n, x.element_size()) and k > 0, (num_rows, k)
    k_chunk = _k_chunk(k, cfg)
    assert k_chunk >= k, f"{cfg} splits K: it cannot push"
    # `x` stands in for out and the workspace: a pushing launch writes neither.
    _launch(x, weight, bias, x, x, cfg, k_chunk, buffers=buffers)
    return PushedPartial((num_rows, n), x.dtype, x.device)


def _check_operands(x: torch.Tensor, weight: torch.Tensor,
                    bias: torch.Tensor | None) -> tuple[int, int]:
    num_rows, k = x.shape
    n = weight.shape[0]
    assert num_rows <= MAX_M, f"gemv serves at most {MAX_M} rows, got {num_rows}"
    assert weight.shape == (n, k) and weight.is_contiguous(), (
        f"weight must be a contiguous [N, {k}] tensor, got {tuple(weight.shape)}")
    assert x.dtype == weight.dtype and x.dtype in _DTYPES, (
        f"x {x.dtype} and weight {weight.dtype} must match (bf16/fp16/fp32)")
    assert x.stride(-1) == 1, "x's last dim must be contiguous"
    assert bias is None or (bias.shape == (n,) and bias.is_contiguous())
    return num_rows, k


def _k_chunk(k: int, cfg: GemvConfig) -> int:
    """K elements per split: whole BLOCK_K tiles, so only the last tile of K is ragged."""
    return triton.cdiv(triton.cdiv(k, cfg.split_k), cfg.block_k) * cfg.block_k


def _launch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
            out: torch.Tensor, workspace: torch.Tensor, cfg: GemvConfig, k_chunk: int,
            buffers: NormBuffers | None = None) -> None:
    num_rows, k = x.shape
    n = weight.shape[0]
    splits = triton.cdiv(k, k_chunk)
    push = buffers is not None
    data_rows = buffers.rows(n, x.element_size()) if push else 0
    pdl = pdl_for_weight(x, weight)
    _gemv_kernel[(triton.cdiv(n, cfg.block_n), splits)](
        x, weight, bias if bias is not None else out, out, workspace,
        buffers.data_ptrs if push else x, buffers.epochs if push else x,
        num_rows, n, k, x.stride(0), out.stride(0), k_chunk, data_rows,
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, VEC=16 // x.element_size(),
        USE_MMA=cfg.kind == "mma",
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        EVEN_K=k % cfg.block_k == 0, HAS_BIAS=bias is not None, SPLIT_K=splits > 1,
        PDL=pdl, ROWS=row_bucket(cfg, num_rows),
        PUSH=push, RANK=buffers.rank if push else 0,
        WORLD=buffers.world_size if push else 1,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, launch_pdl=pdl,
    )
