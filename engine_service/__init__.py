"""The nanoserve engine. `LLM` and `SamplingParams` load lazily so that torch-free parts
of this package (block hashing, sampling parameters, the CLI) import without torch."""

from typing import TYPE_CHECKING

from engine_service.common.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine_service.llm import LLM

__all__ = ["LLM", "SamplingParams"]


def __getattr__(name: str):
    if name == "LLM":
        from engine_service.llm import LLM

        return LLM
    raise AttributeError(name)
