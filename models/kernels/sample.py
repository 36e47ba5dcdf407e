"""Fused exponential-race sampling: one token per row from logits in one read.

Row b's token is argmax over v of `x[b, v] / T_b - log(-log(u(seed_b, step_b, v)))`, or argmax
of the logits when `T_b = 0`. `u` is `models.layers.sampler.hashed_uniform`'s splitmix64 hash,
computed on the fly, so the [B, V] noise tensor is never built. Programs `(row, split)` write
each vocab chunk's best to partials that `_combine_kernel` (or `models.parallel.tp_argmax`
across vocab shards, which hash global indices) reduces; every reduction keeps the lowest index
among equal values, so the token does not depend on block size or split count.

The hash words and u are bit-identical to the torch path's; the floats may differ by a few
ulps (inner log precise, outer log one MUFU.LG2, x / T as x * (1 / T)): a value is within
~2**-21 (|x / T| + |log E| + 1) of torch's, inside the tests' near-tie tolerance.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from models.sampling_hash import GAMMA, MIX1, MIX2, NO_INDEX, SEED_SALT

_U64 = (1 << 64) - 1
# The sampler's signed int64 splitmix64 constants as the unsigned literals uint64 math needs.
_GAMMA_U = tl.constexpr(GAMMA & _U64)
_MIX1_U = tl.constexpr(MIX1 & _U64)
_MIX2_U = tl.constexpr(MIX2 & _U64)
_SALT_U = tl.constexpr(SEED_SALT & _U64)
# An index no lane ever holds: nothing above -inf seen (-inf / NaN only, or an empty chunk).
_NO_INDEX = tl.constexpr(NO_INDEX)

# 8 elements a thread at 4 warps: one 16-byte bf16 load, and the uint64 hash fits in registers.
BLOCK = 1024
NUM_WARPS = 4
# Programs to aim for per SM (about one resident wave): the hash is ALU-bound.
PROGRAMS_PER_SM = 4
# The combine kernel's one fixed width: one compile per logits dtype, none mid-serving.
MAX_SPLITS = 256


@triton.jit
def _mix64(z):
    """splitmix64 finaliser on uint64 (multiplies wrap; >> on unsigned is logical)."""
    z = (z ^ (z >> 30)) * _MIX1_U
    z = (z ^ (z >> 27)) * _MIX2_U
    return z ^ (z >> 31)


@triton.jit
def best_candidate(vals, idxs):
    """(value, index) of the best 1-D candidate: the largest value, the lowest index among
    equals; NaN, -inf and NO_INDEX never win; (-inf, NO_INDEX) when none is left."""
    ok = (vals > float("-inf")) & (idxs != _NO_INDEX)  # NaN > -inf is False
    vals = tl.where(ok, vals, float("-inf"))
    top = tl.max(vals, axis=0)
    idx = tl.min(tl.where(ok & (vals == top), idxs, _NO_INDEX), axis=0)
    return top, idx


@triton.jit
def _race_noise(counter, LIBDEVICE: tl.constexpr):
    """log(E) for E = -log(u), u the hash of each lane's counter word."""
    bits = _mix64(counter)
    # u = (m + 0.5) / 2**23 for the top 23 bits m, as m * 2**-23 + 2**-24: the same float32
    # (every step is exact), in one FMA that also shows the compiler u is normal, so
    # __nv_logf's subnormal / zero fix-ups fold away.
    u = (bits >> 41).to(tl.float32) * (1.0 / 8388608.0) + (0.5 / 8388608.0)
    # Inner log precise, outer one MUFU.LG2; the interpreter has no libdevice.
    return libdevice.fast_logf(-libdevice.log(u)) if LIBDEVICE else tl.log(-tl.log(u))


@triton.jit(do_not_specialize=["vocab_size", "vocab_offset", "stride_row", "chunk",
                               "num_splits"])
def _race_partial_kernel(
    logits_ptr, temps_ptr, seeds_ptr, steps_ptr, part_val_ptr, part_idx_ptr, mask_ptr,
    vocab_size, vocab_offset, stride_row, stride_mask, chunk, num_splits,
    BLOCK: tl.constexpr, LIBDEVICE: tl.constexpr, HAS_MASK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    temp = tl.load(temps_ptr + row)
    # 1/T rounded once per row: a multiply an element instead of div_rn's ~10 instructions
    # (greedy rows never use it; the where keeps 1/0 out of the interpreter).
    inv_temp = tl.math.div_rn(tl.full([], 1.0, tl.float32), tl.where(temp > 0, temp, 1.0))
    seed = tl.load(seeds_ptr + row).to(tl.uint64, bitcast=True)
    step = tl.load(steps_ptr + row).to(tl.uint64, bitcast=True)
    # The row's splitmix64 state; the global vocab index (plus one) is its counter.
    key = _mix64(_mix64(seed ^ _SALT_U) + step * _GAMMA_U)

    lanes = tl.arange(0, BLOCK)
    best_val = tl.full([BLOCK], float("-inf"), tl.float32)
    best_idx = tl.full([BLOCK], _NO_INDEX, tl.int32)
    start = split * chunk
    end = tl.minimum(start + chunk, vocab_size)
    row_ptr = logits_ptr + row * stride_row
    # key + (v + 1) * GAMMA for each lane's global vocab index v, advanced a tile at a time:
    # one 64-bit add a tile instead of a 64-bit multiply (the same words, mod 2**64).
    counter = key + (vocab_offset + start + 1 + lanes).to(tl.uint64) * _GAMMA_U  # [BLOCK]
    tile_step = tl.full([], BLOCK, tl.uint64) * _GAMMA_U
    log_e = tl.zeros([BLOCK], tl.float32)  # the noise of the tile the loop reads next
    if temp > 0:
        log_e = _race_noise(counter, LIBDEVICE)
    for tile in range(start, end, BLOCK):
        offs = tile + lanes  # [BLOCK] int32 local column indices
        in_row = offs < end
        x = tl.load(row_ptr + offs, mask=in_row, other=float("-inf")).to(tl.float32)
        if HAS_MASK:  # token v may be drawn iff bit v % 32 of word v // 32 is set
            words = tl.load(mask_ptr + row * stride_mask + (offs >> 5), mask=in_row, other=0)
            x = tl.where(((words >> (offs & 31)) & 1) != 0, x, float("-inf"))
        if temp > 0:
            noise = log_e
            # The next tile's noise while this tile's load is in flight (none past the end).
            counter += tile_step
            if tile + BLOCK < end:
                log_e = _race_noise(counter, LIBDEVICE)
            x = x * inv_temp - noise
        # Each lane sees increasing indices, so '>' keeps the first of equal values. Entries
        # past the row end load -inf and stay -inf; -inf and NaN never claim a lane.
        better = x > best_val
        best_val = tl.where(better, x, best_val)
        best_idx = tl.where(better, offs, best_idx)

    top, idx = best_candidate(best_val, best_idx)
    idx = tl.where(idx == _NO_INDEX, _NO_INDEX, idx + vocab_offset)  # global
    tl.store(part_val_ptr + row * num_splits + split, top)
    tl.store(part_idx_ptr + row * num_splits + split, idx)


@triton.jit(do_not_specialize=["num_splits"])
def _combine_kernel(part_val_ptr, part_idx_ptr, tokens_ptr, num_splits,
                    SPLITS_PAD: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    splits = tl.arange(0, SPLITS_PAD)
    ok = splits < num_splits
    vals = tl.load(part_val_ptr + row * num_splits + splits, mask=ok, other=float("-inf"))
    idxs = tl.load(part_idx_ptr + row * num_splits + splits, mask=ok, other=_NO_INDEX)
    _, idx = best_candidate(vals, idxs)
    # Nothing above -inf in the row (all -inf, or NaN): 0, torch.argmax's answer for -inf.
    idx = tl.where(idx == _NO_INDEX, 0, idx)
    tl.store(tokens_ptr + row, idx.to(tl.int64))


def choose_splits(num_rows: int, vocab_size: int, num_sms: int, block: int = BLOCK) -> int:
    """Vocab chunks per row: about PROGRAMS_PER_SM programs per SM in all, at most one per
    tile."""
    target = PROGRAMS_PER_SM * num_sms
    tiles = triton.cdiv(vocab_size, block)
    return max(1, min(triton.cdiv(target, max(num_rows, 1)), tiles, MAX_SPLITS))


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # the interpreter (CPU tensors): a few splits so the combine is exercised


def race_partials(logits: torch.Tensor, temperatures: torch.Tensor, seeds: torch.Tensor,
                  steps: torch.Tensor, *, vocab_offset: int = 0, num_splits: int | None = None,
                  block: int = BLOCK, bitmask: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Each vocab chunk's race winner: (part_val float32 [B, S], part_idx int32 [B, S]).

    logits [B, V] hold the global columns [vocab_offset, vocab_offset + V); temperatures
    float32 [B] (0 = greedy); seeds, steps int64 [B]; bitmask int32 [B, ceil(V / 32)] or
    None: tokens whose bit is clear are never drawn (whole rows only, vocab_offset 0). A
    partial is the chunk's best value and global index, (-inf, NO_INDEX) if nothing is above
    -inf. No host sync.
    """
    num_rows, vocab_size = logits.shape
    assert temperatures.shape == seeds.shape == steps.shape == (num_rows,), (
        f"per-row tensors must be [{num_rows}], got {tuple(temperatures.shape)}, "
        f"{tuple(seeds.shape)}, {tuple(steps.shape)}")
    assert seeds.dtype == torch.int64 and steps.dtype == torch.int64, "seeds/steps: int64"
    assert 0 <= vocab_offset < vocab_offset + vocab_size < NO_INDEX, (
        f"vocab columns [{vocab_offset}, {vocab_offset + vocab_size}) out of range")
    assert block & (block - 1) == 0, f"block must be a power of two, got {block}"
    if num_splits is None:
        num_splits = choose_splits(num_rows, vocab_size, _num_sms(logits.device), block)
    assert 1 <= num_splits <= MAX_SPLITS, f"num_splits must be in [1, {MAX_SPLITS}]"
    part_val = torch.empty(num_rows, num_splits, dtype=torch.float32, device=logits.device)
    part_idx = torch.empty(num_rows, num_splits, dtype=torch.int32, device=logits.device)
    if num_rows == 0:
        return part_val, part_idx
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    # Per-row values are read at base + row: make them dense (no-ops for the sampler's).
    temperatures = temperatures.to(torch.float32).contiguous()
    seeds, steps = seeds.contiguous(), steps.contiguous()
    if bitmask is not None:
        assert vocab_offset == 0 and bitmask.dtype == torch.int32 and bitmask.shape == (
            num_rows, triton.cdiv(vocab_size, 32)), "bitmask: int32 [B, ceil(V / 32)]"
    # Chunks are whole tiles so only the row's last tile is ragged.
    chunk = triton.cdiv(triton.cdiv(vocab_size, num_splits), block) * block
    _race_partial_kernel[(num_rows, num_splits)](
        logits, temperatures, seeds, steps, part_val, part_idx,
        bitmask if bitmask is not None else part_idx,  # never read without HAS_MASK
        vocab_size, vocab_offset, logits.stride(0),
        bitmask.stride(0) if bitmask is not None else 0, chunk, num_splits,
        BLOCK=block, LIBDEVICE=not triton.knobs.runtime.interpret,
        HAS_MASK=bitmask is not None, num_warps=NUM_WARPS,
    )
    return part_val, part_idx


def race_argmax(logits: torch.Tensor, temperatures: torch.Tensor, seeds: torch.Tensor,
                steps: torch.Tensor, *, vocab_offset: int = 0, num_splits: int | None = None,
                block: int = BLOCK, bitmask: torch.Tensor | None = None) -> torch.Tensor:
    """int64 [B]: `race_perturbed(logits / T, seeds, steps).argmax(-1)` for T > 0 rows,
    `logits.argmax(-1)` for T = 0, with nothing [B, V] built (arguments: race_partials)."""
    part_val, part_idx = race_partials(logits, temperatures, seeds, steps,
                                       vocab_offset=vocab_offset, num_splits=num_splits,
                                       block=block, bitmask=bitmask)
    num_rows, num_splits = part_val.shape
    tokens = torch.empty(num_rows, dtype=torch.int64, device=logits.device)
    if num_rows == 0:
        return tokens
    _combine_kernel[(num_rows,)](part_val, part_idx, tokens, num_splits,
                                 SPLITS_PAD=MAX_SPLITS, num_warps=1)
    return tokens
