"""One kernel for the vocab-parallel sampler's exchange: a cross-rank argmax of candidates.

With the vocabulary split over the tensor-parallel ranks, every rank runs the exponential
race over its own shard (`models.kernels.sample.race_partials`: each vocab chunk's best
value and its global index), and only each row's best (value, index) has to cross the
ranks: the race is an argmax of per-element values, and an argmax splits over shards
exactly. One program per row, on the symmetric-memory scheme of all_reduce_norm.py (no
flag, no barrier: the data is its own signal):

1. reduce this rank's S candidates of the row to one (value, index) with the tie rule:
   the largest value, the lowest index among equal values; NaN, -inf and NO_INDEX never
   win; (-inf, NO_INDEX) when nothing is left;
2. pack it into one int64 word, the value's float32 bits high and the index low, and store
   it into every peer's symmetric buffer at [parity][this rank][row]: one aligned 8-byte
   store each (NVLink stores are posted: nothing waits for them);
3. read the words the peers wrote into this rank's buffer, all peers' slots at once, with
   volatile loads until none is EMPTY; write EMPTY back, so the slots are ready for their
   next call;
4. reduce the W words (this rank's from registers) with the same rule and store the index
   as int64, NO_INDEX as 0 (torch.argmax's answer for an all -inf row). Max and min are
   exact, so every rank gets the same index whatever order it combines in.

Why no flag is needed: a flag written after the data needs a system-scope release between
the two, one NVLink round trip before the peer may even start reading, then the flag's own
trip. EMPTY is the word -1 (all bits set, the buffer's 0xFF fill), and no real word has
either 32-bit half all ones: the index half is in [0, 2**31 - 1], and the value half is the
bits of a float32 that is not NaN (NaN never survives step 1). So a slot shows by itself
whether its word has landed; the poll waits until neither half of any peer's word is all
ones, so even a store that landed as two 32-bit pieces is never taken half written.

Why two halves are enough: each row counts its calls in a per-rank `epochs` array (every
rank makes the same calls, so the counts agree), and the word of call k goes to half k % 2.
Call k + 2 writes the half of call k again, but a peer starts call k + 2 only after its call
k + 1 has taken this rank's word of call k + 1, which this rank pushes only after its call k
has read and re-emptied that half. Counts and EMPTY slots live on the device and every call
leaves the buffer empty again, so a CUDA graph of these calls replays any number of times.

All ranks must launch the same calls with the same row counts (TP ranks do: they run the
same step), or a rank waits forever for a word that never comes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from models.kernels.all_reduce_norm import rank_pointer
from models.kernels.pdl import pdl_enabled, wait_for_prior_kernel
from models.kernels.sample import MAX_SPLITS, best_candidate
from models.parallel import NO_INDEX

# What an empty slot holds: all 64 bits set (the buffer is filled with 0xFF bytes).
EMPTY_WORD = -1
# Candidates per row a program holds: the race's per-chunk winners, so its widest split. One
# fixed width (and no specialisation on the sizes) keeps the kernel to one compiled variant
# per (rank, world size): B and S change with the batch, and a compile mid-serving costs ~0.5 s.
MAX_CANDIDATES = MAX_SPLITS
_NO_INDEX = tl.constexpr(NO_INDEX)
_EMPTY = tl.constexpr(EMPTY_WORD)


def fill_empty_words_(buffer: torch.Tensor) -> None:
    """Mark every slot of a word buffer (any dtype, contiguous) empty."""
    buffer.view(torch.uint8).fill_(0xFF)


@triton.jit
def _pack(val, idx):
    """One int64 word: val's float32 bits high, idx (>= 0) low."""
    return (val.to(tl.int32, bitcast=True).to(tl.int64) << 32) | idx.to(tl.int64)


@triton.jit
def _halves(words):
    """(high, low) 32-bit halves of int64 words (the value's bits, the index)."""
    return (words >> 32).to(tl.int32), words.to(tl.int32)


@triton.jit
def _take_words(ptrs, mask):
    """The words at `ptrs` (1-D) once every masked one has landed; leaves those slots EMPTY
    again. All peers' slots are polled together, so once they have landed the wait is one
    L2 round trip rather than one per peer in turn. Volatile loads: each one goes to L2,
    where the peers' stores land, never to a stale L1 line."""
    words = tl.load(ptrs, mask=mask, other=0, volatile=True)
    high, low = _halves(words)
    while tl.max(((high == -1) | (low == -1)).to(tl.int32), axis=0) > 0:
        words = tl.load(ptrs, mask=mask, other=0, volatile=True)
        high, low = _halves(words)
    tl.store(ptrs, tl.full(words.shape, _EMPTY, tl.int64), mask=mask)
    return words


@triton.jit(do_not_specialize=["num_candidates", "data_rows", "stride_v", "stride_i",
                               "stride_o"])
def _tp_argmax_kernel(
    values_ptr, indices_ptr, out_ptr, data_ptrs, epochs_ptr,
    num_candidates, data_rows, stride_v, stride_i, stride_o,
    RANK: tl.constexpr, WORLD: tl.constexpr, WORLD_PAD: tl.constexpr, S_PAD: tl.constexpr,
    PDL: tl.constexpr,
):
    row = tl.program_id(0)
    cands = tl.arange(0, S_PAD)
    srcs = tl.arange(0, WORLD_PAD)
    # Everything after the wait: the candidates come from the kernel right before, and the
    # call count from this kernel's previous call, which may be that kernel.
    wait_for_prior_kernel(PDL)
    epoch = tl.load(epochs_ptr + row)
    half = (epoch & 1) * WORLD  # word layout [parity][src][data_rows]
    in_row = cands < num_candidates
    vals = tl.load(values_ptr + row * stride_v + cands, mask=in_row, other=float("-inf"))
    idxs = tl.load(indices_ptr + row * stride_i + cands, mask=in_row, other=_NO_INDEX)
    top, idx = best_candidate(vals, idxs)
    word = _pack(top, idx)
    # This rank's word goes to the same slot in every peer's buffer.
    slot = (half + RANK) * data_rows + row
    for peer in tl.static_range(WORLD):
        if peer != RANK:
            tl.store(rank_pointer(data_ptrs, peer, tl.int64) + slot, word)

    # Every peer's word at once ([WORLD_PAD]; this rank's own is not in its buffer).
    own_slots = rank_pointer(data_ptrs, RANK, tl.int64) + (half + srcs) * data_rows + row
    words = _take_words(own_slots, (srcs < WORLD) & (srcs != RANK))
    words = tl.where(srcs == RANK, word, words)
    high, low = _halves(words)
    _, best = best_candidate(high.to(tl.float32, bitcast=True),
                             tl.where(srcs < WORLD, low, _NO_INDEX))
    tl.store(out_ptr + row * stride_o, tl.where(best == _NO_INDEX, 0, best).to(tl.int64))
    tl.store(epochs_ptr + row, epoch + 1)


def tp_argmax_(
    values: torch.Tensor,  # [B, S] float32: this rank's candidates
    indices: torch.Tensor,  # [B, S] int32: their global indices
    out: torch.Tensor,  # [B] int64
    *,
    data_ptrs: torch.Tensor,  # [W] int64: every rank's word buffer (symmetric memory)
    epochs: torch.Tensor,  # [>= rows] int32: this rank's call count per row, zeroed
    rank: int,
    world_size: int,
    rows: int,  # rows per parity and rank in the word buffers, filled EMPTY before call 1
) -> torch.Tensor:
    """Into `out`, and returns it: the index of each row's best candidate over every rank's
    (see the top for the rule). Collective: every rank calls it with the same B."""
    num_rows, num_candidates = values.shape
    assert values.dtype == torch.float32 and indices.dtype == torch.int32, (
        f"values float32 / indices int32, got {values.dtype} / {indices.dtype}")
    assert indices.shape == values.shape, (tuple(indices.shape), tuple(values.shape))
    assert out.dtype == torch.int64 and out.shape == (num_rows,), (out.dtype, out.shape)
    assert 0 < num_candidates <= MAX_CANDIDATES, f"{num_candidates} candidates per row"
    assert num_candidates == 1 or values.stride(1) == indices.stride(1) == 1
    assert num_rows <= min(rows, epochs.shape[0]), f"{num_rows} rows, the buffers hold {rows}"
    assert data_ptrs.shape == (world_size,) and data_ptrs.dtype == torch.int64
    assert 0 <= rank < world_size, (rank, world_size)
    if num_rows == 0:
        return out
    pdl = pdl_enabled(values.device)
    _tp_argmax_kernel[(num_rows,)](
        values, indices, out, data_ptrs, epochs,
        num_candidates, rows, values.stride(0), indices.stride(0), out.stride(0),
        RANK=rank, WORLD=world_size, WORLD_PAD=triton.next_power_of_2(world_size),
        S_PAD=MAX_CANDIDATES, PDL=pdl, num_warps=1, launch_pdl=pdl,
    )
    return out
