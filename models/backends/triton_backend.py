"""Attention backend on nanoserve's own Triton kernels (any KV block size).

`forward` is CUDA-graph capturable for `meta.decode_only` batches: the launch depends only on
the batch size, head layout, dtype and SM count, and every per-step value (query, kv_cache,
cu_seqlens_q, seq_lens, fixed-width block_tables, slot_mapping) is read on the device. Padding
rows may use seq_len 0 and slot -1. The split-KV counter buffer (one per device, shared by every
launch on one stream) must be created by an eager step before any capture, as warm_up does.
"""

from __future__ import annotations

import torch

from models.attention_metadata import AttentionMetadata
from models.kernels.paged_attention import (
    choose_launch,
    launch_variants,
    paged_attention,
    split_counters,
)
from models.kernels.store_kv import store_kv

# SM count assumed off-GPU (TRITON_INTERPRET runs on CPU tensors).
_CPU_NUM_SMS = 8
# Split-KV counters per device (256 KiB; split launches need < 4 * num_sms). Never regrown:
# captured graphs keep its address.
_NUM_SPLIT_COUNTERS = 1 << 16


def _num_leading_decode_rows(cu_seqlens_q: list[int]) -> int:
    """Rows 0..n-1 all have one query token iff cu[n] == n; cu[i] - i never decreases,
    so bisect for the last such n (O(log B) host work per layer)."""
    lo, hi = 0, len(cu_seqlens_q) - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if cu_seqlens_q[mid] == mid:
            lo = mid
        else:
            hi = mid - 1
    return lo


class TritonAttentionBackend:
    name = "triton"
    supports_non_causal = True

    def __init__(self, num_sms: int | None = None) -> None:
        self._num_sms = num_sms  # None: ask the device on first use
        self._split_counters: dict[torch.device, torch.Tensor] = {}  # [65536] int32 zeros

    def num_sms(self, device: torch.device) -> int:
        if self._num_sms is None:
            self._num_sms = (torch.cuda.get_device_properties(device).multi_processor_count
                             if device.type == "cuda" else _CPU_NUM_SMS)
        return self._num_sms

    def split_kv_counters(self, device: torch.device) -> torch.Tensor:
        """This device's zeroed split-KV counter buffer, shared by all launches."""
        counters = self._split_counters.get(device)
        if counters is None:
            if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                raise RuntimeError("split-KV counters are created by an eager step: run the "
                                   "attention once before capturing a CUDA graph")
            counters = self._split_counters[device] = split_counters(_NUM_SPLIT_COUNTERS,
                                                                     device)
        return counters

    def store_kv(self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        """key/value [T, Hkv, D] -> kv_cache at slot_mapping [T] (slot -1: skipped)."""
        store_kv(key, value, kv_cache[0], kv_cache[1], slot_mapping)

    def forward(self, query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                scale: float, out: torch.Tensor | None = None,
                causal: bool = True) -> torch.Tensor:
        """query [T, H, D] -> [T, H, D] (written into `out` when given). A mixed batch's
        leading decode rows launch on their own with one-token tiles. Non-causal: every
        query of row b attends to all seq_lens[b] keys of its row."""
        if out is None:
            out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        cu = meta.cu_seqlens_q_cpu
        num_seqs = meta.seq_lens.shape[0]
        num_decode = num_seqs if meta.decode_only else (
            _num_leading_decode_rows(cu) if cu is not None else 0)
        if 0 < num_decode < num_seqs:
            self._launch(query[:num_decode], kv_cache, meta.cu_seqlens_q[:num_decode + 1],
                         meta.seq_lens[:num_decode], meta.block_tables[:num_decode], scale,
                         out[:num_decode], decode_only=True, max_query_len=1,
                         max_seq_len=meta.max_seq_len, causal=causal)
            self._launch(query[num_decode:], kv_cache, meta.cu_seqlens_q, meta.seq_lens,
                         meta.block_tables, scale, out[num_decode:], decode_only=False,
                         max_query_len=meta.max_query_len, max_seq_len=meta.max_seq_len,
                         seq_base=num_decode, causal=causal)
        else:
            # Decode launches ignore lengths (see choose_launch): graph replays stay valid.
            self._launch(query, kv_cache, meta.cu_seqlens_q, meta.seq_lens, meta.block_tables,
                         scale, out, decode_only=num_decode == num_seqs,
                         max_query_len=1 if num_decode == num_seqs else meta.max_query_len,
                         max_seq_len=meta.max_seq_len, causal=causal)
        return out

    def _launch(self, query: torch.Tensor, kv_cache: torch.Tensor, cu_seqlens_q: torch.Tensor,
                seq_lens: torch.Tensor, block_tables: torch.Tensor, scale: float,
                out: torch.Tensor, *, decode_only: bool, max_query_len: int,
                max_seq_len: int, seq_base: int = 0, causal: bool = True) -> None:
        num_kv_heads = kv_cache.shape[3]
        launch = choose_launch(
            num_tokens=query.shape[0], num_seqs=seq_lens.shape[0] - seq_base,
            num_kv_heads=num_kv_heads,
            num_q_per_kv=query.shape[1] // num_kv_heads, dtype=query.dtype,
            max_query_len=max_query_len, max_seq_len=max_seq_len, decode_only=decode_only,
            num_sms=self.num_sms(query.device))
        paged_attention(query, kv_cache[0], kv_cache[1], cu_seqlens_q, seq_lens, block_tables,
                        scale, launch, out=out, seq_base=seq_base,
                        counters=self.split_kv_counters(query.device), causal=causal)

    def warm_up(self, kv_cache: torch.Tensor, num_heads: int, causal: bool = True) -> None:
        """Compile every launch variant for this layout now, not mid-serving (a compile
        stalls the step for a second), for the model's kind of attention (`causal`: each
        kind is a kernel of its own). Reads block 0 of kv_cache, writes nothing."""
        num_kv_heads, head_dim = kv_cache.shape[3], kv_cache.shape[4]
        device, dtype = kv_cache.device, kv_cache.dtype
        query = torch.zeros(1, num_heads, head_dim, dtype=dtype, device=device)
        cu_seqlens_q = torch.tensor([0, 1], dtype=torch.int32, device=device)
        seq_lens = torch.ones(1, dtype=torch.int32, device=device)
        block_tables = torch.zeros(1, 1, dtype=torch.int32, device=device)
        args = (query, kv_cache[0], kv_cache[1], cu_seqlens_q, seq_lens, block_tables,
                head_dim ** -0.5)
        counters = self.split_kv_counters(device)
        for launch in launch_variants(num_heads // num_kv_heads, dtype):
            paged_attention(*args, launch, counters=counters, causal=causal)

    def forward_no_cache(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         meta: AttentionMetadata, scale: float,
                         causal: bool = True) -> torch.Tensor:
        """Attention over each row's own tokens (profiling pass): key/value act as a cache
        of block size 1, row b's position i at token cu_seqlens_q[b] + i."""
        num_tokens, num_heads, _ = query.shape
        num_kv_heads = key.shape[1]
        cu = meta.cu_seqlens_q  # [B + 1] int32
        max_q = meta.max_query_len
        positions = torch.arange(max_q, dtype=torch.int32, device=query.device)
        block_tables = cu[:-1, None] + positions[None, :]  # [B, max_q]
        seq_lens = cu[1:] - cu[:-1]  # [B]: the context is the row's own tokens
        launch = choose_launch(
            num_tokens=num_tokens, num_seqs=seq_lens.shape[0], num_kv_heads=num_kv_heads,
            num_q_per_kv=num_heads // num_kv_heads, dtype=query.dtype,
            max_query_len=max_q, max_seq_len=max_q, decode_only=False,
            num_sms=self.num_sms(query.device))
        # [T, 1, Hkv, D]: one slot per block
        return paged_attention(query, key.unsqueeze(1), value.unsqueeze(1), cu, seq_lens,
                               block_tables, scale, launch,
                               counters=self.split_kv_counters(query.device), causal=causal)
