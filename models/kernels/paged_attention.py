"""One Triton paged-attention kernel for a mixed batch (decodes, prefills, prefill chunks).

Row b's `q_len_b = cu_seqlens_q[b+1] - cu_seqlens_q[b]` queries are the last positions of its
`seq_lens[b]`-token context; all K/V (this step's included, stored beforehand) live in the paged
cache `[num_blocks, block_size, num_kv_heads, head_dim]` at `block_tables[b, pos // block_size]`.
Non-causal launches (CAUSAL=False, diffusion LLMs) let every query see the row's whole context,
so there the queries may sit anywhere in it.

Program `(tile, kv_head, split)`: BLOCK_Q tokens x the GQA group sharing `kv_head`, so each K/V
tile is loaded once per group. The tile's sequence is a binary search over `cu_seqlens_q`, so
the grid needs no host reads. Split-KV (flash-decoding) cuts a tile's keys into up to
`num_splits` partitions sized in the kernel from the row's own length (so a captured graph
serves any length); the last partition to arrive on the tile's int32 counter merges the float32
partials in a fixed order (bitwise deterministic) and zeroes the counter again, so one zeroed
buffer serves every launch and graph replay without a memset.
"""

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
MAX_SPLITS = 32
# Mixed batches split the KV range only when some context is at least this long.
MIN_SPLIT_CONTEXT = 1024
# Decode batches of up to this many programs per SM cut rows longer than DECODE_SPLIT_LEN in
# two, so the longest rows of a spread-out batch do not run alone at the end of the launch.
DECODE_SPLIT_PROGRAMS_PER_SM = 8
DECODE_SPLIT_LEN = 512
# Empty rows keep this finite running max, so fully masked tiles never produce inf - inf.
_NEG_BIG = tl.constexpr(-1.0e30)


# Per-step ints are not specialised on (== 1, % 16): each combination would recompile mid-run.
@triton.jit(do_not_specialize=["num_seqs", "seq_base", "min_split_len", "stride_bt"])
def _paged_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr,
    ws_acc_ptr, ws_max_ptr, ws_sum_ptr, counters_ptr,
    cu_seqlens_q_ptr, seq_lens_ptr, block_tables_ptr,
    qk_scale, num_seqs, num_heads, block_size, seq_base, min_split_len,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_k_slot, stride_k_head, stride_v_slot, stride_v_head,
    stride_bt,
    NUM_Q_PER_KV: tl.constexpr, GROUP_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr, MERGE_ROWS: tl.constexpr,
    DOT_PRECISION: tl.constexpr, CAUSAL: tl.constexpr = True,
):
    # block_size is a runtime int (one compile for every block size); NUM_SPLITS is
    # compile-time because the merge loads [rows, NUM_SPLITS, HEAD_DIM] tiles.
    pid = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    # A sub-batch starts at row seq_base of the step's metadata. An offset, not sliced
    # tensors: a slice's pointer alignment would be a compile key (a new compile mid-run).
    cu_seqlens_q_ptr += seq_base
    seq_lens_ptr += seq_base
    block_tables_ptr += seq_base.to(tl.int64) * stride_bt
    q_base = tl.load(cu_seqlens_q_ptr)  # the sub-batch's first token: its query/out row 0

    # With q = cu_seqlens_q - q_base (q_base: first token of a sub-batch), sequence b owns
    # programs [q[b] // BLOCK_Q + b, q[b+1] // BLOCK_Q + b + 1): at least cdiv(q_len_b,
    # BLOCK_Q) of them. Find the last b whose first program is <= pid.
    lo = pid * 0
    hi = lo + num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first = (tl.load(cu_seqlens_q_ptr + mid) - q_base) // BLOCK_Q + mid
        if first <= pid:
            lo = mid + 1
        else:
            hi = mid
    seq = lo - 1

    q_start = tl.load(cu_seqlens_q_ptr + seq) - q_base  # row of query/out
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_base - q_start
    tile = pid - (q_start // BLOCK_Q + seq)
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx_len = seq_len - q_len  # tokens cached before this step: query i sits at ctx_len + i
    kv_hi = seq_len  # non-causal: every query sees the whole context
    if CAUSAL:
        # No row of this tile sees keys past its last query token.
        kv_hi = tl.minimum(seq_len, ctx_len + (tile + 1) * BLOCK_Q)
    if NUM_SPLITS > 1:
        # Partitions of at least min_split_len keys: short contexts take fewer (less merge
        # work), and mixed lengths get work units of similar size.
        part = tl.maximum(tl.cdiv(tl.cdiv(kv_hi, NUM_SPLITS), BLOCK_N) * BLOCK_N,
                          min_split_len)
        num_parts = tl.maximum(tl.cdiv(kv_hi, part), 1)
        kv_lo = split * part
        kv_end = tl.minimum(kv_hi, kv_lo + part)
    else:
        kv_lo = 0
        kv_end = kv_hi
        num_parts = 1  # a constant: the partials branch below is compiled out
    live = (tile * BLOCK_Q < q_len) & (split < num_parts)
    if not live:
        return
    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    k_base = k_cache_ptr + kv_head * stride_k_head
    v_base = v_cache_ptr + kv_head * stride_v_head

    rows = tl.arange(0, BLOCK_M)
    tok = tile * BLOCK_Q + rows // GROUP_PAD  # [BLOCK_M] query token within the sequence
    group_head = rows % GROUP_PAD
    head = kv_head * NUM_Q_PER_KV + group_head
    row_ok = (tok < q_len) & (group_head < NUM_Q_PER_KV)
    q_pos = ctx_len + tok
    dims = tl.arange(0, HEAD_DIM)
    t = (q_start + tok).to(tl.int64)  # [BLOCK_M] flat token index
    q = tl.load(q_ptr + t[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :],
                mask=row_ok[:, None], other=0.0)  # [BLOCK_M, HEAD_DIM]

    m_i = tl.full([BLOCK_M], _NEG_BIG, dtype=tl.float32)  # running max (log2 domain)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)  # running softmax denominator
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    for start in range(kv_lo, kv_end, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)  # [BLOCK_N] logical key positions
        n_ok = n < kv_end
        # Physical address per key: any block size works, a tile may span several blocks.
        block = tl.load(bt_row + n // block_size, mask=n_ok, other=0).to(tl.int64)
        slot = block * block_size + n % block_size
        k = tl.load(k_base + slot[:, None] * stride_k_slot + dims[None, :],
                    mask=n_ok[:, None], other=0.0)  # [BLOCK_N, HEAD_DIM]
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        if CAUSAL:
            s = tl.where(n_ok[None, :] & (n[None, :] <= q_pos[:, None]), s, float("-inf"))
        else:
            s = tl.where(n_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])  # [BLOCK_M, BLOCK_N]
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_base + slot[:, None] * stride_v_slot + dims[None, :],
                    mask=n_ok[:, None], other=0.0)  # [BLOCK_N, HEAD_DIM]
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    # A row that took one partition is done: no partials, no merge.
    if num_parts > 1:
        ws = (t * num_heads + head) * NUM_SPLITS + split  # [BLOCK_M] workspace row
        tl.store(ws_max_ptr + ws, m_i, mask=row_ok)
        tl.store(ws_sum_ptr + ws, l_i, mask=row_ok)
        tl.store(ws_acc_ptr + ws[:, None] * HEAD_DIM + dims[None, :], acc,
                 mask=row_ok[:, None])
        # Every thread's partials are stored before the one atomic of this program; its
        # release makes them visible to the last arriver, whose acquire orders its reads.
        tl.debug_barrier()
        counter = counters_ptr + pid * tl.num_programs(1) + kv_head
        arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
        if arrived == num_parts - 1:
            _merge_splits(out_ptr, ws_acc_ptr, ws_max_ptr, ws_sum_ptr,
                          q_start, q_len, tile, kv_head, num_heads, num_parts,
                          stride_ot, stride_oh,
                          NUM_Q_PER_KV, GROUP_PAD, BLOCK_Q, BLOCK_M, HEAD_DIM, NUM_SPLITS,
                          MERGE_ROWS)
            tl.store(counter, 0)  # zero again for the next launch / graph replay
    else:
        # l_i == 0 only for an empty context (seq_len 0 padding rows): write zeros, not NaN.
        out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        tl.store(out_ptr + t[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


@triton.jit
def _merge_splits(
    out_ptr, ws_acc_ptr, ws_max_ptr, ws_sum_ptr,
    q_start, q_len, tile, kv_head, num_heads, num_parts, stride_ot, stride_oh,
    NUM_Q_PER_KV: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr,
    MERGE_ROWS: tl.constexpr,
):
    """Merge one tile's partials into out (run by the last arriver), MERGE_ROWS rows at a
    time. Loads use .cg: other SMs wrote the partials, so they must come from L2, not L1."""
    dims = tl.arange(0, HEAD_DIM)
    splits = tl.arange(0, NUM_SPLITS)
    num_rows = tl.minimum(BLOCK_M, (q_len - tile * BLOCK_Q) * GROUP_PAD)
    for r0 in range(0, num_rows, MERGE_ROWS):
        rows = r0 + tl.arange(0, MERGE_ROWS)
        tok = tile * BLOCK_Q + rows // GROUP_PAD
        group_head = rows % GROUP_PAD
        head = kv_head * NUM_Q_PER_KV + group_head
        row_ok = (tok < q_len) & (group_head < NUM_Q_PER_KV)  # [MERGE_ROWS]
        t = (q_start + tok).to(tl.int64)
        ws = (t * num_heads + head)[:, None] * NUM_SPLITS + splits[None, :]  # [R, S]
        ok = row_ok[:, None] & (splits[None, :] < num_parts)  # [R, S]
        m = tl.load(ws_max_ptr + ws, mask=ok, other=_NEG_BIG, cache_modifier=".cg")
        l_sum = tl.load(ws_sum_ptr + ws, mask=ok, other=0.0, cache_modifier=".cg")
        acc = tl.load(ws_acc_ptr + ws[:, :, None] * HEAD_DIM + dims[None, None, :],
                      mask=ok[:, :, None], other=0.0,
                      cache_modifier=".cg")  # [MERGE_ROWS, NUM_SPLITS, HEAD_DIM]
        # Partitions past num_parts never ran and empty ones carry max _NEG_BIG and sum 0:
        # weight 0 next to any real one, and an all-empty row (seq_len 0) divides 0 by 1.
        weight = tl.exp2(m - tl.max(m, axis=1)[:, None])  # [R, S]
        total = tl.sum(weight * l_sum, axis=1)  # [R]
        out = tl.sum(acc * weight[:, :, None], axis=1) / tl.where(total > 0.0, total, 1.0)[
            :, None]  # [MERGE_ROWS, HEAD_DIM]
        tl.store(out_ptr + t[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


@dataclass(frozen=True)
class AttentionLaunch:
    """Launch choice of `paged_attention`; a pure function of host-known batch shape."""

    block_q: int  # query tokens per tile (rows = block_q x padded GQA group)
    block_n: int  # keys per inner-loop step
    num_splits: int  # KV partitions per tile at most; 1 = no split-KV pass
    num_warps: int = 4
    num_stages: int = 2
    # Keys per partition at least (runtime, not a compile key): short rows take fewer splits.
    min_split_len: int = 0
    # The smallest decode batches (the most splits): 8 warps and a wider split merge.
    small_decode: bool = False

    def __post_init__(self) -> None:
        for name in ("block_q", "block_n", "num_splits"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"{name} must be a power of two >= 1, got {value}")
        if self.block_n < 16:
            raise ValueError(f"block_n must be >= 16 (tl.dot), got {self.block_n}")
        if self.num_splits > MAX_SPLITS:
            raise ValueError(f"num_splits must be <= {MAX_SPLITS}, got {self.num_splits}")
        if self.min_split_len < 0:
            raise ValueError(f"min_split_len must be >= 0, got {self.min_split_len}")


def _group_pad(num_q_per_kv: int) -> int:
    return triton.next_power_of_2(num_q_per_kv)


@functools.lru_cache(maxsize=4096)  # asked per layer per eager step, same answer each time
def choose_launch(*, num_tokens: int, num_seqs: int, num_kv_heads: int, num_q_per_kv: int,
                  dtype: torch.dtype, max_query_len: int, max_seq_len: int,
                  decode_only: bool, num_sms: int) -> AttentionLaunch:
    """Tile sizes and split count from host ints only. For `decode_only` batches the result
    never depends on lengths, so a CUDA graph captured for a batch size fits any context."""
    group_pad = _group_pad(num_q_per_kv)
    decode_q, prefill_q = _block_qs(group_pad)
    if decode_only:
        block_q = decode_q
        programs = num_seqs * num_kv_heads
    else:
        # One tile height for every other launch (even when all chunks are short): each
        # distinct height would be one more compile, and launch_variants must list them all.
        block_q = prefill_q
        programs = (num_tokens // block_q + num_seqs) * num_kv_heads
    num_splits, min_split_len = 1, 0
    long_enough = decode_only or max_seq_len >= MIN_SPLIT_CONTEXT
    if programs < 2 * num_sms and long_enough:
        num_splits = min(MAX_SPLITS, triton.next_power_of_2(triton.cdiv(4 * num_sms, programs)))
    elif decode_only and programs <= DECODE_SPLIT_PROGRAMS_PER_SM * num_sms:
        num_splits, min_split_len = 2, DECODE_SPLIT_LEN
    small_decode = decode_only and num_splits == MAX_SPLITS
    return _tiles(block_q, num_splits, group_pad, dtype, min_split_len, small_decode)


def _block_qs(group_pad: int) -> tuple[int, int]:
    """Query tokens per tile: (decode launches, all others). Decode tiles hold one token's
    group padded to tl.dot's 16 rows; the others up to 64 rows."""
    decode_q = max(1, 16 // group_pad)
    return decode_q, max(decode_q, 64 // group_pad)


def _tiles(block_q: int, num_splits: int, group_pad: int, dtype: torch.dtype,
           min_split_len: int = 0, small_decode: bool = False) -> AttentionLaunch:
    return AttentionLaunch(
        block_q=block_q,
        block_n=32 if dtype == torch.float32 else 64,  # fp32 tiles take twice the smem
        num_splits=num_splits,
        # Small decode launches: 8 warps, so their split merge (one L2 round trip per row
        # chunk) takes a whole GQA group at once.
        num_warps=8 if block_q * group_pad > 64 or small_decode else 4,
        min_split_len=min_split_len,
        small_decode=small_decode,
    )


_SPLIT_COUNTS = [1 << i for i in range(MAX_SPLITS.bit_length())]


def launch_variants(num_q_per_kv: int, dtype: torch.dtype) -> list[AttentionLaunch]:
    """Every launch choose_launch can return for a head layout and dtype (each one compiled
    kernel): what an engine compiles at start-up instead of in the middle of serving."""
    group_pad = _group_pad(num_q_per_kv)
    decode_q, prefill_q = _block_qs(group_pad)
    decode = [_tiles(decode_q, s, group_pad, dtype, small_decode=s == MAX_SPLITS)
              for s in _SPLIT_COUNTS]
    decode.append(_tiles(decode_q, 2, group_pad, dtype, DECODE_SPLIT_LEN))
    prefill = [_tiles(prefill_q, s, group_pad, dtype) for s in _SPLIT_COUNTS]
    # decode and prefill tiles may coincide
    return list(dict.fromkeys(decode + prefill))


def split_workspace(num_tokens: int, num_heads: int, num_splits: int, head_dim: int,
                    device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Float32 partials of split-KV: acc [T, H, S, D], running max [T, H, S], sum [T, H, S]."""
    acc = torch.empty(num_tokens, num_heads, num_splits, head_dim, dtype=torch.float32,
                      device=device)
    row_max = torch.empty(num_tokens, num_heads, num_splits, dtype=torch.float32, device=device)
    row_sum = torch.empty(num_tokens, num_heads, num_splits, dtype=torch.float32, device=device)
    return acc, row_max, row_sum


def split_counters(num_counters: int, device: torch.device | str) -> torch.Tensor:
    """Zeroed int32 arrival counters of split-KV, one per (tile program, kv_head) of a
    launch; every launch leaves them zeroed, so a caller keeps one buffer per device."""
    return torch.zeros(num_counters, dtype=torch.int32, device=device)


def _merge_rows(block_m: int, head_dim: int, launch: AttentionLaunch) -> int:
    """Rows the split merge takes at a time: its [rows, splits, head_dim] float32 tile stays
    near 32 registers per thread (64 for the small decode launches, which have few programs
    and pay an L2 round trip per row chunk)."""
    num_splits = launch.num_splits
    budget = (64 if launch.small_decode else 32) * 32 * launch.num_warps  # float32 values
    return max(1, min(block_m, budget // (num_splits * head_dim)))


def paged_attention(
    query: torch.Tensor,  # [T, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    cu_seqlens_q: torch.Tensor,  # [B + 1] int32
    seq_lens: torch.Tensor,  # [B] int32, context length including this step's tokens
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    scale: float,
    launch: AttentionLaunch,
    out: torch.Tensor | None = None,  # [T, num_heads, head_dim]
    workspace: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    counters: torch.Tensor | None = None,  # [>= grid0 * num_kv_heads] int32 zeros
    seq_base: int = 0,
    causal: bool = True,
) -> torch.Tensor:
    """Attention of every query token over its sequence's cached context: causal, or with
    `causal=False` over all `seq_lens[b]` keys of its row.

    The batch is rows `seq_base..` of the metadata; token i of sequence b is query/out row
    `cu_seqlens_q[b] - cu_seqlens_q[seq_base] + i`. Output rows of no sequence are unspecified.
    Split launches use a float32 `workspace` and `(T // block_q + B) * num_kv_heads` zeroed
    `counters`, left zeroed again (launches in one stream may share them); both are allocated
    when not given, but a CUDA-graph caller passes `counters` to avoid a memset per launch.
    """
    num_tokens, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    num_seqs = seq_lens.shape[0] - seq_base
    assert head_dim >= 16 and head_dim & (head_dim - 1) == 0, (
        f"head_dim must be a power of two >= 16, got {head_dim}")
    assert num_heads % num_kv_heads == 0, f"{num_heads} heads vs {num_kv_heads} kv heads"
    assert value_cache.shape == key_cache.shape and key_cache.shape[3] == head_dim
    assert query.dtype == key_cache.dtype == value_cache.dtype, (
        f"query {query.dtype} vs cache {key_cache.dtype}/{value_cache.dtype}")
    assert 0 <= seq_base <= seq_lens.shape[0], f"seq_base {seq_base} past the batch"
    assert cu_seqlens_q.shape == (seq_lens.shape[0] + 1,), "cu_seqlens_q must be [B + 1]"
    assert block_tables.shape[0] == seq_lens.shape[0] and block_tables.stride(1) == 1
    for cache in (key_cache, value_cache):
        assert cache.stride(3) == 1, "cache head_dim must be contiguous"
        assert block_size == 1 or cache.stride(0) == block_size * cache.stride(1), (
            "cache slots must be linear: slot = block * block_size + offset")
    if query.stride(-1) != 1:
        query = query.contiguous()
    if out is None:
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    assert out.shape == query.shape and out.stride(-1) == 1
    if num_tokens == 0 or num_seqs == 0:
        return out

    num_q_per_kv = num_heads // num_kv_heads
    group_pad = _group_pad(num_q_per_kv)
    block_m = launch.block_q * group_pad
    assert block_m >= 16, f"block_q * padded group must be >= 16 rows, got {block_m}"
    splits = launch.num_splits
    grid = (num_tokens // launch.block_q + num_seqs, num_kv_heads, splits)
    if splits > 1:
        ws_acc, ws_max, ws_sum = workspace or split_workspace(
            num_tokens, num_heads, splits, head_dim, query.device)
        assert ws_acc.shape == (num_tokens, num_heads, splits, head_dim)
        need = grid[0] * num_kv_heads  # one per (tile program, kv_head)
        if counters is None:
            counters = split_counters(need, query.device)
        assert counters.dtype == torch.int32 and counters.is_contiguous()
        assert counters.numel() >= need, f"{counters.numel()} split counters, need {need}"
    else:
        ws_acc = ws_max = ws_sum = counters = out  # not touched without splits
    # With block_size 1 a "block" is one slot, so the slot stride is the block stride.
    k_slot = key_cache.stride(0) if block_size == 1 else key_cache.stride(1)
    v_slot = value_cache.stride(0) if block_size == 1 else value_cache.stride(1)
    _paged_attention_kernel[grid](
        query, key_cache, value_cache, out,
        ws_acc, ws_max, ws_sum, counters,
        cu_seqlens_q, seq_lens, block_tables,
        scale * LOG2E, num_seqs, num_heads, block_size, seq_base, launch.min_split_len,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        k_slot, key_cache.stride(2), v_slot, value_cache.stride(2),
        block_tables.stride(0),
        NUM_Q_PER_KV=num_q_per_kv, GROUP_PAD=group_pad,
        BLOCK_Q=launch.block_q, BLOCK_M=block_m, BLOCK_N=launch.block_n,
        HEAD_DIM=head_dim, NUM_SPLITS=splits,
        MERGE_ROWS=_merge_rows(block_m, head_dim, launch),
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        CAUSAL=causal,
        num_warps=launch.num_warps, num_stages=launch.num_stages,
    )
    return out
