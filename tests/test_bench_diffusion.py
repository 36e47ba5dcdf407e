"""`nanoserve bench diffusion` on a tiny LLaDA in float32: every variant runs at two batch
sizes, the plain reference loop (transformers' Llama over the engine's weights) gives the
tokens of the engine with caches off, and of the test suite's own reference loop; the figures
add up and each run prints a line gpu_suite reads. Also: the llada-8b preset is LLaDA-8B's
shape."""

from __future__ import annotations

import argparse

import pytest
import torch

from benchmarks import diffusion_bench as bench
from benchmarks.gpu_suite import _DIFFUSION_RUN
from benchmarks.model_configs import resolve_model
from engine_service.common.sampling_params import DiffusionParams
from models.config import ModelConfig
from tests.test_diffusion_engine import reference_tokens
from tests.test_diffusion_models import FAMILIES, hf_model
from tests.tiny_checkpoints import make_tiny_llada

SMALL = ["--device", "cpu", "--dtype", "float32", "--gen-length", "8", "--steps", "8",
         "--block-length", "4", "--batch-sizes", "1,3", "--prompt-len", "6", "--no-record"]


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_every_variant_runs_and_plain_equals_the_exact_engine(tmp_path, capsys):
    model_dir = make_tiny_llada(tmp_path / "llada", seed=3)
    args = _args("--model", str(model_dir), *SMALL)
    runs = bench.run(args)
    out = capsys.readouterr().out

    variants = [bench.PLAIN, *bench.VARIANTS]
    assert sorted((r.batch, r.variant) for r in runs) == sorted(
        (b, v) for b in (1, 3) for v in variants)
    by = {(r.batch, r.variant): r for r in runs}
    for batch in (1, 3):
        exact = by[batch, bench.REFERENCE]
        assert by[batch, bench.PLAIN].tokens == exact.tokens
        assert by[batch, bench.PLAIN].agreement == 1.0
        assert exact.agreement is None
        for variant in variants:
            r = by[batch, variant]
            assert len(r.tokens) == batch and all(len(t) == 8 for t in r.tokens)
            assert r.seconds > 0 and r.tokens_per_s > 0
            if variant != bench.REFERENCE:
                assert r.agreement == bench.agreement(r.tokens, exact.tokens)
            if variant != "threshold":  # one pass a step for every request
                assert r.passes == batch * 8
            else:  # at least one position a pass, at most the schedule's passes
                assert batch * 2 <= r.passes <= batch * 8

    # The plain loop is the papers' loop: the test suite's reference on one request.
    family = next(f for f in FAMILIES if f.id == "llada")
    mask_id = ModelConfig.from_dir(model_dir).mask_token_id
    prompt = bench.make_prompts(1, 6, mask_id, 0, "timed")[0]
    want, passes = reference_tokens(hf_model(family, model_dir), family, mask_id, prompt,
                                    DiffusionParams(gen_length=8, steps=8, block_length=4), 0)
    assert by[1, bench.PLAIN].tokens == [want] and passes == 8

    for r in runs:  # a line as each run ends
        assert r.line() in out
    parsed = {(int(b), v) for b, v, *_ in _DIFFUSION_RUN.findall(out)}
    assert parsed == {(r.batch, r.variant) for r in runs}


def test_variants_are_checked():
    with pytest.raises(SystemExit):
        _args("--model", "x", "--variants", "plain,sparse2")
    assert _args("--model", "x", "--variants", "dual,plain").variants == ["dual", "plain"]


def test_llada_8b_preset_is_llada_8b():
    """The published config.json's keys, read as LLaDA-8B: 8.02B parameters (built on the
    meta device, so nothing is allocated)."""
    from models.backends.torch_backend import TorchAttentionBackend
    from models.registry import get_model_class

    model_dir, is_preset = resolve_model("llada-8b")
    config = ModelConfig.from_dir(model_dir)
    assert is_preset and config.is_diffusion and not config.causal
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads,
            config.num_key_value_heads, config.intermediate_size, config.vocab_size,
            config.mask_token_id) == (4096, 32, 32, 32, 12288, 126464, 126336)
    with torch.device("meta"):
        model = get_model_class(config)(config, TorchAttentionBackend())
    assert round(sum(p.numel() for p in model.parameters()) / 1e9, 2) == 8.02
