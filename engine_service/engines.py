"""The engine a model directory gets: the step loop of an autoregressive model, or of a
masked-diffusion one."""

from __future__ import annotations

from engine_service.config import EngineConfig
from engine_service.engine import LLMEngine
from models.config import ModelConfig


def make_engine(config: EngineConfig):
    """LLMEngine, or DiffusionEngine for LLaDA and Dream (same add_request / abort / step)."""
    if ModelConfig.from_dir(config.model).is_diffusion:
        from engine_service.diffusion.engine import DiffusionEngine

        return DiffusionEngine(config)
    return LLMEngine(config)
