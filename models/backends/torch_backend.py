"""Reference attention in plain torch, used on CPU and as the other backends' reference. It
walks the batch row by row on the host, so it is not CUDA-graph capturable."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from models.attention_metadata import AttentionMetadata


def _attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float,
            causal: bool = True) -> torch.Tensor:
    """Attention of one row in float32 over the context key/value [kv_len, Hkv, D]. Causal:
    query [q_len, H, D] holds the LAST q_len positions of the context; non-causal: every
    query attends to all kv_len keys, wherever it sits."""
    q_len, num_heads, _ = query.shape
    kv_len, num_kv_heads, _ = key.shape
    group = num_heads // num_kv_heads
    q = query.float().transpose(0, 1)  # [H, q_len, D]
    # GQA: query head h reads KV head h // group.
    k = key.float().transpose(0, 1).repeat_interleave(group, dim=0)  # [H, kv_len, D]
    v = value.float().transpose(0, 1).repeat_interleave(group, dim=0)  # [H, kv_len, D]
    mask = None
    if causal:
        query_pos = torch.arange(kv_len - q_len, kv_len, device=query.device)  # [q_len]
        key_pos = torch.arange(kv_len, device=query.device)  # [kv_len]
        # Not is_causal=True: SDPA aligns that mask top-left, wrong when q_len < kv_len.
        mask = key_pos[None, :] <= query_pos[:, None]  # [q_len, kv_len], True = attend
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    return out.transpose(0, 1).to(query.dtype)  # [q_len, H, D]


def _host_lists(meta: AttentionMetadata) -> tuple[list[int], list[int]]:
    seq_lens = meta.seq_lens_cpu if meta.seq_lens_cpu is not None else meta.seq_lens.tolist()
    cu = (meta.cu_seqlens_q_cpu if meta.cu_seqlens_q_cpu is not None
          else meta.cu_seqlens_q.tolist())
    return seq_lens, cu


def store_kv(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """key/value [T, Hkv, D] -> kv_cache [2, num_blocks, block_size, Hkv, D] at slot_mapping
    (slot -1: skipped). The boolean mask reads the slots back: not CUDA-graph capturable."""
    _, num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
    # view (not reshape): a copy would silently drop the writes.
    k_cache = kv_cache[0].view(num_blocks * block_size, num_kv_heads, head_dim)
    v_cache = kv_cache[1].view(num_blocks * block_size, num_kv_heads, head_dim)
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    k_cache[slots] = key[keep].to(kv_cache.dtype)
    v_cache[slots] = value[keep].to(kv_cache.dtype)


class TorchAttentionBackend:
    name = "torch"
    supports_non_causal = True

    store_kv = staticmethod(store_kv)

    def forward(self, query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                scale: float, out: torch.Tensor | None = None,
                causal: bool = True) -> torch.Tensor:
        """query [T, H, D] -> [T, H, D] (written into `out` when given), attending over each
        row's cached context: its first seq_lens[b] tokens, all of them when not causal."""
        _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
        seq_lens, cu = _host_lists(meta)
        if out is None:
            out = torch.empty_like(query)
        for row, seq_len in enumerate(seq_lens):
            start, end = cu[row], cu[row + 1]
            if end == start:
                continue
            num_blocks = -(-seq_len // block_size)
            blocks = meta.block_tables[row, :num_blocks].long()  # [num_blocks]
            # [num_blocks, block_size, Hkv, D] -> the first seq_len tokens of the context
            key = kv_cache[0, blocks].reshape(-1, num_kv_heads, head_dim)[:seq_len]
            value = kv_cache[1, blocks].reshape(-1, num_kv_heads, head_dim)[:seq_len]
            out[start:end] = _attend(query[start:end], key, value, scale, causal)
        return out

    def warm_up(self, kv_cache: torch.Tensor, num_heads: int, causal: bool = True) -> None:
        """Nothing to compile ahead of serving."""

    def forward_no_cache(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         meta: AttentionMetadata, scale: float,
                         causal: bool = True) -> torch.Tensor:
        """Attention over each row's own tokens (no cache yet). query [T, H, D],
        key/value [T, Hkv, D]."""
        _, cu = _host_lists(meta)
        out = torch.empty_like(query)
        for row in range(len(cu) - 1):
            start, end = cu[row], cu[row + 1]
            if end > start:
                out[start:end] = _attend(query[start:end], key[start:end],
                                         value[start:end], scale, causal)
        return out
