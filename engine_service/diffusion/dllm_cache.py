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
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from engine_service.block_manager import BlockManager
from engine_service.common.block_hash import hash_prompt_blocks
from engine_service.sequence import Sequence
from models.attention_metadata import AttentionMetadata, BlockTableCache
from models.host_copy import host_to_device, to_device

if TYPE_CHECKING:
    from engine_service.diffusion.engine import DiffusionRequest


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

    @property
    def num_tokens(self) -> int:
        return self.end - self.start


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


def plan_step(running: list[DiffusionRequest], shift: int, block_size: int
              ) -> tuple[list[Span], list[int]]:
    """Every running request's spans (a pending prompt's blocks first, then the denoising
    pass, for the request and its guidance twin) and the flat rows whose logits score each
    block, in `running` order, a guided request's twin after it."""
    spans: list[Span] = []
    rows: list[int] = []
    num_tokens = 0
    for req in running:
        p = req.params
        start = req.block_start
        for seq in req.seqs:
            if p.dllm_cache != "none":
                for prompt in prompt_spans(seq, block_size):
                    spans.append(prompt)
                    num_tokens += prompt.num_tokens
            span = pass_span(seq, p.dllm_cache, start, start + p.block_length,
                             req.pass_in_block == 0, shift)
            spans.append(span)
            first = num_tokens + start - shift - span.start
            rows.extend(range(first, first + p.block_length))
            num_tokens += span.num_tokens
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
    return to_device(input_ids, torch.long, device), positions_t, meta


def cache_prompts(spans: list[Span], bm: BlockManager) -> None:
    """After the forward that computed them: the prompt blocks' KV is final, and each full
    one joins the prefix cache under its chained hash (a `stored` KV event; a block another
    request registered first stays private)."""
    for span in spans:
        if span.is_prompt:
            span.seq.num_computed_tokens = span.end
            bm.cache_full_blocks(span.seq)
