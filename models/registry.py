"""Architecture name (config.json's `architectures`) -> model class."""

from __future__ import annotations

import torch
from torch import nn

from models.config import SUPPORTED_ARCHITECTURES, ModelConfig
from models.dream import DreamModel
from models.llada import LLaDAModelLM
from models.llama import LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM
from models.loader import init_dummy_weights, load_weights
from models.qwen3 import Qwen3ForCausalLM
from models.qwen3_moe import Qwen3MoeForCausalLM

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "LLaDAModelLM": LLaDAModelLM,
    "DreamModel": DreamModel,
}
assert tuple(MODEL_REGISTRY) == SUPPORTED_ARCHITECTURES


def get_model_class(config: ModelConfig) -> type[nn.Module]:
    return MODEL_REGISTRY[config.architecture]  # ModelConfig refused any other


def build_model(model_config: ModelConfig, model_dir: str, backend, device: torch.device,
                dtype: torch.dtype, seed: int, load_format: str) -> nn.Module:
    """The checkpoint's model on `device` in `dtype`, in eval mode, with its weights loaded
    (random ones from `seed` under load_format "dummy")."""
    torch.manual_seed(seed)
    with torch.device(device):
        prev = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            model = get_model_class(model_config)(model_config, backend)
        finally:
            torch.set_default_dtype(prev)
    if load_format == "dummy":
        init_dummy_weights(model, seed)
    else:
        load_weights(model, model_dir)
    return model.eval()
