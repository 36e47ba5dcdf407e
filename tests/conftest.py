"""Shared fixtures. The autouse `kv_blocks_all_free` check runs after EVERY test: any
LLMEngine alive in this process must end the test with every KV block free and every ref
count zero, so no engine test can forget to check it."""

from __future__ import annotations

import json
import os
import sys
import weakref
from collections.abc import Callable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

_LIVE_ENGINES: weakref.WeakSet = weakref.WeakSet()


def assert_all_blocks_free(block_manager) -> None:
    bm = block_manager
    used = [b.block_id for b in bm.blocks if b.ref_count != 0]
    assert not used, f"KV blocks still referenced after the test: {used[:10]}"
    assert bm.num_free_blocks == bm.num_blocks, (
        f"{bm.num_blocks - bm.num_free_blocks} KV blocks not back in the free list")


@pytest.fixture(scope="session", autouse=True)
def _track_engines():
    """Record every LLMEngine created in this process, whatever fixture scope made it."""
    try:
        from engine_service import engine as engine_mod
    except ImportError:  # torch-free environments (router-only checks)
        yield
        return
    original_init = engine_mod.LLMEngine.__init__

    def tracking_init(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        _LIVE_ENGINES.add(self)

    engine_mod.LLMEngine.__init__ = tracking_init
    yield
    engine_mod.LLMEngine.__init__ = original_init


@pytest.fixture(autouse=True)
def kv_blocks_all_free(_track_engines):
    yield
    for eng in list(_LIVE_ENGINES):
        assert not eng.has_unfinished(), "requests left unfinished in the engine"
        assert_all_blocks_free(eng.block_manager)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    from models.tiny_model import make_tiny_model

    return Path(make_tiny_model(tmp_path_factory.mktemp("tiny"), seed=0))


@pytest.fixture(scope="session")
def hf_model(tiny_model_dir):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    return model.eval()


@pytest.fixture
def make_config(tmp_path: Path) -> Callable:
    """`make_config(**engine_config)`: an EngineConfig over a model dir holding only a minimal
    config.json (max_position_embeddings 256); num_kv_blocks defaults to 64."""
    from engine_service.config import EngineConfig

    model_dir = tmp_path / "model"

    def make(**kw: object) -> EngineConfig:
        model_dir.mkdir(exist_ok=True)
        (model_dir / "config.json").write_text(json.dumps({"max_position_embeddings": 256}))
        kw.setdefault("num_kv_blocks", 64)
        return EngineConfig(model=str(model_dir), **kw)

    return make
