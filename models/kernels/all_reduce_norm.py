"""One kernel for a row-parallel layer's epilogue: all-reduce + residual add + RMSNorm.

At batch-1 decode a tensor-parallel decoder layer ends twice in "sum the ranks' partial
outputs, add the residual, RMS-normalize": as separate kernels that is a symmetric-memory
all-reduce with two cross-GPU barriers (~7-8 us on H200s) and an add-RMSNorm kernel, each
with its launch gap. Here one program per token row does all of it, and no flag is ever
sent: the data is its own signal.

1. push: write this rank's partial row into every peer's symmetric buffer at slot
   [parity][src rank][row] (NVLink stores are posted: nothing waits for them);
2. take: read the rows the peers wrote into this rank's buffer, all peers' in one [W,
   hidden] tile, with volatile loads, until no element still holds EMPTY, the value every
   slot is filled with while nothing is in it; then write EMPTY back, so the slots are
   ready for their next call;
3. sum the ranks' rows in rank order 0..W-1 in float32 (the same order on every rank, so
   every rank gets bit-identical hidden states), round to the model dtype (as the
   all-reduce's output would be), add the residual, RMS-normalize; write the new residual
   and the normalized row.

Why no flag is needed: a flag written after the data needs a system-scope release between
the two, i.e. one NVLink round trip before the peer may even start reading, then the flag's
own trip. With an EMPTY value that real data never takes, each element shows by itself
whether it has landed; a 16-byte load that sees part of a row re-reads until all of it is
there. Data never equals EMPTY because the sender replaces it: EMPTY is -0.0 in bf16/fp16
(sent as +0.0, the same number) and 0x80008000 in float32 (a negative denormal ~4.6e-41,
sent as -0.0). The fill is the 16-bit word 0x8000 everywhere, which reads as EMPTY in every
dtype, so rows of another dtype can reuse the buffer.

Why two halves are enough: each row slot counts its calls in a per-rank `epochs` array
(every rank makes the same calls, so the counts agree), and the data of call k goes to half
k % 2. Call k+2 writes the half of call k again, but a peer starts call k+2 only after call
k+1 has taken this rank's row k+1, which this rank pushes only after its call k has read
and re-emptied that half. Counts and EMPTY slots live on the device and every call leaves
the buffer empty again, so a CUDA graph of these calls replays any number of times.

All ranks must launch the same calls with the same row counts (they do: TP ranks run the
same forward), or a rank waits forever for a row that never comes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

# The 16-bit word an empty slot is filled with (0x8000 as int16): EMPTY in every dtype.
EMPTY_WORD = -32768
# Per element size in bits: (EMPTY as that integer, what the sender writes for data equal
# to it).
_EMPTY_16 = tl.constexpr(EMPTY_WORD)  # 0x8000: -0.0, sent as +0.0
_EMPTY_32 = tl.constexpr(-2147450880)  # 0x80008000, sent as 0x80000000 (-0.0)
_EMPTY_32_SENT_AS = tl.constexpr(-2147483648)
# A row's program polls the [W, hidden] tile of every rank's slots, and a thread's loads per
# poll grow with its share of it: 32 elements a thread (four 16-byte loads in bf16) measured
# best on H200s; twice as many warps as that made the poll slower, not faster.
ELEMENTS_PER_WARP = 1024
MAX_WARPS = 16


def fill_empty_(buffer: torch.Tensor) -> None:
    """Mark every slot of a data buffer (any dtype, an even number of bytes) empty."""
    buffer.view(torch.int16).fill_(EMPTY_WORD)


@triton.jit
def _to_words(x):
    """x's bits as integers, with EMPTY replaced: what goes over the wire."""
    if x.dtype.primitive_bitwidth == 16:
        words = x.to(tl.int16, bitcast=True)
        words = tl.where(words == _EMPTY_16, 0, words).to(tl.int16)
    else:
        words = x.to(tl.int32, bitcast=True)
        words = tl.where(words == _EMPTY_32, _EMPTY_32_SENT_AS, words).to(tl.int32)
    return words


@triton.jit
def rank_pointer(data_ptrs, rank, dtype: tl.constexpr):
    """Rank `rank`'s data region as a `dtype` pointer. Its base is 16-byte aligned (symmetric
    memory allocations are), and Triton cannot know that of a pointer read from memory:
    without the hint every row moves in 2-byte loads and stores instead of 16-byte ones."""
    return tl.multiple_of(tl.load(data_ptrs + rank).to(tl.pointer_type(dtype)), 16)


@triton.jit
def _word_pointer(data_ptrs, rank, dtype: tl.constexpr):
    """Rank `rank`'s data region as a pointer to the integer words of `dtype`'s width."""
    if dtype.primitive_bitwidth == 16:
        return rank_pointer(data_ptrs, rank, tl.int16)
    else:
        return rank_pointer(data_ptrs, rank, tl.int32)


@triton.jit
def _slot_offsets(half, src, row, data_rows, hidden, offs):
    """Element offsets of row `row`'s slot from rank `src` (layout [parity][src][data_rows]
    [hidden]; `half` = parity * WORLD), at columns `offs`."""
    return ((half + src) * data_rows + row).to(tl.int64) * hidden + offs


@triton.jit
def _take_rows(ptrs, mask):
    """The rows at `ptrs` ([ranks, BLOCK_H] integer words) once every element has landed;
    leaves the slots EMPTY again. All peers' rows are polled together, so once they have
    landed the wait is one L2 round trip rather than one per peer in turn. Volatile loads:
    each one goes to L2, where the peers' stores land, never to a stale L1 line."""
    empty = _EMPTY_16 if ptrs.dtype.element_ty.primitive_bitwidth == 16 else _EMPTY_32
    words = tl.load(ptrs, mask=mask, other=0, volatile=True)
    while tl.max(tl.max((words == empty).to(tl.int32), axis=1), axis=0) > 0:
        words = tl.load(ptrs, mask=mask, other=0, volatile=True)
    tl.store(ptrs, tl.full(words.shape, empty, words.dtype), mask=mask)
    return words


@triton.jit
def _add_rms_norm_row(rows, srcs, residual, weight, eps, hidden, dtype: tl.constexpr,
                      WORLD: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
    """rows [WORLD, BLOCK_H] float32 (every rank's partial) -> (normalized row, new
    residual) in `dtype`. The sum goes in rank order 0..W-1 in float32 on every rank, so
    every rank gets bit-identical hidden states."""
    acc = tl.zeros([rows.shape[1]], dtype=tl.float32)
    for src in tl.static_range(WORLD):
        acc += tl.sum(tl.where(srcs == src, rows, 0.0), axis=0)  # row src, plus exact zeros
    h = acc.to(dtype)  # what the all-reduce would have returned
    if HAS_RESIDUAL:
        h = (h.to(tl.float32) + residual.to(tl.float32)).to(dtype)
    h32 = h.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(h32 * h32, axis=0) / hidden + eps)
    return (weight.to(tl.float32) * (h32 * rstd).to(dtype).to(tl.float32)).to(dtype), h


@triton.jit
def _all_reduce_add_rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr,
    data_ptrs, epochs_ptr,
    eps, hidden, data_rows,
    stride_x, stride_r, stride_o, stride_ro,
    RANK: tl.constexpr, WORLD: tl.constexpr, BLOCK_H: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK_H)
    mask = offs < hidden
    srcs = tl.arange(0, WORLD)[:, None]  # [WORLD, 1]
    dtype = out_ptr.dtype.element_ty
    weight = tl.load(weight_ptr + offs, mask=mask, other=0.0)
    epoch = tl.load(epochs_ptr + row)
    half = (epoch & 1) * WORLD  # data layout [parity][src][data_rows][hidden]
    residual = weight  # unused without a residual
    if HAS_RESIDUAL:  # loaded before the wait for the peers' rows, not after it
        residual = tl.load(residual_ptr + row * stride_r + offs, mask=mask, other=0.0)
    slots = _slot_offsets(half, srcs, row, data_rows, hidden, offs[None, :])  # [WORLD, BLOCK_H]
    own_data = _word_pointer(data_ptrs, RANK, dtype)
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)  # [BLOCK_H] partial
    words = _to_words(x)
    # This rank's row goes to the same place in every peer's buffer.
    slot = _slot_offsets(half, RANK, row, data_rows, hidden, offs)
    for peer in tl.static_range(WORLD):
        if peer != RANK:
            tl.store(rank_pointer(data_ptrs, peer, words.dtype) + slot, words, mask=mask)
    # Every peer's row at once ([WORLD, BLOCK_H]; this rank's own is not in its buffer).
    peer_words = _take_rows(own_data + slots, mask[None, :] & (srcs != RANK))
    # What the peers received, not x: where x held EMPTY they add its replacement, and so
    # must this rank, or the ranks' hidden states could differ in a bit.
    rows = tl.where(srcs == RANK, words[None, :], peer_words)
    out, h = _add_rms_norm_row(rows.to(dtype, bitcast=True).to(tl.float32), srcs, residual,
                               weight, eps, hidden, dtype, WORLD, HAS_RESIDUAL)
    tl.store(residual_out_ptr + row * stride_ro + offs, h, mask=mask)
    tl.store(out_ptr + row * stride_o + offs, out, mask=mask)
    tl.store(epochs_ptr + row, epoch + 1)


@dataclass(frozen=True)
class NormBuffers:
    """One rank's view of the fused kernel's symmetric buffers: what every call needs."""

    data_ptrs: torch.Tensor  # [W] int64: every rank's data region (symmetric memory)
    data_bytes: int  # size of each data region, filled by fill_empty_ before the first call
    epochs: torch.Tensor  # [max rows] int32: this rank's call count per row, zeroed
    rank: int
    world_size: int

    def __post_init__(self) -> None:
        if self.world_size < 2 or self.world_size & (self.world_size - 1):
            raise ValueError(f"world_size must be a power of two >= 2, got {self.world_size}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank must be in [0, {self.world_size}), got {self.rank}")

    def rows(self, hidden: int, element_size: int) -> int:
        """Rows per half and rank in the data region: the layout every call of this hidden
        size and dtype shares."""
        per_row = 2 * self.world_size * hidden * element_size
        return min(self.epochs.shape[0], self.data_bytes // per_row)


def all_reduce_add_rms_norm(
    x: torch.Tensor,  # [M, hidden] this rank's partial sum
    residual: torch.Tensor | None,  # [M, hidden]; None: the first layer's (nothing to add)
    weight: torch.Tensor,  # [hidden]
    eps: float,
    buffers: NormBuffers,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(sum_ranks(x) + residual) * weight, sum_ranks(x) + residual), both [M,
    hidden] in x's dtype (without a residual: of sum_ranks(x) alone). Collective:
    every rank calls it with the same M, hidden and dtype (calls of another hidden size or
    dtype use another data layout: a barrier must separate them)."""
    num_rows, hidden = x.shape
    rows = buffers.rows(hidden, x.dtype.itemsize)
    assert 0 < num_rows <= rows, f"{num_rows} rows, the buffers hold {rows}"
    if residual is not None:
        assert residual.shape == x.shape and residual.dtype == x.dtype
        assert residual.stride(1) == 1
    assert weight.shape == (hidden,) and weight.is_contiguous()
    assert x.stride(1) == 1
    out = torch.empty(num_rows, hidden, dtype=x.dtype, device=x.device)
    residual_out = torch.empty_like(out)
    block_h = triton.next_power_of_2(hidden)
    _all_reduce_add_rms_norm_kernel[(num_rows,)](
        x, residual if residual is not None else out, weight, out, residual_out,
        buffers.data_ptrs, buffers.epochs,
        eps, hidden, rows,
        x.stride(0), residual.stride(0) if residual is not None else 0, out.stride(0),
        residual_out.stride(0),
        RANK=buffers.rank, WORLD=buffers.world_size, BLOCK_H=block_h,
        HAS_RESIDUAL=residual is not None,
        num_warps=norm_num_warps(block_h, buffers.world_size),
    )
    return out, residual_out


def norm_num_warps(block_h: int, world_size: int) -> int:
    """Warps of the one program per row: one per ELEMENTS_PER_WARP elements of its
    [world_size, block_h] poll tile, between 4 and MAX_WARPS."""
    return min(MAX_WARPS, max(4, world_size * block_h // ELEMENTS_PER_WARP))
