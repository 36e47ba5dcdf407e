"""Verify steps through the CUDA-graph path's staged inputs (`VerifyInputs`), replayed
eagerly on CPU: the layout of one staged batch, and whole runs with speculation that
replay padded verify graphs and still change no token."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from engine_service import LLM, SamplingParams
from engine_service.cuda_graphs import CudaGraphRunner, VerifyInputs
from tests.helpers import random_prompts


def test_verify_inputs_stage_layout():
    """Rows of 1..q tokens packed; padding rows get one token over a one-token context and
    store nothing; token slots past the rows store nothing."""
    inputs = VerifyInputs(max_bs=4, q=3, max_blocks=4, device=torch.device("cpu"))
    v = inputs.dev
    tables = np.array([[3, 4], [5, 0]], dtype=np.int32)
    # Row 0: last token at position 17 plus two proposals; row 1: one token at position 2.
    inputs.stage(4, [11, 12, 13, 21], [17, 18, 19, 2], [70, 71, 72, 22], [3, 1], tables)
    assert v["input_ids"][:4].tolist() == [11, 12, 13, 21]
    assert v["positions"][:4].tolist() == [17, 18, 19, 2]
    assert v["slot_mapping"].tolist() == [70, 71, 72, 22] + [-1] * 8
    assert v["cu_seqlens_q"].tolist() == [0, 3, 4, 5, 6]
    assert v["seq_lens"].tolist() == [20, 3, 1, 1]
    assert v["block_tables"][:2, :2].tolist() == tables.tolist()


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_staged_verify_changes_no_token(tiny_model_dir, method):
    vocab = json.loads((tiny_model_dir / "config.json").read_text())["vocab_size"]
    prompts = random_prompts(4, vocab, 8, 3, 40)
    prompts += [p[:9] * 4 for p in prompts[:3]]  # repeated spans: proposals that hit
    kw = dict(device="cpu", dtype="float32", num_kv_blocks=256, kv_block_size=4,
              max_model_len=256, max_num_seqs=4)
    extra = (dict(prompt_lookup_min=1, prompt_lookup_max=3) if method == "ngram"
             else dict(speculative_model=str(tiny_model_dir)))
    plain = LLM(str(tiny_model_dir), **kw)
    spec = LLM(str(tiny_model_dir), speculative_method=method, num_speculative_tokens=4,
               **extra, **kw)
    runner = spec.engine.model_runner
    runner.graph_runner = graphs = CudaGraphRunner(runner, capture=False)
    assert graphs.verify_sizes == [1, 2, 4]
    replayed: list[int] = []
    original = graphs.replay_verify
    graphs.replay_verify = lambda n, t: (replayed.append(n), original(n, t))[1]
    for params in (SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
                   SamplingParams(temperature=0.6, seed=4, max_tokens=20, ignore_eos=True,
                                  logprobs=2)):
        want = plain.generate(prompts, params, use_tqdm=False)
        got = spec.generate(prompts, params, use_tqdm=False)
        assert [o.token_ids for o in got] == [o.token_ids for o in want]
        for a, b in zip(got, want, strict=True):
            assert len(a.logprobs) == len(b.logprobs)
        stats = spec.engine.speculator.take_stats()
        assert stats.num_accepted_tokens > 0
    assert 3 in replayed, replayed  # 3 rows replay the padded 4-row graph


def _spy(obj, name: str) -> list[int]:
    """Record the first argument (a row count) of each call of obj.name."""
    calls: list[int] = []
    original = getattr(obj, name)
    setattr(obj, name, lambda n, *rest: (calls.append(n), original(n, *rest))[1])
    return calls


def test_staged_draft_passes_change_no_token(tiny_model_dir):
    """The draft model's passes from its own graphs' staged inputs, replayed eagerly: the
    catch-up pass from verify-shaped inputs (rows of 1..1 + K tokens; longer catch-ups run
    eagerly) and each single-token pass from decode inputs that read the last pass's draws
    on the device, rows dropping out as they reach their limit. Tokens must equal
    speculation off; since a wrong draft input costs only acceptance, a self-draft must also
    have every greedy proposal accepted, and sampled ones as often as the eager draft."""
    vocab = json.loads((tiny_model_dir / "config.json").read_text())["vocab_size"]
    prompts = random_prompts(6, vocab, 9, 3, 40)
    kw = dict(device="cpu", dtype="float32", num_kv_blocks=256, kv_block_size=4,
              max_model_len=256, max_num_seqs=5)
    plain = LLM(str(tiny_model_dir), **kw)
    spec = LLM(str(tiny_model_dir), speculative_method="draft", num_speculative_tokens=4,
               speculative_model=str(tiny_model_dir), speculative_disable_by_batch_size=4,
               **kw)
    runner = spec.engine.model_runner
    drafter = runner.drafter
    runner.graph_runner = CudaGraphRunner(runner, capture=False)
    # Staggered lengths: the batch shrinks past the speculation limit (5 -> 4 rows), and
    # rows near max_tokens are proposed fewer tokens than the others.
    greedy = [SamplingParams(temperature=0, max_tokens=12 + 5 * i, ignore_eos=True)
              for i in range(len(prompts))]
    sampled = [SamplingParams(temperature=0.9, seed=4, max_tokens=12 + 5 * i,
                              ignore_eos=True) for i in range(len(prompts))]
    eager_stats = []
    for params in (greedy, sampled):  # the eager draft: the acceptance reference
        drafter.graphs = None
        spec.generate(prompts, params, use_tqdm=False)
        eager_stats.append(spec.engine.speculator.take_stats())
    drafter.use_graphs(capture=False)
    graphs = drafter.graphs
    assert graphs is not None and graphs.model is drafter.model
    assert graphs.batch_sizes == [1, 2, 4] and graphs.verify_sizes == [1, 2, 4]
    assert graphs.verify is not None and graphs.verify.q == 5
    decodes, catch_ups = _spy(graphs, "replay"), _spy(graphs, "replay_verify")
    scattered = _spy(drafter, "_scatter")
    for params, eager in zip((greedy, sampled), eager_stats, strict=True):
        want = plain.generate(prompts, params, use_tqdm=False)
        got = spec.generate(prompts, params, use_tqdm=False)
        assert [o.token_ids for o in got] == [o.token_ids for o in want]
        stats = spec.engine.speculator.take_stats()
        assert stats.num_accepted_tokens > 0
        assert (stats.num_draft_tokens, stats.num_accepted_tokens) == \
            (eager.num_draft_tokens, eager.num_accepted_tokens), (stats, eager)
        if params is greedy:
            assert stats.num_accepted_tokens == stats.num_draft_tokens, stats
    assert decodes and catch_ups, (decodes, catch_ups)
    assert 3 in decodes and 3 in catch_ups, (decodes, catch_ups)  # padded to 4-row graphs
    assert scattered, "no pass ran with fewer rows than the catch-up"
