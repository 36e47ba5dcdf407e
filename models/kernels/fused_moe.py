"""Fused mixture-of-experts on the GPU: grouped GEMMs over (token, expert) slots sorted by expert.

Slot s = t * top_k + j is token t's j-th choice. `fused_topk` routes in one launch; `fused_moe`
then runs `moe_align` (sort this rank's slots by local expert, each expert's run padded with the
sentinel slot T * top_k to a multiple of BLOCK_M), `_gate_up_kernel` (h = silu(gate) * up in
fp32), `_down_kernel` (y = h @ w2^T times the routing weight) and `_sum_kernel` (out[t] = the
sum over j of y[t * top_k + j], skipping other ranks' experts). Buffers are sized from
(T, top_k, E_local, BLOCK_M) alone and nothing is read back to the host, so a call can be
captured in a CUDA graph; the sum's order is fixed, so results are deterministic.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@dataclass(frozen=True)
class GemmTile:
    block_n: int  # output columns per program
    block_k: int  # reduction elements per loop step
    num_warps: int = 4
    num_stages: int = 3


@dataclass(frozen=True)
class MoeConfig:
    """Launch choice of `fused_moe`; a pure function of the shape via `choose_config`."""

    block_m: int  # slots per program; each expert's run is padded to a multiple of it
    gate_up: GemmTile
    down: GemmTile
    group_m: int = 8  # M-blocks whose programs run next to each other (L2 reuse of weights)


# 16-bit configs by expected slots per local expert (T * top_k / E_local), swept for the
# Qwen3-30B-A3B experts on an H100.
_BF16_TABLE: tuple[tuple[float, MoeConfig], ...] = (
    (4, MoeConfig(16, GemmTile(64, 128, 4, 4), GemmTile(64, 128, 4, 4))),
    (32, MoeConfig(32, GemmTile(64, 128, 4, 4), GemmTile(64, 128, 4, 4))),
    (128, MoeConfig(64, GemmTile(64, 64, 4, 4), GemmTile(128, 64, 4, 4))),
    (float("inf"), MoeConfig(128, GemmTile(128, 64, 8, 4), GemmTile(128, 64, 4, 3))),
)
# fp32 takes Triton's exact (IEEE) dot: half the tile bytes fit per stage.
_FP32_CONFIG = MoeConfig(32, GemmTile(64, 32, 4, 3), GemmTile(64, 32, 4, 3))


def choose_config(num_tokens: int, top_k: int, num_local_experts: int,
                  dtype: torch.dtype) -> MoeConfig:
    if dtype == torch.float32:
        return _FP32_CONFIG
    per_expert = num_tokens * top_k / num_local_experts
    return next(config for limit, config in _BF16_TABLE if per_expert <= limit)


def max_sorted_slots(num_tokens: int, top_k: int, num_local_experts: int, block_m: int) -> int:
    """Upper bound of the padded sorted-slot list, a multiple of block_m. At most
    min(E_local, T * top_k) experts hold slots, each padding by fewer than block_m."""
    num_slots = num_tokens * top_k
    bound = num_slots + min(num_local_experts, num_slots) * (block_m - 1)
    return triton.cdiv(bound, block_m) * block_m


@triton.jit(do_not_specialize=["num_tokens"])
def _topk_kernel(
    logits_ptr, weights_ptr, ids_ptr, num_tokens, num_experts, stride_lt,
    TOP_K: tl.constexpr, K_PAD: tl.constexpr, E_PAD: tl.constexpr, BLOCK_T: tl.constexpr,
    RENORMALIZE: tl.constexpr,
):
    # logits [T, E] -> weights [T, TOP_K] fp32, ids [T, TOP_K] int32
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, E_PAD)
    row_ok = rows < num_tokens
    x = tl.load(logits_ptr + rows[:, None].to(tl.int64) * stride_lt + cols[None, :],
                mask=row_ok[:, None] & (cols < num_experts)[None, :], other=0.0).to(tl.float32)
    x = tl.where(cols[None, :] < num_experts, x, float("-inf"))
    p = tl.exp(x - tl.max(x, 1)[:, None])
    p = p / tl.sum(p, 1)[:, None]
    p = tl.where(cols[None, :] < num_experts, p, -1.0)  # padding never wins, even over a 0
    kcols = tl.arange(0, K_PAD)[None, :]
    weights = tl.zeros((BLOCK_T, K_PAD), dtype=tl.float32)
    ids = tl.zeros((BLOCK_T, K_PAD), dtype=tl.int32)
    for j in tl.static_range(TOP_K):
        best = tl.argmax(p, 1)  # the lowest index among equal values
        weights = tl.where(kcols == j, tl.max(p, 1)[:, None], weights)
        ids = tl.where(kcols == j, best[:, None], ids)
        p = tl.where(cols[None, :] == best[:, None], -1.0, p)
    if RENORMALIZE:
        weights = weights / tl.sum(weights, 1)[:, None]
    out = rows[:, None] * TOP_K + kcols
    mask = row_ok[:, None] & (kcols < TOP_K)
    tl.store(weights_ptr + out, weights, mask=mask)
    tl.store(ids_ptr + out, ids, mask=mask)


def fused_topk(router_logits: torch.Tensor, top_k: int, renormalize: bool
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """select_experts in one launch: router_logits [T, E] -> (topk_weights [T, k] float32,
    topk_ids [T, k] int32). Softmax in float32, the k largest (the lowest expert id among
    equal probabilities), optionally rescaled to sum to 1."""
    num_tokens, num_experts = router_logits.shape
    assert router_logits.stride(1) == 1, "router logits' rows not contiguous"
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=router_logits.device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int32, device=router_logits.device)
    if num_tokens == 0:
        return weights, ids
    e_pad = triton.next_power_of_2(num_experts)
    block_t = min(max(1, 2048 // e_pad), triton.next_power_of_2(num_tokens))
    _topk_kernel[(triton.cdiv(num_tokens, block_t),)](
        router_logits, weights, ids, num_tokens, num_experts, router_logits.stride(0),
        TOP_K=top_k, K_PAD=triton.next_power_of_2(top_k), E_PAD=e_pad, BLOCK_T=block_t,
        RENORMALIZE=renormalize, num_warps=4,
    )
    return weights, ids


@triton.jit
def _local_expert(topk_ids_ptr, slots, num_slots, first_expert, NUM_LOCAL: tl.constexpr):
    """Local expert of each slot; NUM_LOCAL for slots past the end or on another rank."""
    in_range = slots < num_slots
    expert = tl.load(topk_ids_ptr + slots, mask=in_range, other=-1).to(tl.int32) - first_expert
    return tl.where(in_range & (expert >= 0) & (expert < NUM_LOCAL), expert, NUM_LOCAL)


@triton.jit(do_not_specialize=["num_slots", "first_expert"])
def _count_kernel(topk_ids_ptr, counts_ptr, num_slots, first_expert,
                  NUM_LOCAL: tl.constexpr, BINS: tl.constexpr, CHUNK: tl.constexpr):
    # counts [num_chunks, BINS]: slots of each local expert in each chunk of CHUNK slots
    chunk = tl.program_id(0)
    slots = chunk * CHUNK + tl.arange(0, CHUNK)
    experts = _local_expert(topk_ids_ptr, slots, num_slots, first_expert, NUM_LOCAL)
    tl.store(counts_ptr + chunk * BINS + tl.arange(0, BINS), tl.histogram(experts, BINS))


@triton.jit(do_not_specialize=["num_slots", "first_expert", "max_blocks"])
def _align_kernel(
    topk_ids_ptr, counts_ptr, sorted_slots_ptr, block_experts_ptr,
    num_slots, first_expert, max_blocks,
    NUM_LOCAL: tl.constexpr, BINS: tl.constexpr, BLOCK_M: tl.constexpr, CHUNK: tl.constexpr,
    CHUNKS_PAD: tl.constexpr, COUNTED: tl.constexpr, BLOCKS: tl.constexpr,
):
    # One program per chunk of CHUNK slots; COUNTED: _count_kernel's histograms are in
    # counts, else there is one chunk and it counts its own.
    chunk = tl.program_id(0)
    num_chunks = tl.num_programs(0)
    bins = tl.arange(0, BINS)
    offs = tl.arange(0, CHUNK)
    experts = _local_expert(topk_ids_ptr, chunk * CHUNK + offs, num_slots, first_expert,
                            NUM_LOCAL)
    if COUNTED:
        rows = tl.arange(0, CHUNKS_PAD)[:, None]
        counts = tl.load(counts_ptr + rows * BINS + bins[None, :], mask=rows < num_chunks,
                         other=0)  # [CHUNKS_PAD, BINS]
        totals = tl.sum(counts, 0)
        mine = tl.sum(tl.where(rows == chunk, counts, 0), 0)
        before = tl.sum(tl.where(rows < chunk, counts, 0), 0)  # earlier chunks' slots
    else:
        mine = tl.histogram(experts, BINS)
        totals = mine
        before = tl.zeros([BINS], dtype=tl.int32)
    padded = tl.where(bins < NUM_LOCAL, tl.cdiv(totals, BLOCK_M) * BLOCK_M, 0)
    run_starts = tl.cumsum(padded, 0) - padded
    # The chunk's slots sorted by (expert, slot); an expert's k-th one goes to its run's
    # start + the earlier chunks' count + k. Slots of other ranks (NUM_LOCAL) sort last.
    keys = tl.sort(experts * CHUNK + offs)
    sorted_experts = keys // CHUNK
    firsts = tl.cumsum(mine, 0) - mine  # where each expert's keys begin
    dest = tl.gather(run_starts + before - firsts, sorted_experts, 0) + offs
    tl.store(sorted_slots_ptr + dest, chunk * CHUNK + keys % CHUNK,
             mask=sorted_experts < NUM_LOCAL)
    # The sentinel after each expert's slots up to its run's end; columns over programs.
    local = bins < NUM_LOCAL
    for j in range(chunk, BLOCK_M, num_chunks):
        tl.store(sorted_slots_ptr + run_starts + totals + j,
                 tl.zeros([BINS], dtype=tl.int32) + num_slots, mask=local & (j < padded - totals))
    # Block b belongs to the number of runs that end at or before its first row; -1 past them.
    run_ends = run_starts + padded
    used_blocks = tl.sum(padded) // BLOCK_M
    for first in range(chunk * BLOCKS, max_blocks, num_chunks * BLOCKS):
        blocks = first + tl.arange(0, BLOCKS)
        ended = (blocks[:, None] * BLOCK_M >= run_ends[None, :]) & local[None, :]
        expert = tl.where(blocks < used_blocks, tl.sum(ended.to(tl.int32), 1), -1)
        tl.store(block_experts_ptr + blocks, expert, mask=blocks < max_blocks)


# Slots per alignment program: one program up to _ALIGN_CHUNK slots, else a counting launch
# first. Few fixed chunk sizes and a padded chunk count keep compiles to the warm-up.
_ALIGN_SMALL_CHUNK = 256
_ALIGN_CHUNK = 1024
_ALIGN_MAX_CHUNKS = 64


def moe_align(topk_ids: torch.Tensor, first_expert: int, num_local_experts: int,
              block_m: int, max_chunk: int | None = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """topk_ids [T, k] (global ids) -> (sorted_slots int32 [max_sorted_slots], block_experts
    int32 [max_sorted_slots / block_m], -1 past the used blocks). `max_chunk`: for tests."""
    num_tokens, top_k = topk_ids.shape
    num_slots = num_tokens * top_k
    device = topk_ids.device
    size = max_sorted_slots(num_tokens, top_k, num_local_experts, block_m)
    sorted_slots = torch.empty(size, dtype=torch.int32, device=device)
    block_experts = torch.empty(size // block_m, dtype=torch.int32, device=device)
    bins = triton.next_power_of_2(num_local_experts + 1)  # + the bin of other ranks' slots
    max_chunk = max_chunk or _ALIGN_CHUNK
    small = min(_ALIGN_SMALL_CHUNK, max_chunk)
    if num_slots <= small:
        chunk = small
    elif num_slots <= max_chunk:
        chunk = max_chunk
    else:
        chunk = max(max_chunk, triton.next_power_of_2(triton.cdiv(num_slots,
                                                                  _ALIGN_MAX_CHUNKS)))
    num_chunks = triton.cdiv(num_slots, chunk)
    counts = torch.empty(num_chunks, bins, dtype=torch.int32, device=device)
    if num_chunks > 1:
        _count_kernel[(num_chunks,)](topk_ids, counts, num_slots, first_expert,
                                     NUM_LOCAL=num_local_experts, BINS=bins, CHUNK=chunk,
                                     num_warps=4)
    _align_kernel[(num_chunks,)](
        topk_ids, counts, sorted_slots, block_experts,
        num_slots, first_expert, size // block_m,
        NUM_LOCAL=num_local_experts, BINS=bins, BLOCK_M=block_m, CHUNK=chunk,
        CHUNKS_PAD=_ALIGN_MAX_CHUNKS, COUNTED=num_chunks > 1,
        BLOCKS=max(16, 4096 // bins), num_warps=8 if num_chunks > 1 else 4,
    )
    return sorted_slots, block_experts


@triton.jit
def _tile(pid, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """Program -> (M-block, N-tile), GROUP_M M-blocks per column sweep: neighbouring programs
    share an expert's weight tiles while they are in L2."""
    in_group = GROUP_M * num_pid_n
    first_m = (pid // in_group) * GROUP_M
    group_size = min(num_pid_m - first_m, GROUP_M)
    return first_m + (pid % in_group) % group_size, (pid % in_group) // group_size


@triton.jit
def _block(block_experts_ptr, sorted_slots_ptr, num_slots, num_m_blocks, N,
           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """This program's tile: (expert or -1, sorted positions, slots, real-slot rows, output
    columns, their mask)."""
    pid_m, pid_n = _tile(tl.program_id(0), num_m_blocks, tl.cdiv(N, BLOCK_N), GROUP_M)
    expert = tl.load(block_experts_ptr + pid_m)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    slots = tl.load(sorted_slots_ptr + offs_m)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    return expert, offs_m, slots, slots < num_slots, offs_n, offs_n < N


@triton.jit(do_not_specialize=["num_slots", "num_m_blocks"])
def _gate_up_kernel(
    x_ptr, w_ptr, h_ptr, sorted_slots_ptr, block_experts_ptr,
    num_slots, num_m_blocks, N, K,
    stride_xt, stride_we, stride_wn, stride_hm,
    TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, EVEN_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    # x [T, K]; w [E_local, 2N, K] (gate rows, then up rows); h [sorted, N]
    expert, offs_m, slots, rows, offs_n, cols = _block(
        block_experts_ptr, sorted_slots_ptr, num_slots, num_m_blocks, N, BLOCK_M, BLOCK_N,
        GROUP_M)
    if expert < 0:
        return
    tokens = (slots // TOP_K).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + tokens[:, None] * stride_xt + offs_k[None, :]
    gate_ptrs = (w_ptr + expert.to(tl.int64) * stride_we + offs_n[None, :] * stride_wn
                 + offs_k[:, None])
    up_ptrs = gate_ptrs + N * stride_wn
    gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            a = tl.load(x_ptrs, mask=rows[:, None], other=0.0)
            wg = tl.load(gate_ptrs, mask=cols[None, :], other=0.0)
            wu = tl.load(up_ptrs, mask=cols[None, :], other=0.0)
        else:
            k_ok = offs_k < K - k * BLOCK_K
            a = tl.load(x_ptrs, mask=rows[:, None] & k_ok[None, :], other=0.0)
            wg = tl.load(gate_ptrs, mask=k_ok[:, None] & cols[None, :], other=0.0)
            wu = tl.load(up_ptrs, mask=k_ok[:, None] & cols[None, :], other=0.0)
        gate = tl.dot(a, wg, gate, input_precision=DOT_PRECISION)
        up = tl.dot(a, wu, up, input_precision=DOT_PRECISION)
        x_ptrs += BLOCK_K
        gate_ptrs += BLOCK_K
        up_ptrs += BLOCK_K
    h = gate * tl.sigmoid(gate) * up
    tl.store(h_ptr + offs_m[:, None].to(tl.int64) * stride_hm + offs_n[None, :],
             h.to(h_ptr.dtype.element_ty), mask=cols[None, :])


@triton.jit(do_not_specialize=["num_slots", "num_m_blocks"])
def _down_kernel(
    h_ptr, w_ptr, y_ptr, topk_weights_ptr, sorted_slots_ptr, block_experts_ptr,
    num_slots, num_m_blocks, N, K,
    stride_hm, stride_we, stride_wn, stride_ys,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, EVEN_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    # h [sorted, K]; w [E_local, N, K]; y [num_slots, N]; topk_weights [num_slots] fp32
    expert, offs_m, slots, rows, offs_n, cols = _block(
        block_experts_ptr, sorted_slots_ptr, num_slots, num_m_blocks, N, BLOCK_M, BLOCK_N,
        GROUP_M)
    if expert < 0:
        return
    offs_k = tl.arange(0, BLOCK_K)
    h_ptrs = h_ptr + offs_m[:, None].to(tl.int64) * stride_hm + offs_k[None, :]
    w_ptrs = (w_ptr + expert.to(tl.int64) * stride_we + offs_n[None, :] * stride_wn
              + offs_k[:, None])
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            a = tl.load(h_ptrs)
            w = tl.load(w_ptrs, mask=cols[None, :], other=0.0)
        else:
            k_ok = offs_k < K - k * BLOCK_K
            a = tl.load(h_ptrs, mask=k_ok[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=k_ok[:, None] & cols[None, :], other=0.0)
        acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
        h_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    acc *= tl.load(topk_weights_ptr + slots, mask=rows, other=0.0)[:, None]
    tl.store(y_ptr + slots[:, None].to(tl.int64) * stride_ys + offs_n[None, :],
             acc.to(y_ptr.dtype.element_ty), mask=rows[:, None] & cols[None, :])


@triton.jit(do_not_specialize=["first_expert"])
def _sum_kernel(
    y_ptr, topk_ids_ptr, out_ptr, first_expert, N, stride_ys, stride_ot,
    TOP_K: tl.constexpr, NUM_LOCAL: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # y [T * TOP_K, N] -> out [T, N]
    token = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = offs < N
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        slot = token * TOP_K + j
        expert = tl.load(topk_ids_ptr + slot).to(tl.int32) - first_expert
        # Another rank's expert masks the whole row (a scalar bound, not a branch).
        width = tl.where((expert >= 0) & (expert < NUM_LOCAL), N, 0)
        acc += tl.load(y_ptr + slot * stride_ys + offs, mask=offs < width,
                       other=0.0).to(tl.float32)
    tl.store(out_ptr + token * stride_ot + offs, acc.to(out_ptr.dtype.element_ty), mask=cols)


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, first_expert: int = 0,
              config: MoeConfig | None = None) -> torch.Tensor:
    """sum_j topk_weights[t, j] * down(silu(gate(x[t])) * up(x[t])) over the choices whose
    expert is in [first_expert, first_expert + E_local): this rank's partial sum, fp32 accum.
    x [T, H]; w13 [E_local, 2I, H] (gate | up); w2 [E_local, H, I]; topk [T, k] -> [T, H]."""
    num_tokens, hidden = x.shape
    num_local, two_i, _ = w13.shape
    inter = two_i // 2
    top_k = topk_ids.shape[1]
    assert x.dtype in _DTYPES and w13.dtype == x.dtype and w2.dtype == x.dtype, (
        f"x {x.dtype}, w13 {w13.dtype}, w2 {w2.dtype}: one of {_DTYPES}")
    assert w13.shape == (num_local, 2 * inter, hidden), f"w13 {tuple(w13.shape)}"
    assert w2.shape == (num_local, hidden, inter), f"w2 {tuple(w2.shape)}"
    assert topk_ids.shape == topk_weights.shape == (num_tokens, top_k), (
        f"topk_ids {tuple(topk_ids.shape)}, topk_weights {tuple(topk_weights.shape)}")
    assert topk_weights.dtype == torch.float32, "routing weights are float32"
    assert x.stride(1) == 1 and w13.stride(2) == 1 and w2.stride(2) == 1, "rows not contiguous"
    topk_ids = topk_ids.contiguous()
    topk_weights = topk_weights.contiguous()
    out = torch.empty_like(x)
    if num_tokens == 0:
        return out
    if config is None:
        config = choose_config(num_tokens, top_k, num_local, x.dtype)
    num_slots = num_tokens * top_k
    sorted_slots, block_experts = moe_align(topk_ids, first_expert, num_local, config.block_m)
    num_m_blocks = block_experts.numel()
    precision = "ieee" if x.dtype == torch.float32 else "tf32"  # tf32: unused by 16-bit dots

    h = torch.empty(sorted_slots.numel(), inter, dtype=x.dtype, device=x.device)
    tile = config.gate_up
    _gate_up_kernel[(num_m_blocks * triton.cdiv(inter, tile.block_n),)](
        x, w13, h, sorted_slots, block_experts,
        num_slots, num_m_blocks, inter, hidden,
        x.stride(0), w13.stride(0), w13.stride(1), h.stride(0),
        TOP_K=top_k, BLOCK_M=config.block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k,
        GROUP_M=config.group_m, EVEN_K=hidden % tile.block_k == 0, DOT_PRECISION=precision,
        num_warps=tile.num_warps, num_stages=tile.num_stages,
    )
    y = torch.empty(num_slots, hidden, dtype=x.dtype, device=x.device)
    tile = config.down
    _down_kernel[(num_m_blocks * triton.cdiv(hidden, tile.block_n),)](
        h, w2, y, topk_weights, sorted_slots, block_experts,
        num_slots, num_m_blocks, hidden, inter,
        h.stride(0), w2.stride(0), w2.stride(1), y.stride(0),
        BLOCK_M=config.block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k,
        GROUP_M=config.group_m, EVEN_K=inter % tile.block_k == 0, DOT_PRECISION=precision,
        num_warps=tile.num_warps, num_stages=tile.num_stages,
    )
    block_n = min(1024, triton.next_power_of_2(hidden))
    _sum_kernel[(num_tokens, triton.cdiv(hidden, block_n))](
        y, topk_ids, out, first_expert, hidden, y.stride(0), out.stride(0),
        TOP_K=top_k, NUM_LOCAL=num_local, BLOCK_N=block_n, num_warps=4,
    )
    return out
