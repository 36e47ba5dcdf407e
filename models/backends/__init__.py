"""Attention backends: one interface, picked by name.

A backend has `.name`, `.supports_non_causal`, `store_kv(key, value, kv_cache, slot_mapping)`,
`forward(query, kv_cache, meta, scale, causal=True)`,
`forward_no_cache(query, key, value, meta, scale, causal=True)` and
`warm_up(kv_cache, num_heads, causal=True)` (see models/backends/torch_backend.py, the
reference). `causal=False` is the bidirectional attention of diffusion LLMs.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import torch

BACKENDS = ("auto", "torch", "triton", "flash-attn")


def _installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def get_attention_backend(name: str, device: torch.device | str) -> Any:
    device = torch.device(device)
    if name == "auto":
        name = "triton" if device.type == "cuda" and _installed("triton") else "torch"
    if name == "torch":
        from models.backends.torch_backend import TorchAttentionBackend

        return TorchAttentionBackend()
    if name in ("triton", "flash-attn"):
        if device.type != "cuda":
            raise ValueError(f"attention_backend={name!r} needs a CUDA device, got "
                             f"{device.type!r}; use 'torch' or 'auto'")
        package = "triton" if name == "triton" else "flash_attn"
        if not _installed(package):
            raise ValueError(f"attention_backend={name!r} needs the {package!r} package, "
                             f"which is not installed; use 'auto' or 'torch'")
        if name == "triton":
            from models.backends.triton_backend import TritonAttentionBackend

            return TritonAttentionBackend()
        from models.backends.flash_attn_backend import FlashAttnBackend

        return FlashAttnBackend()
    raise ValueError(f"attention_backend must be one of {BACKENDS}, got {name!r}")
