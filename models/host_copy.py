"""Host lists to device tensors without a synchronisation: one pinned, non-blocking copy."""

from __future__ import annotations

import torch


def to_device(values: list, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    t = torch.tensor(values, dtype=dtype)
    if torch.device(device).type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)
