"""Speculative decoding on a GPU: float32 tokens identical with speculation on and off,
through the verify CUDA graphs and eagerly, for ngram and a draft model, greedy and sampled."""

from __future__ import annotations

import json

import pytest

from engine_service import LLM, SamplingParams
from tests.helpers import random_prompts

MAX_TOKENS = 48


def _prompts(model_dir) -> list[list[int]]:
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    prompts = random_prompts(6, vocab, 5, 4, 60)
    return prompts + [p[:12] * 4 for p in prompts[:6]]  # repeated spans: proposals that hit


def _llm(model_dir, **kw) -> LLM:
    return LLM(str(model_dir), device="cuda", dtype="float32", num_kv_blocks=512,
               max_model_len=512, attention_backend="triton", max_num_seqs=16, **kw)


@pytest.fixture(scope="module")
def plain(tiny_model_dir):
    return _llm(tiny_model_dir)


@pytest.mark.parametrize("method", ["ngram", "draft"])
@pytest.mark.parametrize("enforce_eager", [False, True])
def test_speculation_changes_no_token(tiny_model_dir, plain, method, enforce_eager):
    extra = (dict(prompt_lookup_min=1, prompt_lookup_max=3) if method == "ngram"
             else dict(speculative_model=str(tiny_model_dir)))
    spec = _llm(tiny_model_dir, speculative_method=method, num_speculative_tokens=4,
                enforce_eager=enforce_eager, **extra)
    graphs = spec.engine.model_runner.graph_runner
    assert (graphs is None) == enforce_eager
    replayed: list[int] = []
    if graphs is not None:
        assert graphs.verify_graphs, "no verify graph was captured"
        original = graphs.replay_verify
        graphs.replay_verify = lambda n, t: (replayed.append(n), original(n, t))[1]
    drafter = spec.engine.model_runner.drafter
    draft_graphs = drafter.graphs if drafter is not None else None
    assert (draft_graphs is not None) == (method == "draft" and not enforce_eager)
    draft_replays: list[str] = []
    if draft_graphs is not None:
        assert draft_graphs.graphs and draft_graphs.verify_graphs, "no draft graph captured"
        for name in ("replay", "replay_verify"):
            fn = getattr(draft_graphs, name)
            setattr(draft_graphs, name,
                    lambda *a, fn=fn, name=name: (draft_replays.append(name), fn(*a))[1])
    prompts = _prompts(tiny_model_dir)
    for params in (SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
                   SamplingParams(temperature=0.8, top_p=0.9, seed=3, max_tokens=MAX_TOKENS,
                                  ignore_eos=True)):
        want = [o.token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
        got = [o.token_ids for o in spec.generate(prompts, params, use_tqdm=False)]
        assert got == want
        stats = spec.engine.speculator.take_stats()
        assert stats.num_accepted_tokens > 0 and stats.num_drafts > 0
    assert bool(replayed) != enforce_eager
    if draft_graphs is not None:  # the catch-up and the single-token passes
        assert {"replay", "replay_verify"} <= set(draft_replays), draft_replays
    bm = spec.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
