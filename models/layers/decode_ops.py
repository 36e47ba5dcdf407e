"""Decode fast paths at the torch level: the only API the model calls for them.

Each op is defined by its torch composition, and served by a Triton kernel where it pays
(models/kernels/decode_gemv.py, rope_store.py), chosen by shape like cuBLAS's heuristics;
results agree with the torch path to rounding:
- `linear`: F.linear; the batch-1 GEMV for one bf16/fp16 CUDA row.
- `norm_linear`: `[x + residual ->] rms_norm -> linear [-> silu_and_mul]`, plus the new residual.
- `rope_store`: `split qkv -> [q_norm / k_norm] -> rotary -> store k / v in the paged cache`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from models.backends.torch_backend import store_kv
from models.layers.activation import silu_and_mul
from models.layers.fusion import fused
from models.layers.layernorm import add_rms_norm, rms_norm
from models.layers.rotary import apply_rotary

# (key [T, Hkv, D], value, kv_cache, slot_mapping) -> None: an attention backend's store_kv.
StoreKV = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]
# dtypes the GEMV kernels serve from here (float32 works, but cuBLAS is as good there).
GEMV_DTYPES = (torch.bfloat16, torch.float16)
# Largest K the fused norm serves: every program re-reads the row over K for the statistics,
# a cost that grows with K while the launches it saves do not.
NORM_GEMV_MAX_K = 16384


def _gemv_serves(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """One bf16/fp16 CUDA row, a contiguous [N, K] weight of its dtype, K a multiple of 16
    (16-byte aligned weight rows: Triton then vectorizes the loads), a [N] bias."""
    if not (x.is_cuda and x.dim() == 2 and x.shape[0] == 1 and weight.dim() == 2):
        return False
    k = x.shape[1]
    return (x.dtype in GEMV_DTYPES and weight.dtype == x.dtype and weight.shape[1] == k
            and k % 16 == 0 and weight.shape[0] > 0 and x.stride(-1) == 1
            and weight.is_contiguous() and weight.data_ptr() % 16 == 0
            and (bias is None or (bias.dtype == x.dtype and bias.shape == weight.shape[:1]
                                  and bias.is_contiguous())))


def linear(x: torch.Tensor, weight: torch.Tensor,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias); the batch-1 Triton GEMV where it serves."""
    if _gemv_serves(x, weight, bias):
        from models.kernels.decode_gemv import decode_gemv  # triton: CUDA torch ships it

        return decode_gemv(x, weight, bias)[0]
    return F.linear(x, weight, bias)


def _norm_linear_torch(x: torch.Tensor, residual: torch.Tensor | None,
                       norm_weight: torch.Tensor, eps: float, weight: torch.Tensor,
                       bias: torch.Tensor | None, silu_mul: bool
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    if residual is None:
        h, new_residual = fused(rms_norm, x)(x, norm_weight, eps), x
    else:
        h, new_residual = fused(add_rms_norm, x)(x, residual, norm_weight, eps)
    out = F.linear(h, weight, bias)
    if silu_mul:
        out = fused(silu_and_mul, out)(out)
    return out, new_residual


def norm_linear(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor,
                eps: float, weight: torch.Tensor, bias: torch.Tensor | None = None,
                silu_mul: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, new_residual): new_residual = x [+ residual], out = [silu_and_mul](
    rms_norm(new_residual) @ weight.T + bias). x, residual [T, K]; weight [N, K] (gate | up
    rows with silu_mul); out [T, N] ([T, N / 2]). x and residual are never written."""
    if (_gemv_serves(x, weight, bias) and x.shape[1] <= NORM_GEMV_MAX_K
            and norm_weight.dtype == x.dtype and norm_weight.shape == x.shape[1:]
            and norm_weight.stride(0) == 1
            and (not silu_mul or weight.shape[0] % 2 == 0)
            and (residual is None or (residual.shape == x.shape and residual.dtype == x.dtype
                                      and residual.stride(-1) == 1))):
        from models.kernels.decode_gemv import decode_gemv

        return decode_gemv(x, weight, bias, residual=residual, norm_weight=norm_weight,
                           eps=eps, silu_mul=silu_mul)
    return _norm_linear_torch(x, residual, norm_weight, eps, weight, bias, silu_mul)


def _rope_kernel_serves(qkv: torch.Tensor, kv_cache: torch.Tensor | None, head_dim: int,
                        rotary_dim: int) -> bool:
    """A CUDA step with a cache and a head size the kernel serves (the launcher asserts the
    layouts the model always passes)."""
    if kv_cache is None or not qkv.is_cuda:
        return False
    from models.kernels.rope_store import rope_store_supported

    return rope_store_supported(head_dim, rotary_dim)


def rope_store(qkv: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
               rotary_dim: int, q_norm_weight: torch.Tensor | None,
               k_norm_weight: torch.Tensor | None, eps: float, kv_cache: torch.Tensor | None,
               slot_mapping: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int,
               store: StoreKV = store_kv
               ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """qkv [T, (H + 2 * Hkv) * D] -> (q [T, H, D], k, v): q and k per-head rms_norm'd (when
    weights are given) and rotated (NeoX, first rotary_dim dims). With a cache
    ([2, num_blocks, block_size, Hkv, D]) k and v are stored at slot_mapping (-1: not stored,
    by `store`, the backend's store_kv) and returned as None; without one, returned as is."""
    if _rope_kernel_serves(qkv, kv_cache, head_dim, rotary_dim):
        from models.kernels.rope_store import rope_store_kernel

        q = rope_store_kernel(qkv, positions, cos_sin_cache, rotary_dim, q_norm_weight,
                              k_norm_weight, eps, kv_cache[0], kv_cache[1], slot_mapping,
                              num_heads, num_kv_heads, head_dim)
        return q, None, None
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    q = q.reshape(-1, num_heads, head_dim)
    k = k.reshape(-1, num_kv_heads, head_dim)
    v = v.reshape(-1, num_kv_heads, head_dim)
    if q_norm_weight is not None:
        q = fused(rms_norm, q)(q, q_norm_weight, eps)
    if k_norm_weight is not None:
        k = fused(rms_norm, k)(k, k_norm_weight, eps)
    q, k = fused(apply_rotary, q)(positions, q, k, cos_sin_cache, rotary_dim)
    if kv_cache is None:
        return q, k, v
    store(k, v, kv_cache, slot_mapping)
    return q, None, None
