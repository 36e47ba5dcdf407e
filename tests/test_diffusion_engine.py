"""The diffusion engine's tokens equal a plain reference loop's: the LLaDA paper's block-wise
decoding (and Fast-dLLM's threshold rule), written here over transformers' Llama / Qwen2 run
with a full non-causal mask, recomputing the whole canvas every pass, one request at a time.
The engine batches requests at different blocks and passes; with temperature 0 and caches
off its tokens must be the same."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine_service import LLM, SamplingParams
from engine_service.common.sampling_params import DiffusionParams
from engine_service.diffusion.engine import DiffusionEngine
from engine_service.diffusion.unmasking import draw_keys
from models.layers.sampler import hashed_uniform
from tests.helpers import random_prompts
from tests.test_diffusion_models import FAMILIES, Family, hf_logits, hf_model

ENGINE = dict(device="cpu", dtype="float32", num_kv_blocks=128, max_model_len=256)
RANDOM_SALT = 1 << 40  # unmasking.py's offset of the random remasking rule's draws


def unmask_block(x: list[int], start: int, block: torch.Tensor, mask_id: int,
                 p: DiffusionParams, seed: int, passes: int, b: int, count: int) -> None:
    """One pass's unmasking of block b (scored by `block` [block_length, V], float64) in x,
    as the papers define it: the `count` most confident masked positions (or every one
    above the threshold, at least one); random remasking ranks by the engine's keyed draws."""
    n = p.block_length
    block[:, mask_id] = -torch.inf
    predicted = block.argmax(-1).tolist()
    confidence = block.softmax(-1).max(-1).values.tolist()
    if p.remasking == "random":
        keys = torch.tensor(draw_keys(passes, range(b * n, (b + 1) * n)))
        confidence = hashed_uniform(torch.full((n,), seed), keys + RANDOM_SALT,
                                    1).squeeze(1).tolist()
    masked = [j for j in range(n) if x[start + j] == mask_id]
    masked.sort(key=lambda j: -confidence[j])
    if p.confidence_threshold is None:
        chosen = masked[:count]
    else:
        chosen = masked[:1] + [j for j in masked[1:] if confidence[j] >= p.confidence_threshold]
    for j in chosen:
        x[start + j] = predicted[j]


def reference_tokens(model, family: Family, mask_id: int, prompt: list[int],
                     p: DiffusionParams, seed: int) -> tuple[list[int], int]:
    """(generated tokens, passes) of one request by the papers' loop, with temperature 0."""
    x = list(prompt) + [mask_id] * p.gen_length
    shift = int(family.predicts_next_token)
    passes = 0
    for b in range(p.num_blocks):
        start = len(prompt) + b * p.block_length
        end = start + p.block_length
        base, extra = divmod(p.block_length, p.steps_per_block)
        schedule = [base + (i < extra) for i in range(p.steps_per_block)]
        i = 0
        while mask_id in x[start:end]:
            logits = hf_logits(model, x, causal=False).double()  # [L, V]
            if p.cfg_scale > 0:
                uncond = [mask_id] * len(prompt) + x[len(prompt):]
                un = hf_logits(model, uncond, causal=False).double()
                logits = un + (p.cfg_scale + 1) * (logits - un)
            block = logits[start - shift:end - shift]
            unmask_block(x, start, block, mask_id, p, seed, passes, b, schedule[i])
            i += 1
            passes += 1
    return x[len(prompt):], passes


@pytest.fixture(scope="module", params=["llada", "dream"])
def family_setup(request, tmp_path_factory):
    family = next(f for f in FAMILIES if f.id == request.param)
    model_dir = Path(family.make(tmp_path_factory.mktemp(family.id), seed=3,
                                 **family.make_kwargs))
    llm = LLM(str(model_dir), **ENGINE)
    return family, model_dir, llm, hf_model(family, model_dir)


SETTINGS = [
    DiffusionParams(gen_length=16, steps=8, block_length=8),
    DiffusionParams(gen_length=12, steps=12, block_length=4),
    DiffusionParams(gen_length=16, steps=4, block_length=16),
    DiffusionParams(gen_length=16, steps=16, block_length=8, remasking="random"),
    DiffusionParams(gen_length=16, steps=16, block_length=8, confidence_threshold=0.02),
    DiffusionParams(gen_length=8, steps=4, block_length=4, cfg_scale=1.5),
]


@pytest.mark.parametrize("params", SETTINGS, ids=lambda p: f"g{p.gen_length}s{p.steps}"
                         f"b{p.block_length}-{p.remasking}-t{p.confidence_threshold}"
                         f"-cfg{p.cfg_scale}")
def test_engine_equals_the_reference_loop(family_setup, params):
    family, _, llm, hf = family_setup
    engine: DiffusionEngine = llm.engine
    vocab = engine.vocab_size
    prompts = random_prompts(3, vocab - 2, seed=params.gen_length + params.steps, lo=2, hi=12)
    sp = [SamplingParams(diffusion=params, ignore_eos=True, seed=10 + i)
          for i in range(len(prompts))]
    outs = llm.generate(prompts, sp, use_tqdm=False)
    fewest_passes = params.gen_length
    for prompt, out, s in zip(prompts, outs, sp, strict=True):
        want, passes = reference_tokens(hf, family, engine.mask_token_id, prompt, params,
                                        s.seed)
        assert out.token_ids == want
        assert out.finish_reason == "length"
        fewest_passes = min(fewest_passes, passes)
    if params.confidence_threshold is not None:  # some pass unmasked several positions
        assert fewest_passes < params.gen_length
    assert engine.block_manager.all_free()


def test_requests_join_at_different_passes(family_setup):
    """Requests added while others are mid-block, with different settings, batched in one
    pass; each equals its reference and reports its passes."""
    family, _, llm, hf = family_setup
    engine: DiffusionEngine = llm.engine
    mask_id = engine.mask_token_id
    prompts = random_prompts(4, engine.vocab_size - 2, seed=5, lo=2, hi=12)
    settings = [SETTINGS[0], SETTINGS[1], SETTINGS[3], SETTINGS[4]]
    outputs: dict[str, list[int]] = {}
    passes: dict[str, int] = {}
    for i, (prompt, p) in enumerate(zip(prompts, settings, strict=True)):
        engine.add_request(f"r{i}", prompt, SamplingParams(diffusion=p, ignore_eos=True,
                                                           seed=i))
        outputs[f"r{i}"] = []
        for _ in range(3):  # the next request joins three passes later
            for out in engine.step():
                outputs[out.request_id] += out.new_token_ids
                passes[out.request_id] = out.num_forward_passes
    assert len(engine.running) > 1
    while engine.has_unfinished():
        for out in engine.step():
            outputs[out.request_id] += out.new_token_ids
            passes[out.request_id] = out.num_forward_passes
    for i, (prompt, p) in enumerate(zip(prompts, settings, strict=True)):
        want, want_passes = reference_tokens(hf, family, mask_id, prompt, p, seed=i)
        assert outputs[f"r{i}"] == want
        assert passes[f"r{i}"] == want_passes
    assert engine.block_manager.all_free()


def test_kv_budget_admits_what_fits(family_setup):
    """A KV budget for two canvases at a time: the rest wait, all finish, tokens unchanged."""
    family, model_dir, _, hf = family_setup
    llm = LLM(str(model_dir), **dict(ENGINE, num_kv_blocks=16, kv_block_size=4,
                                     max_model_len=32))
    engine: DiffusionEngine = llm.engine
    params = DiffusionParams(gen_length=16, steps=8, block_length=8)
    prompts = random_prompts(4, engine.vocab_size - 2, seed=9, lo=8, hi=12)
    seen_waiting = []
    step = engine.step

    def spy():
        seen_waiting.append(len(engine.waiting))
        return step()

    engine.step = spy
    outs = llm.generate(prompts, SamplingParams(diffusion=params, ignore_eos=True),
                        use_tqdm=False)
    assert max(seen_waiting) >= 2
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.token_ids == reference_tokens(hf, family, engine.mask_token_id, prompt,
                                                 params, 0)[0]


def test_eos_ends_the_request_with_its_block(family_setup):
    """A block holding an eos is the last: the output ends at the eos, finish_reason stop."""
    family, _, llm, hf = family_setup
    engine: DiffusionEngine = llm.engine
    params = DiffusionParams(gen_length=16, steps=8, block_length=4)
    prompt = random_prompts(1, engine.vocab_size - 2, seed=2, lo=6, hi=6)[0]
    want, _ = reference_tokens(hf, family, engine.mask_token_id, prompt, params, 0)
    stop = want[5]  # in the second block
    out = llm.generate([prompt], SamplingParams(diffusion=params, stop_token_ids=[stop]),
                       use_tqdm=False)[0]
    cut = want.index(stop)
    assert out.token_ids == want[:cut + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop


@pytest.mark.parametrize("field, value", [("top_p", 0.5), ("max_tokens", 64),
                                          ("temperature", 0.7), ("logprobs", 2)])
def test_autoregressive_parameters_are_refused(family_setup, field, value):
    _, _, llm, _ = family_setup
    with pytest.raises(ValueError, match=field):
        llm.generate([[1, 2, 3]], SamplingParams(**{field: value}), use_tqdm=False)


def test_diffusion_parameters_are_refused_by_autoregressive_engines(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), **ENGINE)
    with pytest.raises(ValueError, match="diffusion"):
        llm.generate([[1, 2, 3]], SamplingParams(diffusion=DiffusionParams()), use_tqdm=False)


def test_diffusion_params_from_the_wire():
    """Unset proto fields keep the defaults; floats arrive as the decimals that were sent."""
    from engine_service.common.proto_convert import sampling_params_from_request
    from nanoserve.v1 import nanoserve_pb2 as pb

    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1]))
    assert sampling_params_from_request(request).diffusion is None
    request.diffusion.SetInParent()
    assert sampling_params_from_request(request).diffusion == DiffusionParams()
    request.diffusion.MergeFrom(pb.DiffusionParams(gen_length=64, steps=16, block_length=16,
                                                   remasking="random", temperature=0.3,
                                                   confidence_threshold=0.9))
    assert sampling_params_from_request(request).diffusion == DiffusionParams(
        gen_length=64, steps=16, block_length=16, remasking="random", temperature=0.3,
        confidence_threshold=0.9)


@pytest.mark.parametrize("kwargs, field", [
    (dict(gen_length=10, block_length=4), "block_length"),
    (dict(gen_length=16, block_length=8, steps=3), "steps"),
    (dict(remasking="entropy"), "remasking"),
    (dict(confidence_threshold=1.5), "confidence_threshold"),
    (dict(cfg_scale=-1.0), "cfg_scale"),
])
def test_bad_diffusion_parameters_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        DiffusionParams(**kwargs)
