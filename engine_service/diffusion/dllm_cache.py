"""Fast-dLLM's approximate KV caches (Wu et al., 2025): which query tokens each sequence
forwards in a pass, and one packed forward for all of them.

A canvas is its prompt [0, P) and generated positions [P, L). With `dllm_cache` "none" every
pass queries the whole canvas (exact). With "prefix" or "dual" the prompt's KV is computed
once, block-causally at KV-block granularity: the tokens of prompt block i attend
(bidirectionally) to prompt blocks 0..i only, one row per block in a single forward. Block
i's KV then depends only on the tokens of blocks 0..i, so its full blocks join the prefix
cache under the ordinary chained hashes (block_hash.hash_prompt_blocks): prompts sharing a
prefix share its blocks, and the router's prefix routing matches a diffusion engine's blocks
as any other's. A partial last block is computed the same way and stays private. A block's
first pass is a refresh, querying [P, L); its other passes query [block_start, L) ("prefix")
or [block_start, block_end) ("dual"). Every query (but Dream's scoring row, below) writes its
KV, and attends to all L keys: the pass's fresh ones and the cached ones of the rest.

Every layer stores the whole forward's K/V into the paged cache before any row attends, and
every backend reads keys only from that cache, so a prompt row reads the earlier blocks' KV
written by the rows before it in the same forward. Queries may sit anywhere in their row:
attention is non-causal, so every backend attends each query to all seq_len keys, and slots
come from positions, not from the row's end. Dream scores position i from row i - 1; when
that row precedes a pass's queries it is queried too, reading the cache without writing it,
so a cached prompt block is never rewritten.

Head-sparse attention (a dual request's `retention_ratio`, models/layers/head_sparse.py): at
its block's pass `delay_step` a request's pass attends fully and each layer keeps, per KV head,
the candidate keys (all but the block's) its block's queries score highest, into the
request's selection; the block's later passes attend only to those and the block's keys. Those
passes go last in the forward, so the backend attends every other row in one call.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from engine_service.block_manager import BlockManager
from engine_service.common.block_hash import hash_prompt_blocks
from engine_service.sequence import Sequence
from models.attention_metadata import (
    AttentionMetadata,
    BlockTableCache,
    HeadSparsity,
    KeyChoice,
)
from models.host_copy import host_to_device, to_device

if TYPE_CHECKING:
    from engine_service.diffusion.engine import DiffusionRequest


@dataclass(slots=True)
class SparsePass:
    """A head-sparse request's pass over its block [block_start, block_end) from pass
    delay_step on: the choosing pass (`choose`) attends fully and fills `keys`, the later ones
    attend to them and the block's keys."""

    keys: torch.Tensor  # [num_layers, Hkv, n_keep] int64: each KV head's kept positions
    choose: bool
    block_start: int
    block_end: int


@dataclass(slots=True)
class Span:
    """Query tokens [start, end) of one sequence over its first seq_len positions; the first
    `num_unstored` of them read the cache but do not write their KV."""

    seq: Sequence
    start: int
    end: int
    seq_len: int
    num_unstored: int = 0
    is_prompt: bool = False  # one prompt block's pass (seq_len: the block's end)
    sparse: SparsePass | None = None

    @property
    def num_tokens(self) -> int:
        return self.end - self.start

    @property
    def attends_kept_keys(self) -> bool:
        return self.sparse is not None and not self.sparse.choose


# Never a block's hash (xxh3 digests are unsigned), so never a prefix-cache hit.
_UNSHARED = -1


def allocate_canvas(bm: BlockManager, seq: Sequence, cached: bool) -> None:
    """Blocks for the whole canvas. Cached: the leading full prompt blocks the prefix cache
    holds, fresh blocks for the rest (seq.num_cached_tokens: the hits). Otherwise fresh and
    private: every pass rewrites them, so they are never registered."""
    bs = bm.block_size
    shared = hash_prompt_blocks(seq.prompt_token_ids, bs) if cached else []
    # Past the full prompt blocks a canvas holds placeholders that each pass rewrites (a
    # guidance twin's masked prompt reads like a longer one's): their memoized hashes never
    # match, so the block manager takes no hit there.
    seq.block_hashes = shared + [_UNSHARED] * (-(-seq.num_tokens // bs) - len(shared))
    bm.allocate(seq, seq.num_tokens - bm.get_num_cached_tokens(seq))


def prompt_spans(seq: Sequence, block_size: int) -> list[Span]:
    """The prompt's KV blocks past its cache hits (block-aligned), one row each: the block's
    tokens over the prompt up to its end, so block-causal; none once computed."""
    spans = []
    for start in range(seq.num_computed_tokens, seq.num_prompt_tokens, block_size):
        end = min(start + block_size, seq.num_prompt_tokens)
        spans.append(Span(seq, start, end, end, is_prompt=True))
    return spans


def pass_span(seq: Sequence, mode: str, block_start: int, block_end: int, refresh: bool,
              shift: int) -> Span:
    """The queries of one denoising pass; rows block_start - shift ... score the block."""
    length = seq.num_tokens
    if mode == "none":
        start, end = 0, length
    elif refresh:
        start, end = seq.num_prompt_tokens, length
    elif mode == "prefix":
        start, end = block_start, length
    else:  # dual
        start, end = block_start, block_end
    extra = max(0, start - (block_start - shift))  # Dream's scoring row before the queries
    return Span(seq, start - extra, end, length, num_unstored=extra)


def sparse_pass(req: DiffusionRequest, twin: int) -> SparsePass | None:
    """The head-sparse part of a request's pass (for req.seqs[twin]), from its block's pass
    delay_step on; None while it attends as usual."""
    p = req.params
    if p.retention_ratio is None or req.pass_in_block < p.delay_step:
        return None
    start = req.block_start
    return SparsePass(req.selections[twin], req.pass_in_block == p.delay_step, start,
                      start + p.block_length)


def plan_step(running: list[DiffusionRequest], shift: int, block_size: int
              ) -> tuple[list[Span], list[int]]:
    """Every running request's spans (a pending prompt's blocks first, then the denoising
    pass, for the request and its guidance twin; the passes attending to kept keys only
    moved last) and the flat rows whose logits score each block, in `running` order, a
    guided request's twin after it."""
    spans: list[Span] = []
    scored: list[tuple[Span, int, int]] = []  # (pass, first scoring position, block_length)
    for req in running:
        p = req.params
        start = req.block_start
        for twin, seq in enumerate(req.seqs):
            if p.dllm_cache != "none":
                spans.extend(prompt_spans(seq, block_size))
            span = pass_span(seq, p.dllm_cache, start, start + p.block_length,
                             req.pass_in_block == 0, shift)
            span.sparse = sparse_pass(req, twin)
            spans.append(span)
            scored.append((span, start - shift, p.block_length))
    spans.sort(key=lambda span: span.attends_kept_keys)  # stable
    offsets = itertools.accumulate((span.num_tokens for span in spans), initial=0)
    offset = dict(zip(map(id, spans), offsets, strict=False))  # offsets: one more
    rows = [offset[id(span)] + first - span.start + i
            for span, first, n in scored for i in range(n)]
    return spans, rows


def pack(spans: list[Span], block_size: int, device: torch.device,
         table_cache: BlockTableCache) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """input_ids [T], positions [T] and the attention metadata of one forward, a row per
    span. A query's KV slot is its position's in the row's block table (-1: not stored)."""
    input_ids: list[int] = []
    positions: list[int] = []
    unstored: list[int] = []  # flat token indices
    for span in spans:
        unstored.extend(range(len(positions), len(positions) + span.num_unstored))
        input_ids.extend(span.seq.token_ids[span.start:span.end])
        positions.extend(range(span.start, span.end))
    q_lens = [span.num_tokens for span in spans]
    seq_lens = [span.seq_len for span in spans]
    cu = list(itertools.accumulate(q_lens, initial=0))
    tables = [span.seq.block_table for span in spans]
    packed = table_cache.pack(tables, max(map(len, tables)), 0)
    tables_t = host_to_device(torch.from_numpy(packed), device)  # [B, max_blocks]
    positions_t = to_device(positions, torch.long, device)  # [T]
    rows = torch.repeat_interleave(torch.arange(len(spans), device=device),
                                   to_device(q_lens, torch.long, device),
                                   output_size=cu[-1])  # [T]
    slots = (tables_t[rows, positions_t // block_size].long() * block_size
             + positions_t % block_size)  # [T]
    if unstored:
        slots[to_device(unstored, torch.long, device)] = -1
    meta = AttentionMetadata(
        slot_mapping=slots,
        cu_seqlens_q=to_device(cu, torch.int32, device),
        seq_lens=to_device(seq_lens, torch.int32, device),
        block_tables=tables_t,
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
        seq_lens_cpu=seq_lens,
        cu_seqlens_q_cpu=cu,
        decode_only=max(q_lens) == 1,
    )
    if any(span.sparse is not None for span in spans):
        meta.head_sparsity = head_sparsity(spans, meta, block_size)
    return to_device(input_ids, torch.long, device), positions_t, meta


def head_sparsity(spans: list[Span], meta: AttentionMetadata, block_size: int
                  ) -> HeadSparsity:
    """The head-sparse rows of a packed forward (plan_step put those attending to their kept
    keys last): the leading rows' metadata, the choosing rows' candidates, and the trailing
    rows' queries and key slots, padded to rectangles."""
    cu, seq_lens = meta.cu_seqlens_q_cpu, meta.seq_lens_cpu
    assert cu is not None and seq_lens is not None
    device = meta.slot_mapping.device
    tables = meta.block_tables.long()  # [B, max_blocks]
    num_dense = sum(not span.attends_kept_keys for span in spans)
    q_lens = [span.num_tokens for span in spans]
    dense = AttentionMetadata(
        slot_mapping=meta.slot_mapping[:cu[num_dense]],
        cu_seqlens_q=meta.cu_seqlens_q[:num_dense + 1],
        seq_lens=meta.seq_lens[:num_dense],
        block_tables=meta.block_tables[:num_dense],
        max_query_len=max(q_lens[:num_dense], default=0),
        max_seq_len=max(seq_lens[:num_dense], default=0),
        seq_lens_cpu=seq_lens[:num_dense],
        cu_seqlens_q_cpu=cu[:num_dense + 1],
        decode_only=max(q_lens[:num_dense], default=0) == 1,
    )

    def slots(rows: int | torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return tables[rows, positions // block_size] * block_size + positions % block_size

    choices = []
    for row, span in enumerate(spans[:num_dense]):
        sp = span.sparse
        if sp is None:
            continue
        first = cu[row] - span.start  # token index of position 0's query, were it queried
        candidates = to_device([*range(sp.block_start), *range(sp.block_end, span.seq_len)],
                               torch.long, device)  # [C]
        choices.append(KeyChoice((first + sp.block_start, first + sp.block_end), candidates,
                                 slots(row, candidates), sp.keys))

    trailing = spans[num_dense:]
    q_len = max(q_lens[num_dense:], default=0)
    num_keys = max((span.sparse.keys.shape[-1] + span.sparse.block_end
                    - span.sparse.block_start for span in trailing), default=0)
    index, query_valid, key_valid, positions = [], [], [], []
    for row, span in enumerate(trailing, num_dense):
        sp = span.sparse
        index += [cu[row] + min(i, span.num_tokens - 1) for i in range(q_len)]
        query_valid += [i < span.num_tokens for i in range(q_len)]
        layers, heads, _ = sp.keys.shape
        block = torch.arange(sp.block_start, sp.block_end, device=device)
        keys = torch.cat([sp.keys, block.expand(layers, heads, -1)], dim=-1)  # [L, Hkv, k]
        key_valid += [i < keys.shape[-1] for i in range(num_keys)]
        positions.append(F.pad(keys, (0, num_keys - keys.shape[-1])))  # pad: position 0
    num_rows = len(trailing)
    key_slots = torch.empty(0, dtype=torch.long, device=device)  # no trailing rows
    if positions:
        stacked = torch.stack(positions, dim=1)  # [L, R, Hkv, K]
        rows = torch.arange(num_dense, len(spans), device=device)[None, :, None, None]
        key_slots = slots(rows, stacked)  # [L, R, Hkv, K]
    return HeadSparsity(
        dense=dense, num_dense_tokens=cu[num_dense], choices=choices,
        query_index=to_device(index, torch.long, device).view(num_rows, q_len),
        query_valid=to_device(query_valid, torch.bool, device).view(num_rows, q_len),
        key_slots=key_slots,
        key_valid=to_device(key_valid, torch.bool, device).view(num_rows, num_keys))


def cache_prompts(spans: list[Span], bm: BlockManager) -> None:
    """After the forward that computed them: the prompt blocks' KV is final, and each full
    one joins the prefix cache under its chained hash (a `stored` KV event; a block another
    request registered first stays private)."""
    for span in spans:
        if span.is_prompt:
            span.seq.num_computed_tokens = span.end
            bm.cache_full_blocks(span.seq)
