"""Architecture name (config.json's `architectures`) -> model class."""

from __future__ import annotations

from torch import nn

from models.config import SUPPORTED_ARCHITECTURES, ModelConfig
from models.llama import LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM
from models.qwen3 import Qwen3ForCausalLM
from models.qwen3_moe import Qwen3MoeForCausalLM

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
}
assert tuple(MODEL_REGISTRY) == SUPPORTED_ARCHITECTURES


def get_model_class(config: ModelConfig) -> type[nn.Module]:
    return MODEL_REGISTRY[config.architecture]  # ModelConfig refused any other
