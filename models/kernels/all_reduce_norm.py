"""One kernel for a row-parallel layer's epilogue: all-reduce + residual add + RMSNorm.

At batch-1 decode a tensor-parallel decoder layer ends twice in "sum the ranks' partial
outputs, add the residual, RMS-normalize": as separate kernels that is a symmetric-memory
all-reduce with two cross-GPU barriers (~7-8 us on H200s) and an add-RMSNorm kernel, each
with its launch gap. Here one program per token row does all of it with ONE barrier:

1. push: write this rank's partial row into every peer's symmetric buffer (NVLink stores
   are posted, so no round trip is waited for), at slot [parity][row][src rank];
2. signal: after a CTA barrier, store a flag into each peer with release semantics at
   system scope (the data stores above are visible to the peer before the flag is);
3. wait: spin on this rank's own flags with acquire loads until every peer's flag for this
   call has arrived;
4. sum the ranks' rows in rank order 0..W-1 in float32 (the same order on every rank, so
   every rank gets bit-identical hidden states), round to the model dtype (as the
   all-reduce's output would be), add the residual, RMS-normalize; write the new residual
   and the normalized row.

Why one barrier is enough: each row slot counts its calls in a per-rank `epochs` array
(every rank makes the same calls, so the counts agree). Data alternates between two halves
by the count's parity, and flags carry the count itself (monotonic, compared with wrap-
around). Before a rank overwrites a half in call k+2, it has passed call k+1's barrier,
whose flags each peer sent only after it finished reading call k's data from that half.
Flags and counts live on the device and advance in the kernel, so a CUDA graph of these
calls replays correctly any number of times.

All ranks must launch the same calls with the same row counts (they do: TP ranks run the
same forward), or the barrier waits forever.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from models.kernels.pdl import pdl_enabled, wait_for_prior_kernel


@triton.jit
def _store_release(addrs, values):
    """st.release.sys of `values` to `addrs` (elementwise; replicated lanes store the same
    value to the same address, which is harmless)."""
    return tl.inline_asm_elementwise(
        "mov.u32 $0, 0; st.global.release.sys.u32 [$1], $2;",
        "=r,l,r", [addrs, values], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _wait_acquire(addrs, targets):
    """Spin with ld.acquire.sys until each flag has reached its target (wrap-safe signed
    difference); returns the flags seen."""
    return tl.inline_asm_elementwise(
        """
        {
            .reg .u32 %flag;
            .reg .s32 %diff;
            .reg .pred %early;
            wait_flag:
                ld.global.acquire.sys.u32 %flag, [$1];
                sub.s32 %diff, %flag, $2;
                setp.lt.s32 %early, %diff, 0;
                @%early bra wait_flag;
            mov.u32 $0, %flag;
        }
        """,
        "=r,l,r", [addrs, targets], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _all_reduce_add_rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr,
    data_ptrs, flag_ptrs, epochs_ptr,
    eps, hidden, flag_rows, data_rows,
    stride_x, stride_r, stride_o, stride_ro,
    RANK: tl.constexpr, WORLD: tl.constexpr, BLOCK_H: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_prior_kernel(PDL)  # x is the previous kernel's output
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK_H)
    mask = offs < hidden
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)  # [BLOCK_H] partial
    dtype = x.dtype
    epoch = tl.load(epochs_ptr + row)
    half = (epoch & 1) * WORLD  # data layout [parity][src][data_rows][hidden]
    # This rank's row goes to the same place in every peer's buffer.
    slot = ((half + RANK) * data_rows + row).to(tl.int64) * hidden
    for peer in tl.static_range(WORLD):
        if peer != RANK:
            peer_data = tl.load(data_ptrs + peer).to(tl.pointer_type(dtype))
            tl.store(peer_data + slot + offs, x, mask=mask)
    tl.debug_barrier()  # every lane's stores are issued before the flags go out

    # flags[src][row] in each rank's buffer hold src's call count for the row. Tell every
    # rank (ourselves too, which keeps the wait below uniform) that this call's row landed,
    # then wait until every rank's has.
    ranks = tl.arange(0, WORLD)
    target = tl.zeros([WORLD], dtype=tl.int32) + epoch + 1
    flags = tl.load(flag_ptrs + ranks).to(tl.pointer_type(tl.int32))  # [WORLD]
    _store_release(flags + RANK * flag_rows + row, target)
    own_flags = tl.load(flag_ptrs + RANK).to(tl.pointer_type(tl.int32))
    _wait_acquire(own_flags + ranks * flag_rows + row, target)
    tl.debug_barrier()  # every lane reads after the flags were seen

    own_data = tl.load(data_ptrs + RANK).to(tl.pointer_type(dtype))
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for src in tl.static_range(WORLD):  # rank order on every rank: identical sums
        if src == RANK:
            acc += x.to(tl.float32)
        else:
            src_slot = ((half + src) * data_rows + row).to(tl.int64) * hidden
            acc += tl.load(own_data + src_slot + offs, mask=mask, other=0.0,
                           cache_modifier=".cv").to(tl.float32)
    reduced = acc.to(dtype)  # what the all-reduce would have returned
    residual = tl.load(residual_ptr + row * stride_r + offs, mask=mask, other=0.0)
    h = (reduced.to(tl.float32) + residual.to(tl.float32)).to(dtype)  # the new residual
    h32 = h.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(h32 * h32, axis=0) / hidden + eps)
    weight = tl.load(weight_ptr + offs, mask=mask, other=0.0)
    out = weight.to(tl.float32) * (h32 * rstd).to(dtype).to(tl.float32)
    tl.store(residual_out_ptr + row * stride_ro + offs, h, mask=mask)
    tl.store(out_ptr + row * stride_o + offs, out.to(dtype), mask=mask)
    tl.store(epochs_ptr + row, epoch + 1)


def all_reduce_add_rms_norm(
    x: torch.Tensor,  # [M, hidden] this rank's partial sum
    residual: torch.Tensor,  # [M, hidden]
    weight: torch.Tensor,  # [hidden]
    eps: float,
    *,
    data_ptrs: torch.Tensor,  # [W] int64: every rank's data region (symmetric memory)
    data_bytes: int,  # size of each data region
    flag_ptrs: torch.Tensor,  # [W] int64: every rank's int32 flags [W, flag_rows], zeroed
    epochs: torch.Tensor,  # [flag_rows] int32: this rank's call count per row, zeroed
    rank: int,
    world_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(sum_ranks(x) + residual) * weight, sum_ranks(x) + residual), both [M,
    hidden] in x's dtype. Collective: every rank calls it with the same M, hidden and dtype
    (calls of another hidden size or dtype use another data layout: a barrier must separate
    them)."""
    num_rows, hidden = x.shape
    flag_rows = epochs.shape[0]
    # Rows per half and rank in the data region: the layout every call of this hidden size
    # and dtype shares.
    rows = min(flag_rows, data_bytes // (2 * world_size * hidden * x.element_size()))
    assert 0 < num_rows <= rows, f"{num_rows} rows, the buffers hold {rows}"
    assert world_size >= 2 and world_size & (world_size - 1) == 0, world_size
    assert residual.shape == x.shape and residual.dtype == x.dtype
    assert weight.shape == (hidden,) and weight.is_contiguous()
    assert x.stride(1) == residual.stride(1) == 1
    out = torch.empty_like(x)
    residual_out = torch.empty_like(x)
    block_h = triton.next_power_of_2(hidden)
    pdl = pdl_enabled(x.device)
    _all_reduce_add_rms_norm_kernel[(num_rows,)](
        x, residual, weight, out, residual_out,
        data_ptrs, flag_ptrs, epochs,
        eps, hidden, flag_rows, rows,
        x.stride(0), residual.stride(0), out.stride(0), residual_out.stride(0),
        RANK=rank, WORLD=world_size, BLOCK_H=block_h, PDL=pdl,
        num_warps=4 if block_h <= 2048 else 8, launch_pdl=pdl,
    )
    return out, residual_out
