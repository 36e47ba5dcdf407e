"""Head-sparse attention (dLLM-Serve's) for the diffusion engine's dual-cache passes, in plain
torch on every device.

At a block's choosing pass each KV head scores the candidate keys, every position outside the
block, by the mean over the block's queries of q.k * scale (GQA: the max over the query heads
sharing the KV head), smooths the scores with a max-pool over neighbouring candidates (kernel
3; the candidates in position order, so the prompt's last and the suffix's first are
neighbours), and keeps the top n_keep (ties: the earlier position). The block's later passes
attend, per KV head, only to its kept keys and the block's own keys, read from the paged cache
through the row's block table; the softmax runs in float32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from models.attention_metadata import HeadSparsity, KeyChoice

POOL_KERNEL = 3


def choose_keys(query: torch.Tensor, kv_cache: torch.Tensor, choice: KeyChoice, layer: int,
                scale: float) -> None:
    """query [T, H, D] of the forward; writes choice.keys[layer] [Hkv, n_keep], the positions
    each KV head keeps."""
    num_kv_heads, head_dim = kv_cache.shape[3], kv_cache.shape[4]
    start, end = choice.block_queries
    q = query[start:end].float().mean(0).view(num_kv_heads, -1, head_dim)  # [Hkv, group, D]
    keys = kv_cache[0].view(-1, num_kv_heads, head_dim)[choice.candidate_slots]  # [C, Hkv, D]
    scores = torch.einsum("hgd,chd->hgc", q, keys.float()).amax(1) * scale  # [Hkv, C]
    scores = F.max_pool1d(scores[:, None], POOL_KERNEL, stride=1,
                          padding=POOL_KERNEL // 2)[:, 0]  # [Hkv, C]
    n_keep = choice.keys.shape[-1]
    order = scores.sort(dim=-1, descending=True, stable=True).indices[:, :n_keep]
    choice.keys[layer] = choice.candidate_positions[order]


def attend_kept_keys(query: torch.Tensor, kv_cache: torch.Tensor, sparsity: HeadSparsity,
                     layer: int, scale: float) -> torch.Tensor:
    """The trailing rows' attention: query [T, H, D] of the forward -> [T - num_dense_tokens,
    H, D], each query over its row's kept and block keys, per KV head."""
    num_kv_heads, head_dim = kv_cache.shape[3], kv_cache.shape[4]
    rows, q_len = sparsity.query_index.shape
    num_heads = query.shape[1]
    group = num_heads // num_kv_heads
    q = query[sparsity.query_index].float()  # [R, Q, H, D]
    q = q.view(rows, q_len, num_kv_heads, group, head_dim).permute(0, 2, 3, 1, 4)
    slots = sparsity.key_slots[layer]  # [R, Hkv, K]
    heads = torch.arange(num_kv_heads, device=slots.device)[None, :, None]  # [1, Hkv, 1]
    k = kv_cache[0].view(-1, num_kv_heads, head_dim)[slots, heads].float()  # [R, Hkv, K, D]
    v = kv_cache[1].view(-1, num_kv_heads, head_dim)[slots, heads].float()  # [R, Hkv, K, D]
    scores = torch.einsum("rhgqd,rhkd->rhgqk", q, k) * scale  # [R, Hkv, group, Q, K]
    scores.masked_fill_(~sparsity.key_valid[:, None, None, None, :], -torch.inf)
    out = torch.einsum("rhgqk,rhkd->rqhgd", scores.softmax(-1), v)  # [R, Q, Hkv, group, D]
    out = out.reshape(rows, q_len, num_heads, head_dim)[sparsity.query_valid]
    return out.to(query.dtype)  # [T - num_dense_tokens, H, D]
