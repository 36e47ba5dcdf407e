"""The engine a model directory gets: the step loop of an autoregressive model, or of a
masked-diffusion one."""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine_service.config import EngineConfig
from engine_service.engine import LLMEngine
from models.config import ModelConfig

if TYPE_CHECKING:
    from engine_service.diffusion.engine import DiffusionEngine


def make_engine(config: EngineConfig) -> LLMEngine | DiffusionEngine:
    """LLMEngine, or DiffusionEngine for LLaDA and Dream: the same add_request / abort / step,
    and `engine.EngineServing` plus load_snapshot() for the core process."""
    if ModelConfig.from_dir(config.model).is_diffusion:
        from engine_service.diffusion.engine import DiffusionEngine

        return DiffusionEngine(config)
    return LLMEngine(config)
