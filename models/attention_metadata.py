"""Per-step attention inputs shared by every layer and every attention backend.

A batch is flat: row b's queries are tokens cu_seqlens_q[b]:cu_seqlens_q[b+1] of the step, the
LAST q_len_b positions of its seq_lens[b]-token context (query i at seq_lens[b] - q_len_b + i).
This covers decodes, prefills, prefix-cached prefills and chunks, mixed in one batch. Under
non-causal attention a row's queries may sit anywhere in its context (the diffusion engine's
dLLM caches): every backend attends them to all seq_lens[b] keys, and the caller's positions
and slot_mapping say where they are (engine_service/diffusion/dllm_cache.py builds those).
`head_sparsity` marks the rows of a diffusion forward under head-sparse attention
(models/layers/head_sparse.py); every other forward leaves it None.
"""

from __future__ import annotations

import itertools
from array import array
from dataclasses import dataclass

import numpy as np
import torch

from models.host_copy import host_to_device, to_device


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64: KV cache slot per token, -1 = do not store
    cu_seqlens_q: torch.Tensor  # [B + 1] int32: query token offsets per row
    seq_lens: torch.Tensor  # [B] int32: context length incl. this step's tokens
    block_tables: torch.Tensor  # [B, max_blocks] int32; entries past a row's blocks: any
    max_query_len: int
    max_seq_len: int
    seq_lens_cpu: list[int] | None = None  # host copies, so backends need not sync
    cu_seqlens_q_cpu: list[int] | None = None
    decode_only: bool = False  # every row has q_len == 1
    head_sparsity: HeadSparsity | None = None

    def __post_init__(self) -> None:
        # Shape/dtype checks only: reading values would force a device sync every step.
        if self.slot_mapping.dim() != 1 or self.slot_mapping.dtype != torch.int64:
            raise ValueError(f"slot_mapping must be a 1-D int64 tensor, got "
                             f"{self.slot_mapping.dtype} {list(self.slot_mapping.shape)}")
        if self.cu_seqlens_q.dim() != 1 or self.cu_seqlens_q.shape[0] < 1:
            raise ValueError(f"cu_seqlens_q must be 1-D with B + 1 entries, got "
                             f"{list(self.cu_seqlens_q.shape)}")
        num_seqs = self.cu_seqlens_q.shape[0] - 1
        if tuple(self.seq_lens.shape) != (num_seqs,):
            raise ValueError(f"seq_lens must have shape [{num_seqs}] (B from cu_seqlens_q), "
                             f"got {list(self.seq_lens.shape)}")
        if self.block_tables.dim() != 2 or self.block_tables.shape[0] != num_seqs:
            raise ValueError(f"block_tables must have shape [{num_seqs}, max_blocks], got "
                             f"{list(self.block_tables.shape)}")
        for name in ("cu_seqlens_q", "seq_lens", "block_tables"):
            if getattr(self, name).dtype != torch.int32:
                raise ValueError(f"{name} must be int32, got {getattr(self, name).dtype}")
        if self.seq_lens_cpu is not None and len(self.seq_lens_cpu) != num_seqs:
            raise ValueError(f"seq_lens_cpu must have {num_seqs} entries, "
                             f"got {len(self.seq_lens_cpu)}")
        if self.cu_seqlens_q_cpu is not None and len(self.cu_seqlens_q_cpu) != num_seqs + 1:
            raise ValueError(f"cu_seqlens_q_cpu must have {num_seqs + 1} entries, "
                             f"got {len(self.cu_seqlens_q_cpu)}")


@dataclass
class KeyChoice:
    """A row at its block's choosing pass (head-sparse attention): it attends fully, then each
    layer scores the candidate keys (every position outside the block) with the block's
    queries and writes each KV head's kept positions into keys[layer]."""

    block_queries: tuple[int, int]  # token range [start, end) of the block's queries
    candidate_positions: torch.Tensor  # [C] int64, ascending
    candidate_slots: torch.Tensor  # [C] int64: their KV cache slots
    keys: torch.Tensor  # [num_layers, Hkv, n_keep] int64, written by the forward


@dataclass
class HeadSparsity:
    """The rows of one forward that take part in head-sparse attention. The rows attending
    only to their kept keys come last: the backend attends the leading `dense` rows (tokens
    [0, num_dense_tokens)) as usual, and the trailing ones, padded to R rows of Q queries
    over K keys, attend per KV head to the slots in key_slots."""

    dense: AttentionMetadata  # the leading rows' metadata
    num_dense_tokens: int
    choices: list[KeyChoice]  # rows (among the dense ones) at their choosing pass
    query_index: torch.Tensor  # [R, Q] int64: token of each trailing row's query (pad: any)
    query_valid: torch.Tensor  # [R, Q] bool; row-major, its True entries are tokens in order
    key_slots: torch.Tensor  # [num_layers, R, Hkv, K] int64: the cache slots each head reads
    key_valid: torch.Tensor  # [R, K] bool


class BlockTableCache:
    """Block tables packed as int32 bytes, kept from one step to the next: a decode row's
    table rarely changes, and converting every block id is most of the metadata's host cost
    at large batches. Rows are keyed by the table list's identity and reused only while the
    list equals the copy they were packed from. Only the last batch's rows are kept."""

    def __init__(self) -> None:
        self._rows: dict[int, tuple[list[int], bytes]] = {}  # id(table) -> (copy, bytes)

    def pack(self, block_tables: list[list[int]], width: int, pad_block_id: int
             ) -> np.ndarray:
        """[len(block_tables), width] int32, each row padded with pad_block_id."""
        old = self._rows
        rows: dict[int, tuple[list[int], bytes]] = {}
        pad = array("i", [pad_block_id]).tobytes()  # one int32
        parts: list[bytes] = []
        for table in block_tables:
            entry = old.get(id(table))
            if entry is None or entry[0] != table:
                entry = (list(table), array("i", table).tobytes())
            rows[id(table)] = entry
            parts.append(entry[1])
            if len(table) < width:
                parts.append(pad * (width - len(table)))
        self._rows = rows
        packed = np.frombuffer(bytearray().join(parts), dtype=np.int32)
        return packed.reshape(len(block_tables), width)


def make_attention_metadata(
    query_lens: list[int],
    seq_lens: list[int],
    block_tables: list[list[int]],
    block_size: int,
    device: torch.device | str = "cpu",
    pad_block_id: int = 0,
    table_cache: BlockTableCache | None = None,
) -> AttentionMetadata:
    """The one builder of attention metadata: host lists in, device tensors out. Slots are
    computed on the device (no per-token Python); tables are padded with `pad_block_id`."""
    if not len(query_lens) == len(seq_lens) == len(block_tables):
        raise ValueError("query_lens, seq_lens and block_tables must have one entry per row")
    for q_len, s_len, table in zip(query_lens, seq_lens, block_tables, strict=True):
        if not 1 <= q_len <= s_len:
            raise ValueError(f"need 1 <= query_len <= seq_len, got {q_len} and {s_len}")
        if len(table) * block_size < s_len:
            raise ValueError(f"block table of {len(table)} blocks cannot hold {s_len} tokens")
    cu = list(itertools.accumulate(query_lens, initial=0))
    max_query_len = max(query_lens, default=0)
    decode_only = max_query_len == 1  # every q_len is >= 1
    width = max(map(len, block_tables), default=0)
    padded = (table_cache or BlockTableCache()).pack(block_tables, width, pad_block_id)
    cu_t = to_device(cu, torch.int32, device)  # [B + 1]
    seq_lens_t = to_device(seq_lens, torch.int32, device)  # [B]
    tables_t = host_to_device(torch.from_numpy(padded), device)  # [B, max_blocks]
    if decode_only:
        # Token b is row b's query, at seq_lens[b] - 1: half the general path's device ops.
        positions = seq_lens_t.long() - 1  # [B]
        block_ids = tables_t.gather(1, (positions // block_size)[:, None]).squeeze(1)  # [B]
    else:
        q_lens_t = cu_t.diff()  # [B]
        num_tokens = cu[-1]
        rows = torch.repeat_interleave(torch.arange(len(query_lens), device=cu_t.device),
                                       q_lens_t, output_size=num_tokens)  # [T]
        # query i of row b sits at position seq_lens[b] - q_len_b + i
        index_in_row = torch.arange(num_tokens, device=cu_t.device) - cu_t[rows]  # [T]
        positions = (seq_lens_t - q_lens_t)[rows] + index_in_row  # [T]
        block_ids = tables_t[rows, positions // block_size]  # [T]
    slots = block_ids.long() * block_size + positions % block_size
    return AttentionMetadata(
        slot_mapping=slots,
        cu_seqlens_q=cu_t,
        seq_lens=seq_lens_t,
        block_tables=tables_t,
        max_query_len=max_query_len,
        max_seq_len=max(seq_lens, default=0),
        seq_lens_cpu=list(seq_lens),
        cu_seqlens_q_cpu=cu,
        decode_only=decode_only,
    )
