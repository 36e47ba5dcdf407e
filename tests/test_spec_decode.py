"""Speculative decoding is lossless: with a fixed seed (or greedy) the engine's tokens are the
same with speculation on and off, for ngram (prompt lookup) and draft-model proposals, under
preemption, chunked prefill, prefix-cache hits, stops, limits, logprobs, penalties, sampling,
both scheduling loops and TP=2; the token a verify step keeps follows the target's
distribution (chi-square, with a biased acceptance rule as the power check); and bad
speculative settings are refused naming their field.

Every comparison also checks that the engine speculated and (but for a self-draft, which
agrees with its target) that its proposals were both accepted and rejected, so none can pass
with speculation silently off.
"""

from __future__ import annotations

import json
import random
import shutil
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from engine_service import LLM, SamplingParams
from engine_service.common.tokenizer import Tokenizer
from engine_service.llm import CompletionOutput
from engine_service.model_runner import LaunchedStep
from engine_service.spec_decode.speculator import SpecDecodeStats
from tests.helpers import greedy, hf_greedy, random_prompts, shared_prefix_prompts
from tests.test_families import save_checkpoint

pytestmark = pytest.mark.timeout(300)

MAX_TOKENS = 24
K = 4
NGRAM = dict(speculative_method="ngram", num_speculative_tokens=K, prompt_lookup_min=1,
             prompt_lookup_max=3)
ENGINE = dict(device="cpu", dtype="float32", kv_block_size=4, num_kv_blocks=256,
              max_model_len=256)
# 24 blocks of 4 tokens (two sequences of ~60 tokens do not fit together: preemption) and
# a 16-token step budget (prompts are prefilled in chunks, verify rows compete for it).
STRESSED = dict(ENGINE, num_kv_blocks=24, max_model_len=96, max_num_batched_tokens=16)
LOGPROB_TOL = 1e-5


# ---------------------------------------------------------------- engines and runs


@dataclass
class Step:
    num_preempted: int
    num_prefill_chunks: int  # prompt chunks that did not reach the prompt's end
    speculative: bool


@dataclass
class Run:
    outputs: list[CompletionOutput]
    stats: SpecDecodeStats | None  # None: speculation off
    steps: list[Step] = field(default_factory=list)
    # Per request: (output index, tokens) of each verify step, before a stop cut them.
    verified: list[list[tuple[int, list[int]]]] = field(default_factory=list)

    @property
    def token_ids(self) -> list[list[int]]:
        return [o.token_ids for o in self.outputs]


class Engine:
    """An LLM whose steps are logged: what each step scheduled, and each verify row's
    tokens (before a stop cut them) at its output index."""

    def __init__(self, model_dir: Path, **engine_kw) -> None:
        self.llm = LLM(str(model_dir), **engine_kw)
        self.steps: list[Step] = []
        self.verified: dict[str, list[tuple[int, list[int]]]] = {}
        schedule = self.llm.engine.scheduler.schedule

        def logged_schedule(*args, **kwargs):
            out = schedule(*args, **kwargs)
            self.steps.append(Step(len(out.preempted),
                                   sum(not s.sample for s in out.scheduled),
                                   out.is_speculative))
            return out

        self.llm.engine.scheduler.schedule = logged_schedule
        if self.speculator is not None:
            record = self.speculator.record

            def logged_record(sched, accepted):
                for row, tokens in zip(sched.scheduled, accepted, strict=True):
                    if row.spec_token_ids:
                        self.verified.setdefault(row.seq.seq_id, []).append(
                            (row.output_index, list(tokens)))
                record(sched, accepted)

            self.speculator.record = logged_record

    @property
    def speculator(self):
        return self.llm.engine.speculator

    def run(self, prompts: list, params: SamplingParams | list[SamplingParams]) -> Run:
        self.steps, self.verified = [], {}
        if self.speculator is not None:
            self.speculator.take_stats()
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        stats = self.speculator.take_stats() if self.speculator is not None else None
        verified = [self.verified.get(o.request_id, []) for o in outputs]
        return Run(outputs, stats, self.steps, verified)

    def shutdown(self) -> None:
        self.llm.engine.shutdown()


@pytest.fixture(scope="module")
def engines():
    """engines(model_dir, **engine_kw): one Engine per distinct setting, kept for the module
    (building one costs about a second)."""
    cache: dict[tuple, Engine] = {}

    def get(model_dir: Path, **kw) -> Engine:
        key = (str(model_dir), tuple(sorted(kw.items())))
        if key not in cache:
            cache[key] = Engine(model_dir, **kw)
        return cache[key]

    yield get
    for engine in cache.values():
        engine.shutdown()


Compare = Callable[..., tuple[Run, Run]]


@pytest.fixture(scope="module")
def lossless(engines) -> Compare:
    """lossless(model_dir, prompts, params, engine_kw=ENGINE, spec=NGRAM): the runs with
    speculation off and on, after checking they gave the same outputs."""

    def compare(model_dir: Path, prompts: list, params, engine_kw: dict = ENGINE,
                spec: dict = NGRAM) -> tuple[Run, Run]:
        off = engines(model_dir, **engine_kw).run(prompts, params)
        on = engines(model_dir, **engine_kw, **spec).run(prompts, params)
        assert_same_outputs(off, on)
        return off, on

    return compare


def assert_same_outputs(off: Run, on: Run) -> None:
    bad = []
    for i, (a, b) in enumerate(zip(off.outputs, on.outputs, strict=True)):
        if (a.token_ids, a.finish_reason, a.stop_reason) != (b.token_ids, b.finish_reason,
                                                             b.stop_reason):
            bad.append(f"request {i}: off {a.token_ids} ({a.finish_reason}, "
                       f"{a.stop_reason!r}), on {b.token_ids} ({b.finish_reason}, "
                       f"{b.stop_reason!r})")
        elif a.text != b.text:
            bad.append(f"request {i}: off text {a.text!r}, on text {b.text!r}")
    assert not bad, "speculation changed the outputs: " + "; ".join(bad)


def assert_speculated(run: Run) -> None:
    """The run verified proposals, kept some and rejected some."""
    stats = run.stats
    assert stats is not None and stats.num_drafts > 0, f"no verify step ran: {stats}"
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens, (
        f"want both accepted and rejected proposals: {stats}")
    assert sum(stats.accepted_per_pos) == stats.num_accepted_tokens, stats


# ---------------------------------------------------------------- models and prompts


def vocab_of(model_dir: Path) -> int:
    return json.loads((model_dir / "config.json").read_text())["vocab_size"]


def repeated_prompts(n: int, vocab: int, seed: int, span: int = 10) -> list[list[int]]:
    """A `span`-token run four times over, then a few other tokens."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(n):
        p = [rng.randrange(vocab) for _ in range(span + rng.randint(0, 4))]
        prompts.append(p[:span] * 4 + p[span:])
    return prompts


def mixed_prompts(vocab: int, seed: int) -> list[list[int]]:
    """Four prompts that repeat a span (prompt lookup finds their suffixes in them) and four
    random ones."""
    return repeated_prompts(4, vocab, seed) + random_prompts(4, vocab, seed, lo=5, hi=40)


def reseeded_copy(src: Path, dst: Path, seed: int, scale: float) -> Path:
    """src's checkpoint (tokenizer too) with every weight moved by scale * N(0, 1): another
    model of the same vocabulary whose greedy tokens often, not always, agree with src's."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    path = dst / "model.safetensors"
    state = load_file(str(path))
    gen = torch.Generator().manual_seed(seed)
    for name in sorted(state):
        state[name] = state[name] + scale * torch.randn(state[name].shape, generator=gen)
    save_file(state, str(path), metadata={"format": "pt"})
    return dst


@pytest.fixture(scope="module")
def qwen_dir(tiny_model_dir) -> Path:
    return tiny_model_dir


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> Path:
    return save_checkpoint(tmp_path_factory.mktemp("spec") / "llama", "LlamaForCausalLM", {},
                           seed=7)


@pytest.fixture(scope="module")
def llama_hf(llama_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # ignore_eos, as the engine runs it
    return model


@pytest.fixture(params=["qwen3", "llama"])
def family(request) -> tuple[Path, torch.nn.Module]:
    """(checkpoint, transformers' model on it) for each family."""
    if request.param == "qwen3":
        return request.getfixturevalue("qwen_dir"), request.getfixturevalue("hf_model")
    return request.getfixturevalue("llama_dir"), request.getfixturevalue("llama_hf")


# ---------------------------------------------------------------- 1. greedy, two families


def test_greedy_ngram_is_lossless_and_matches_transformers(family, lossless):
    model_dir, hf = family
    prompts = mixed_prompts(vocab_of(model_dir), seed=1)
    _, on = lossless(model_dir, prompts, greedy(MAX_TOKENS))
    assert_speculated(on)
    assert all(o.finish_reason == "length" for o in on.outputs)
    want = [hf_greedy(hf, p, MAX_TOKENS) for p in prompts]
    assert on.token_ids == want, "speculative greedy differs from transformers' greedy"


# ---------------------------------------------------------------- 2. scheduling features


def test_lossless_under_preemption(qwen_dir, lossless):
    vocab = vocab_of(qwen_dir)
    prompts = repeated_prompts(4, vocab, seed=3, span=8) + random_prompts(4, vocab, seed=3,
                                                                          lo=20, hi=40)
    _, on = lossless(qwen_dir, prompts, greedy(MAX_TOKENS), STRESSED)
    assert_speculated(on)
    assert any(s.num_preempted for s in on.steps), "24 KV blocks were meant to preempt"


def test_lossless_with_chunked_prefill(qwen_dir, lossless):
    vocab = vocab_of(qwen_dir)
    prompts = mixed_prompts(vocab, seed=4) + random_prompts(2, vocab, seed=4, lo=50, hi=70)
    _, on = lossless(qwen_dir, prompts, greedy(MAX_TOKENS), STRESSED)
    assert_speculated(on)
    assert any(s.num_prefill_chunks for s in on.steps), "a 16-token budget was meant to chunk"
    # Prompt chunks and verify rows shared steps: verify rows competed for the budget.
    assert any(s.speculative and s.num_prefill_chunks for s in on.steps)


def test_lossless_with_prefix_cache_hits(qwen_dir, lossless):
    shared = shared_prefix_prompts(seed=5, shared_len=40, n=6, vocab=vocab_of(qwen_dir))
    looped = [p[:8] * 5 + p[40:] for p in shared]  # a looped 40-token shared prefix
    first, second = looped[:3], looped[3:] + looped[:1]
    _, on1 = lossless(qwen_dir, first, greedy(MAX_TOKENS))
    off2, on2 = lossless(qwen_dir, second, greedy(MAX_TOKENS))
    assert_speculated(on2)
    for run in (off2, on2):
        cached = [o.num_cached_tokens for o in run.outputs]
        assert all(c >= 40 for c in cached), f"second pass missed the prefix cache: {cached}"
    assert on1.outputs[0].token_ids == on2.outputs[-1].token_ids


def stops_inside_verify_steps(out: CompletionOutput, steps: list[tuple[int, list[int]]]
                              ) -> list[int]:
    """Output indices where a stop would cut tokens a verify step already kept: every token
    of a step but its last, where that token occurs for the first time."""
    ids = out.token_ids
    return [i + j for i, tokens in steps for j in range(len(tokens) - 1)
            if ids.index(ids[i + j]) == i + j]


def assert_cut_inside_verify_step(run: Run) -> None:
    """Some request stopped at a token that a verify step had followed with more."""
    cut = [any(i + len(tokens) > len(out.token_ids) for i, tokens in steps)
           for out, steps in zip(run.outputs, run.verified, strict=True)]
    assert any(cut), "no stop fell inside a verify step's accepted tokens"


@dataclass
class StopCase:
    prompts: list[list[int]]
    full: list[CompletionOutput]  # greedy, unstopped
    positions: list[int]  # where each request is made to stop


@pytest.fixture(scope="module")
def stop_case(qwen_dir, engines, lossless) -> StopCase:
    """Requests whose greedy output has a token a stop would cut inside a verify step. An
    accepted proposal repeats a token of the sequence, so for it to occur in the output for
    the first time it must come from the prompt: the prompts are 16 prompts followed by
    the first 12 tokens of their own greedy output, which the model partly repeats."""
    vocab = vocab_of(qwen_dir)
    seeds = [p for seed in (20, 21) for p in mixed_prompts(vocab, seed)]
    own = engines(qwen_dir, **ENGINE).run(seeds, greedy(MAX_TOKENS)).token_ids
    prompts = [p + g[:12] for p, g in zip(seeds, own, strict=True)]
    _, full = lossless(qwen_dir, prompts, greedy(MAX_TOKENS))
    case = StopCase([], [], [])
    for prompt, out, steps in zip(prompts, full.outputs, full.verified, strict=True):
        inside = stops_inside_verify_steps(out, steps)
        if inside:
            case.prompts.append(prompt)
            case.full.append(out)
            case.positions.append(inside[0])
    assert len(case.prompts) >= 3, f"too few stop cases: {case.positions}"
    return case


def test_stop_token_ids_cut_at_the_same_place(qwen_dir, lossless, stop_case):
    params = [greedy(MAX_TOKENS, stop_token_ids=[o.token_ids[at]])
              for o, at in zip(stop_case.full, stop_case.positions, strict=True)]
    _, on = lossless(qwen_dir, stop_case.prompts, params)
    assert_speculated(on)
    for o, sp, at in zip(on.outputs, params, stop_case.positions, strict=True):
        assert o.finish_reason == "stop" and o.stop_reason == sp.stop_token_ids[0], o
        assert len(o.token_ids) == at + 1
    assert_cut_inside_verify_step(on)


def test_stop_strings_cut_at_the_same_place(qwen_dir, lossless, stop_case):
    """Each stop string is the text its stop token adds (the first time it occurs)."""
    tokenizer = Tokenizer.from_dir(str(qwen_dir))
    params = []
    for o, at in zip(stop_case.full, stop_case.positions, strict=True):
        before = tokenizer.decode(o.token_ids[:at])
        stop = tokenizer.decode(o.token_ids[:at + 1])[len(before):].strip()
        if not stop or stop in before:
            stop = tokenizer.decode(o.token_ids[:at + 1])[-3:]
        params.append(greedy(MAX_TOKENS, stop=[stop]))
    off, on = lossless(qwen_dir, stop_case.prompts, params)
    assert_speculated(on)
    assert all(o.finish_reason == "stop" for o in off.outputs), off.outputs
    for o, sp in zip(on.outputs, params, strict=True):
        assert o.stop_reason == sp.stop[0] and sp.stop[0] not in o.text, o
    assert_cut_inside_verify_step(on)


def test_max_tokens_is_never_exceeded(qwen_dir, lossless, stop_case):
    """Limits just past tokens a verify step kept: the proposals shrink to fit."""
    prompts = stop_case.prompts + stop_case.prompts[:2]
    limits = [at + 1 + i % 3 for i, at in enumerate(stop_case.positions)] + [1, 2]
    _, on = lossless(qwen_dir, prompts, [greedy(n) for n in limits])
    assert_speculated(on)
    assert [len(o.token_ids) for o in on.outputs] == limits
    assert all(o.finish_reason == "length" for o in on.outputs)


def test_max_model_len_is_never_exceeded(qwen_dir, lossless):
    """Prompts within a few tokens of max_model_len (96): each stops there, speculation
    proposing no token past it."""
    max_model_len = STRESSED["max_model_len"]
    vocab = vocab_of(qwen_dir)
    looped = repeated_prompts(4, vocab, seed=8, span=6)
    prompts = [(p * 4)[:80 + 3 * i] for i, p in enumerate(looped)] + random_prompts(
        2, vocab, seed=8, lo=84, hi=88)
    _, on = lossless(qwen_dir, prompts, greedy(MAX_TOKENS), STRESSED)
    assert_speculated(on)
    for p, o in zip(prompts, on.outputs, strict=True):
        assert len(p) + len(o.token_ids) == max_model_len, (len(p), len(o.token_ids))
        assert o.finish_reason == "length"


def assert_same_logprobs(off: Run, on: Run) -> None:
    for i, (a, b) in enumerate(zip(off.outputs, on.outputs, strict=True)):
        assert len(a.logprobs) == len(b.logprobs) == len(a.token_ids), i
        for j, ((lp_a, ids_a, tops_a), (lp_b, ids_b, tops_b)) in enumerate(
                zip(a.logprobs, b.logprobs, strict=True)):
            where = f"request {i}, token {j}"
            assert abs(lp_a - lp_b) <= LOGPROB_TOL, (where, lp_a, lp_b)
            assert ids_a == ids_b, (where, ids_a, ids_b)
            assert max(abs(x - y) for x, y in zip(tops_a, tops_b, strict=True)) \
                <= LOGPROB_TOL, (where, tops_a, tops_b)


@pytest.mark.parametrize("sampling", [dict(temperature=0.0), dict(temperature=0.6, top_k=3)],
                         ids=["greedy", "sampled"])
def test_logprobs_of_accepted_tokens_match(qwen_dir, lossless, sampling):
    prompts = mixed_prompts(vocab_of(qwen_dir), seed=9)
    params = [SamplingParams(seed=100 + i, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=3,
                             **sampling) for i in range(len(prompts))]
    off, on = lossless(qwen_dir, prompts, params)
    assert_speculated(on)
    assert_same_logprobs(off, on)


def test_min_tokens_holds_back_stop_tokens(qwen_dir, lossless):
    """Each request's stop token is its 2nd greedy token, held back until 8 outputs: the
    verify step must suppress it at every position before the 8th, proposals included."""
    prompts = repeated_prompts(6, vocab_of(qwen_dir), seed=10, span=6)
    full, _ = lossless(qwen_dir, prompts, greedy(MAX_TOKENS))
    min_tokens = 8
    params = [SamplingParams(temperature=0, max_tokens=MAX_TOKENS, min_tokens=min_tokens,
                             stop_token_ids=[o.token_ids[1]]) for o in full.outputs]
    _, on = lossless(qwen_dir, prompts, params)
    assert_speculated(on)
    for o, sp in zip(on.outputs, params, strict=True):
        assert len(o.token_ids) >= min_tokens, o
        assert sp.stop_token_ids[0] not in o.token_ids[:min_tokens], o


def test_penalties(qwen_dir, lossless):
    """Repetition, frequency and presence penalties read the output history, which in a
    verify step includes the proposals before each position. Negative ones favour repeats,
    which prompt lookup proposes."""
    prompts = mixed_prompts(vocab_of(qwen_dir), seed=11)
    settings = [dict(repetition_penalty=1.3), dict(frequency_penalty=0.6),
                dict(presence_penalty=0.6), dict(frequency_penalty=-0.8),
                dict(presence_penalty=-1.0, repetition_penalty=0.8),
                dict(repetition_penalty=1.2, temperature=0.7, seed=5),
                dict(frequency_penalty=-0.5, temperature=0.9, seed=6),
                dict(presence_penalty=0.4, frequency_penalty=0.2, temperature=1.0, seed=7)]
    params = [SamplingParams(**{"temperature": 0.0, "max_tokens": MAX_TOKENS,
                                "ignore_eos": True, **s}) for s in settings]
    _, on = lossless(qwen_dir, prompts, params)
    assert_speculated(on)


def test_seeded_sampling_is_identical(qwen_dir, lossless):
    """Draws are keyed by (seed, output position), so seeded sampling gives the same tokens
    with and without speculation, under every sampling filter."""
    prompts = mixed_prompts(vocab_of(qwen_dir), seed=12)
    settings = [dict(temperature=0.3), dict(temperature=0.7, top_k=5),
                dict(temperature=1.0, top_p=0.9), dict(temperature=1.3, min_p=0.05),
                dict(temperature=0.5, top_p=0.8, top_k=20), dict(temperature=1.0),
                dict(temperature=0.6, top_k=3), dict(temperature=0.9, top_p=0.5)]
    params = [SamplingParams(seed=1000 + i, max_tokens=MAX_TOKENS, ignore_eos=True, **s)
              for i, s in enumerate(settings)]
    off, on = lossless(qwen_dir, prompts, params)
    assert_speculated(on)
    # Sampling did sample: another seed changes the tokens.
    reseeded = [SamplingParams(seed=2000 + i, max_tokens=MAX_TOKENS, ignore_eos=True, **s)
                for i, s in enumerate(settings)]
    other, _ = lossless(qwen_dir, prompts, reseeded)
    assert other.token_ids != off.token_ids


# ---------------------------------------------------------------- 3. scheduling loops


def test_async_and_sync_scheduling_give_the_same_tokens(qwen_dir, engines):
    """With speculation off past 4 running requests, the async loop overlaps the plain
    decode steps and lands before the verify steps; both loops give spec-off's tokens."""
    prompts = mixed_prompts(vocab_of(qwen_dir), seed=13)
    params = [greedy(n) for n in (6, 8, 10, 12, 30, 30, 30, 30)]  # the batch thins out
    small = dict(NGRAM, speculative_disable_by_batch_size=4)
    off = engines(qwen_dir, **ENGINE).run(prompts, params)
    for async_scheduling in (True, False):
        on = engines(qwen_dir, **ENGINE, **small,
                     async_scheduling=async_scheduling).run(prompts, params)
        assert_same_outputs(off, on)
        assert_speculated(on)
        decode_only = [s.speculative for s in on.steps if not s.num_prefill_chunks]
        assert True in decode_only and False in decode_only, (
            f"async_scheduling={async_scheduling}: want steps with and without proposals")


def test_steps_overlap_while_prompt_lookup_finds_nothing(qwen_dir, engines):
    """Speculation that finds no proposal costs no overlap: each step is launched before
    the step in flight is read, as with speculation off (the proposals' landing path is
    what the other tests exercise)."""
    prompts = mixed_prompts(vocab_of(qwen_dir), seed=14)
    params = greedy(MAX_TOKENS)
    off = engines(qwen_dir, **ENGINE).run(prompts, params)
    never = dict(NGRAM, prompt_lookup_min=ENGINE["max_model_len"],
                 prompt_lookup_max=ENGINE["max_model_len"])
    eng = engines(qwen_dir, **ENGINE, **never)
    reads: list[bool] = []  # per step read: had a later step been launched already?
    launched: list[LaunchedStep] = []
    launch, result = eng.llm.engine.model_runner.launch, LaunchedStep.result

    def spy_launch(*args):
        launched.append(launch(*args))
        return launched[-1]

    def spy_result(self):
        reads.append(launched[-1] is not self)
        return result(self)

    eng.llm.engine.model_runner.launch = spy_launch
    try:
        LaunchedStep.result = spy_result
        on = eng.run(prompts, params)
    finally:
        LaunchedStep.result = result
        eng.llm.engine.model_runner.launch = launch
    assert_same_outputs(off, on)
    assert on.stats is not None and on.stats.num_drafts == 0
    # Every read but the last (nothing left to launch after it) overlapped the next step.
    assert len(reads) == len(launched) and all(reads[:-1]), reads


# ---------------------------------------------------------------- 5. lossless sampling


# chi-square critical values at p = 0.001, by degrees of freedom.
CHI2_CRITICAL_P001 = {1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467, 5: 20.515, 6: 22.458,
                      7: 24.322, 8: 26.124, 9: 27.877, 10: 29.588, 11: 31.264, 12: 32.909,
                      13: 34.528, 14: 36.123, 15: 37.697}
SMALL_VOCAB = 16
NUM_SAMPLES = 2000


def chi_square(observed: list[int], expected: list[float]) -> tuple[float, int]:
    """Pearson's statistic and its degrees of freedom, bins with expected < 5 pooled (and
    the pool joined to the smallest other bin while it is still under 5)."""
    bins = sorted(zip(expected, observed, strict=True))
    pool_e = pool_o = 0.0
    while bins and (bins[0][0] < 5 or pool_e and pool_e < 5):
        e, o = bins.pop(0)
        pool_e, pool_o = pool_e + e, pool_o + o
    if pool_e:
        bins.append((pool_e, pool_o))
    stat = sum((o - e) ** 2 / e for e, o in bins)
    return stat, len(bins) - 1


@pytest.fixture(scope="module")
def small_vocab_dir(tmp_path_factory) -> Path:
    return save_checkpoint(tmp_path_factory.mktemp("spec") / "vocab16", "Qwen3ForCausalLM",
                           dict(vocab_size=SMALL_VOCAB, head_dim=16, tie_word_embeddings=True),
                           seed=3)


@dataclass
class SampleRun:
    second_tokens: list[int]  # output index 1: the first token a verify step decides
    first_tokens: list[int]
    stats: SpecDecodeStats


def sample_second_tokens(engine: Engine, prompt: list[int]) -> SampleRun:
    # max_tokens 3: the step after the prefill carries one proposal (one more token of
    # budget stays for the target's own draw), verified at output index 1.
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=3, ignore_eos=True)
              for i in range(NUM_SAMPLES)]
    run = engine.run([prompt] * NUM_SAMPLES, params)
    assert all(len(o.token_ids) == 3 for o in run.outputs)
    assert run.stats is not None
    return SampleRun([o.token_ids[1] for o in run.outputs],
                     [o.token_ids[0] for o in run.outputs], run.stats)


def expected_second_counts(model_dir: Path, prompt: list[int], firsts: list[int]
                           ) -> list[float]:
    """Sum over the samples of the target's p(. | prompt + first token), in float32 by
    transformers (one forward per distinct first token)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    counts = Counter(firsts)
    distinct = sorted(counts)
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + [t] for t in distinct])).logits[:, -1].float()
    probs = torch.softmax(logits, dim=-1).double()
    expected = sum(counts[t] * probs[i] for i, t in enumerate(distinct))
    return expected.tolist()


def biased_verify(original, rng: random.Random):
    """LaunchedStep._verify that keeps a rejected proposal anyway half the time (the draw
    at that position replaced by the proposal): not lossless."""

    def verify(self, sampled: list[int]):
        sampled = list(sampled)
        pos = 0
        for item in self.batch:
            if not item.sample:
                continue
            for j, proposed in enumerate(item.spec_token_ids):
                if sampled[pos + j] != proposed:
                    if rng.random() >= 0.5:
                        break
                    sampled[pos + j] = proposed
            pos += len(item.spec_token_ids) + 1
        return original(self, sampled)

    return verify


@pytest.fixture(scope="module")
def sampling_setup(small_vocab_dir, engines):
    rng = random.Random(0)
    # Every token of the vocabulary occurs in the prompt, so prompt lookup (n >= 1) proposes
    # at the first decode step whatever the first output was.
    prompt = rng.sample(range(SMALL_VOCAB), SMALL_VOCAB) + [rng.randrange(SMALL_VOCAB)
                                                             for _ in range(4)]
    engine = engines(small_vocab_dir, device="cpu", dtype="float32", kv_block_size=4,
                     num_kv_blocks=1024, max_model_len=64, max_num_seqs=256,
                     max_num_batched_tokens=2048, speculative_disable_by_batch_size=256,
                     **NGRAM)
    return prompt, engine


def test_sampled_tokens_follow_the_target_distribution(small_vocab_dir, sampling_setup,
                                                       monkeypatch):
    prompt, engine = sampling_setup
    fair = sample_second_tokens(engine, prompt)
    assert fair.stats.num_drafts == NUM_SAMPLES, fair.stats  # every sample was verified
    assert fair.stats.num_draft_tokens == NUM_SAMPLES, fair.stats
    # Proposals were kept and rejected: the test covers both ways a token is decided.
    assert 0.05 * NUM_SAMPLES < fair.stats.num_accepted_tokens < 0.95 * NUM_SAMPLES, \
        fair.stats
    expected = expected_second_counts(small_vocab_dir, prompt, fair.first_tokens)
    observed = Counter(fair.second_tokens)
    stat, dof = chi_square([observed[t] for t in range(SMALL_VOCAB)], expected)
    assert dof >= 3, f"too few bins for a meaningful test: {expected}"
    assert stat < CHI2_CRITICAL_P001[dof], (stat, dof, observed, expected)

    # Power: keeping rejected proposals half the time is caught by the same statistic.
    monkeypatch.setattr(LaunchedStep, "_verify",
                        biased_verify(LaunchedStep._verify, random.Random(1)))
    biased = sample_second_tokens(engine, prompt)
    assert biased.stats.num_accepted_tokens > fair.stats.num_accepted_tokens
    expected = expected_second_counts(small_vocab_dir, prompt, biased.first_tokens)
    observed = Counter(biased.second_tokens)
    stat, dof = chi_square([observed[t] for t in range(SMALL_VOCAB)], expected)
    assert stat > CHI2_CRITICAL_P001[dof], (stat, dof, observed, expected)


# ---------------------------------------------------------------- 6. draft model


def draft(model_dir: Path) -> dict:
    return dict(speculative_method="draft", speculative_model=str(model_dir),
                num_speculative_tokens=3)


def test_self_draft_accepts_every_proposal(qwen_dir, lossless):
    prompts = mixed_prompts(vocab_of(qwen_dir), seed=14)
    _, on = lossless(qwen_dir, prompts, greedy(MAX_TOKENS), spec=draft(qwen_dir))
    stats = on.stats
    assert stats is not None and stats.num_draft_tokens > 0, stats
    assert stats.num_accepted_tokens == stats.num_draft_tokens, stats


@pytest.fixture(scope="module")
def other_draft_dir(qwen_dir, tmp_path_factory) -> Path:
    return reseeded_copy(qwen_dir, tmp_path_factory.mktemp("spec") / "draft", seed=1,
                         scale=0.05)


def test_other_draft_model_is_lossless(qwen_dir, other_draft_dir, lossless):
    prompts = mixed_prompts(vocab_of(qwen_dir), seed=15)
    _, on = lossless(qwen_dir, prompts, greedy(MAX_TOKENS), spec=draft(other_draft_dir))
    assert_speculated(on)
    _, on = lossless(qwen_dir, prompts, greedy(MAX_TOKENS), STRESSED,
                     spec=draft(other_draft_dir))
    assert_speculated(on)
    assert any(s.num_preempted for s in on.steps), "24 KV blocks were meant to preempt"


# ---------------------------------------------------------------- 7. config validation


@pytest.mark.parametrize("kwargs, name", [
    (dict(speculative_method="ngram", num_speculative_tokens=0), "num_speculative_tokens"),
    (dict(speculative_method="ngram"), "num_speculative_tokens"),
    (dict(speculative_method="ngram", num_speculative_tokens=2, prompt_lookup_min=3,
          prompt_lookup_max=2), "prompt_lookup_max"),
    (dict(speculative_method="ngram", num_speculative_tokens=2, prompt_lookup_min=0),
     "prompt_lookup_min"),
    (dict(speculative_method="foo", num_speculative_tokens=2), "speculative_method"),
    (dict(speculative_method="draft", num_speculative_tokens=2), "speculative_model"),
    (dict(num_speculative_tokens=2), "num_speculative_tokens"),
])
def test_bad_speculative_config_names_the_field(qwen_dir, kwargs, name):
    with pytest.raises(ValueError, match=name):
        LLM(str(qwen_dir), device="cpu", **kwargs)


# ---------------------------------------------------------------- 4. tensor parallel


@pytest.mark.slow
@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_tp2_equals_tp1_without_speculation(qwen_dir, other_draft_dir, engines, method):
    """The TP=1 reference runs before the TP=2 engine starts: a TP=1 model run while the
    process group exists would join its collectives. The draft model is sharded too."""
    prompts = mixed_prompts(vocab_of(qwen_dir), seed=16)
    params = greedy(12)
    off = engines(qwen_dir, **ENGINE).run(prompts, params)
    spec = NGRAM if method == "ngram" else draft(other_draft_dir)
    tp2 = Engine(qwen_dir, **ENGINE, **spec, tensor_parallel_size=2)
    try:
        on = tp2.run(prompts, params)
    finally:
        tp2.shutdown()
    assert_same_outputs(off, on)
    assert_speculated(on)
