"""Vocabulary-parallel token embedding and LM head.

The vocabulary is split into tp_size equal contiguous ranges of ceil(vocab / tp_size) rows;
the last rank's range is padded with zero rows that no token id maps to and whose logits are
cut off after the gather.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from models.layers.decode_ops import linear
from models.layers.fusion import fused
from models.parallel import (
    WeightSource,
    check_shape,
    get_tp_rank,
    get_tp_size,
    narrow_weight,
    tp_all_gather_last_dim,
    tp_all_reduce,
)


def masked_embedding(input_ids: torch.Tensor, weight: torch.Tensor, vocab_start: int,
                     vocab_end: int) -> torch.Tensor:
    """Rows of this rank's vocab range [vocab_start, vocab_end), zeros for other ids: summed
    over the ranks, exactly one non-zero row per token."""
    in_range = (input_ids >= vocab_start) & (input_ids < vocab_end)  # [num_tokens]
    local_ids = (input_ids - vocab_start) * in_range
    return F.embedding(local_ids, weight) * in_range.unsqueeze(-1).to(weight.dtype)


class VocabParallelEmbedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.tp_rank = get_tp_rank()
        self.tp_size = get_tp_size()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.num_per_rank = -(-num_embeddings // self.tp_size)
        self.vocab_start = self.tp_rank * self.num_per_rank
        self.vocab_end = min(self.vocab_start + self.num_per_rank, num_embeddings)
        self.weight = nn.Parameter(torch.empty(self.num_per_rank, embedding_dim),
                                   requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded_weight: WeightSource,
                      shard_id: str | int | None = None) -> None:
        check_shape(param, (self.num_embeddings, self.embedding_dim), loaded_weight,
                    type(self).__name__)
        rows = max(self.vocab_end - self.vocab_start, 0)
        param.data.zero_()  # padding rows of the last rank
        param.data.narrow(0, 0, rows).copy_(
            narrow_weight(loaded_weight, 0, self.vocab_start, rows))

    def forward(self, input_ids: torch.Tensor, reduce: bool = True) -> torch.Tensor:
        """input_ids [T] -> [T, embedding_dim]; with reduce=False this rank's partial sum,
        for a caller that reduces it with its next norm."""
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        out = fused(masked_embedding, input_ids)(input_ids, self.weight, self.vocab_start,
                                                 self.vocab_end)
        return tp_all_reduce(out) if reduce else out


class ParallelLMHead(VocabParallelEmbedding):
    """Logits = hidden @ W^T over this rank's vocab range, gathered to the full vocabulary.
    Tied embeddings share the embedding's parameter (same shard layout)."""

    def forward(self, hidden_states: torch.Tensor, gather: bool = True) -> torch.Tensor:
        """hidden_states [num_tokens, embedding_dim] -> logits [num_tokens, num_embeddings],
        or with gather=False this rank's columns only, vocab_start .. vocab_end - 1."""
        logits = linear(hidden_states, self.weight)  # [num_tokens, num_per_rank]
        if not gather:
            return logits[..., : self.vocab_end - self.vocab_start]  # the last rank pads
        if self.tp_size > 1:
            logits = tp_all_gather_last_dim(logits)
        return logits[..., : self.num_embeddings]
