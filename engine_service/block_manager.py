"""Paged KV blocks with a chained, ref-counted prefix cache and the KV events routers follow."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Literal

from engine_service.common.block_hash import hash_block
from engine_service.sequence import Sequence

EVENT_KINDS = ("stored", "removed")


@dataclass
class KvEvent:
    kind: Literal["stored", "removed"]
    block_hashes: list[int]

    def __post_init__(self) -> None:
        if self.kind not in EVENT_KINDS:
            raise ValueError(f"kind must be one of {EVENT_KINDS}, got {self.kind!r}")


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: int | None = None
    token_ids: tuple[int, ...] = ()  # what block_hash was computed from, to confirm a hit


class BlockManager:
    """Blocks `0..num_blocks-1`. Invariants (tests: check_block_manager): a block is free iff its
    ref_count is 0, and has a hash iff the table maps that hash to it. Preempted sequences
    look up the prefix cache over all their tokens (prompt + outputs so far)."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1, got {num_blocks}, "
                             f"{block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.hash_to_block: dict[int, int] = {}
        # Ref-0 blocks, front = next to reuse (LRU); hashed ones keep their hash until reused.
        self.free_blocks: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._events: list[KvEvent] = []
        # Admission asks for a sequence's prefix hits three times in a row: the last answer
        # is kept with what it depends on (the object, its token count, the table version).
        self._table_version = 0  # bumped whenever hash_to_block changes
        self._last_hits: tuple[Sequence, int, int, list[int]] | None = None

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_blocks)

    def cached_block_hashes(self) -> list[int]:
        return list(self.hash_to_block)

    def get_num_cached_tokens(self, seq: Sequence) -> int:
        """Tokens `seq` would get from the prefix cache if allocated now (block-aligned),
        leaving at least one to compute for the last token's logits. Read-only."""
        return len(self._cache_hits(seq)) * self.block_size

    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        _, _, take = self._plan(seq, num_new_tokens)
        return take <= len(self.free_blocks)

    def allocate(self, seq: Sequence, num_new_tokens: int, num_lookahead_tokens: int = 0
                 ) -> None:
        """Make seq.block_table cover num_computed_tokens + num_new_tokens, plus
        `num_lookahead_tokens` proposed tokens past its last one (after cache hits for a
        sequence without blocks). Raises RuntimeError, changing nothing, if it cannot."""
        hits, computed, take = self._plan(seq, num_new_tokens + num_lookahead_tokens)
        total = seq.num_tokens + seq.num_pending_tokens
        if num_new_tokens < 1 or computed + num_new_tokens > total:
            raise ValueError(f"cannot allocate {num_new_tokens} new tokens for {seq.seq_id!r}: "
                             f"{computed} of its {total} tokens are computed")
        num_new_tokens += num_lookahead_tokens
        if take > len(self.free_blocks):
            raise RuntimeError(f"not enough free KV blocks for {num_new_tokens} tokens of "
                               f"{seq.seq_id!r} ({len(self.free_blocks)} free)")
        if not seq.block_table:
            for block_id in hits:
                self._ref(block_id)
            seq.block_table.extend(hits)
            seq.num_hashed_blocks = len(hits)
            seq.num_computed_tokens = computed
            if seq.num_preemptions == 0:
                seq.num_cached_tokens = computed
        need = -(-(seq.num_computed_tokens + num_new_tokens) // self.block_size)
        for _ in range(need - len(seq.block_table)):
            seq.block_table.append(self._take_free_block())

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register blocks that are now full and computed (launched: any reader is launched
        later on the same stream), as one `stored` batch. A block whose last token is still
        pending waits, since its hash needs that token."""
        bs = self.block_size
        num_full = min(seq.num_computed_tokens, seq.num_tokens) // bs
        if num_full <= seq.num_hashed_blocks:
            return  # most steps: no block filled up
        num_full = min(num_full, len(seq.block_table))
        stored: list[int] = []
        for i in range(seq.num_hashed_blocks, num_full):
            block_hash = self._block_hash(seq, i)
            if block_hash in self.hash_to_block:
                # Another sequence computed the same block (or xxh3 collided): this one
                # stays private and unhashed.
                continue
            block = self.blocks[seq.block_table[i]]
            block.block_hash = block_hash
            block.token_ids = tuple(seq.token_ids[i * bs:(i + 1) * bs])
            self.hash_to_block[block_hash] = block.block_id
            self._table_version += 1
            stored.append(block_hash)
        seq.num_hashed_blocks = max(seq.num_hashed_blocks, num_full)
        if stored:
            self._record("stored", stored)

    def free(self, seq: Sequence) -> None:
        """Drop seq's refs tail first, so its tail blocks are reused before its head blocks
        (a later request is likelier to share the head). Unhashed blocks hold nothing
        reusable and go to the front of the free list, ahead of every cached block."""
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_blocks[block_id] = None
                if block.block_hash is None:
                    self.free_blocks.move_to_end(block_id, last=False)
        seq.block_table.clear()
        seq.num_hashed_blocks = 0

    def rollback(self, seq: Sequence) -> None:
        """Free the tail blocks that hold none of seq's computed tokens (taken for proposed
        tokens that were rejected): fresh and unhashed, so first in line for reuse."""
        keep = -(-seq.num_computed_tokens // self.block_size)
        while len(seq.block_table) > keep:
            block = self.blocks[seq.block_table.pop()]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_blocks[block.block_id] = None
                self.free_blocks.move_to_end(block.block_id, last=False)

    def take_events(self) -> list[KvEvent]:
        events, self._events = self._events, []
        return events

    def all_free(self) -> bool:
        return len(self.free_blocks) == self.num_blocks and \
            all(b.ref_count == 0 for b in self.blocks)

    def _block_hash(self, seq: Sequence, i: int) -> int:
        """Chained hash of seq's full block i, memoized in seq.block_hashes."""
        bs, hashes = self.block_size, seq.block_hashes
        while len(hashes) <= i:
            j = len(hashes)
            hashes.append(hash_block(hashes[-1] if hashes else None,
                                     seq.token_ids[j * bs:(j + 1) * bs]))
        return hashes[i]

    def _cache_hits(self, seq: Sequence) -> list[int]:
        """Blocks of seq's leading full blocks the cache holds (never its last token's);
        the caller must not modify the list (it may be the memo's)."""
        last = self._last_hits
        if last is not None and last[0] is seq and last[1:3] == (seq.num_tokens,
                                                                   self._table_version):
            return last[3]
        bs = self.block_size
        hits: list[int] = []
        for i in range((seq.num_tokens - 1) // bs):
            block_id = self.hash_to_block.get(self._block_hash(seq, i))
            if block_id is None or \
                    self.blocks[block_id].token_ids != tuple(seq.token_ids[i * bs:(i + 1) * bs]):
                break
            hits.append(block_id)
        self._last_hits = (seq, seq.num_tokens, self._table_version, hits)
        return hits

    def _plan(self, seq: Sequence, num_new_tokens: int) -> tuple[list[int], int, int]:
        """(cache hits to take, tokens computed after them, blocks to take from the free
        list: cached free blocks a hit revives plus fresh ones). Hits only for a sequence
        without blocks; one lookup serves both the check and the allocation."""
        if seq.block_table:
            hits, have, computed = [], len(seq.block_table), seq.num_computed_tokens
            revived = 0
        else:
            hits = self._cache_hits(seq)
            have, computed = len(hits), len(hits) * self.block_size
            revived = sum(1 for b in hits if self.blocks[b].ref_count == 0)
        need = -(-(computed + num_new_tokens) // self.block_size)
        return hits, computed, revived + max(0, need - have)

    def _ref(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free_blocks[block_id]  # a hit revives it: its hash stays valid
        block.ref_count += 1

    def _take_free_block(self) -> int:
        block_id, _ = self.free_blocks.popitem(last=False)
        block = self.blocks[block_id]
        if block.block_hash is not None:
            del self.hash_to_block[block.block_hash]
            self._table_version += 1
            self._record("removed", [block.block_hash])
            block.block_hash = None
            block.token_ids = ()
        block.ref_count = 1
        return block_id

    def _record(self, kind: Literal["stored", "removed"], block_hashes: list[int]) -> None:
        # Merge into the previous event of the same kind: order is preserved, batches shrink.
        if self._events and self._events[-1].kind == kind:
            self._events[-1].block_hashes.extend(block_hashes)
        else:
            self._events.append(KvEvent(kind, list(block_hashes)))
