"""Dream (Dream-org/Dream-v0-*, `DreamModel`): a masked-diffusion LLM with Qwen2's decoder
(q/k/v biases, same tensor names) and bidirectional attention.

Dream keeps the autoregressive shift it was initialised from: its logits at position i score
the token at i + 1, so the engine reads a masked position's prediction one row earlier.
"""

from __future__ import annotations

from models.llama import LlamaForCausalLM


class DreamModel(LlamaForCausalLM):
    """Qwen2's layers (ModelConfig sets the q/k/v biases and makes attention non-causal);
    its logits at i score the token at i + 1, as an autoregressive model's do."""
