"""Batched sampler: seeded draws, top-k/top-p/min-p masks, penalties, suppression, logprobs."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from engine_service.common.sampling_params import SamplingParams
from models.layers.sampler import (
    Sampler,
    SamplingTensors,
    apply_min_p,
    apply_penalties,
    apply_token_bitmask,
    apply_top_k_top_p,
    hashed_uniform,
)

M64 = (1 << 64) - 1


def build(params: list, seeds: list[int] | None = None, steps: list[int] | None = None,
          vocab: int = 4, prompts: list | None = None, outputs: list | None = None,
          suppress: list | None = None) -> SamplingTensors:
    b = len(params)
    params = [p if isinstance(p, SamplingParams) else SamplingParams(**p) for p in params]
    return SamplingTensors.build(
        params, seeds if seeds is not None else list(range(b)),
        steps if steps is not None else [0] * b,
        prompts if prompts is not None else [[] for _ in range(b)],
        outputs if outputs is not None else [[] for _ in range(b)],
        suppress or [], vocab, "cpu")


def sample(logits: torch.Tensor, params: list, **kw) -> torch.Tensor:
    t = build(params, vocab=logits.shape[1], **kw)
    return Sampler()(logits, t).sampled_token_ids


def draws(probs: list[float], n: int, **fields) -> Counter:
    """One draw per seed 0..n-1 from the distribution `probs` (as logits = log probs)."""
    logits = torch.tensor(probs).log().expand(n, -1).contiguous()
    toks = sample(logits, [dict(fields)] * n, seeds=list(range(n)))
    return Counter(toks.tolist())


# ---- the hash ------------------------------------------------------------------------------

def _mix64_ref(z: int) -> int:
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def _uniform_ref(seed: int, step: int, index: int) -> float:
    """splitmix64 in Python's unbounded ints, reduced mod 2**64 (no signedness involved)."""
    key = _mix64_ref((_mix64_ref(seed ^ 0xD1B54A32D192ED03) + step * 0x9E3779B97F4A7C15) & M64)
    bits = _mix64_ref((key + (index + 1) * 0x9E3779B97F4A7C15) & M64)
    return ((bits >> 41) + 0.5) / 2**23


def test_hash_matches_unsigned_python_reference() -> None:
    # Equality with unsigned arithmetic shows the int64 shifts/wraps are right, which is what
    # makes the draws the same on every device.
    seeds = [0, 1, 12345, 2**62 + 7, 2**63 - 1]
    steps = [0, 1, 7, 2**40, 999]
    u = hashed_uniform(torch.tensor(seeds), torch.tensor(steps), 37)
    for r, (seed, step) in enumerate(zip(seeds, steps, strict=True)):
        for v in range(37):
            assert u[r, v].item() == _uniform_ref(seed, step, v)


def test_hash_uniformity() -> None:
    seeds = torch.arange(64, dtype=torch.int64)
    u = hashed_uniform(seeds, seeds * 3, 16384).double()  # 1M values
    assert u.min() > 0 and u.max() < 1
    assert abs(u.mean().item() - 0.5) < 0.002
    assert abs(u.var().item() - 1 / 12) < 0.002
    hist = torch.histc(u, bins=16, min=0, max=1)
    expected = u.numel() / 16
    assert ((hist - expected).abs() / expected).max() < 0.03
    # Neighbouring indices and neighbouring steps are uncorrelated.
    x = u - 0.5
    assert abs((x[:, 1:] * x[:, :-1]).mean().item()) < 0.002
    v = hashed_uniform(seeds, seeds * 3 + 1, 16384).double() - 0.5
    assert abs((x * v).mean().item()) < 0.002


# ---- seeds ---------------------------------------------------------------------------------

def test_seeded_sampling_independent_of_batch_neighbours() -> None:
    torch.manual_seed(0)
    vocab = 512
    target = torch.randn(vocab) * 2
    others = torch.randn(5, vocab) * 2
    neighbour_params = [
        {"temperature": 0.0},
        {"temperature": 1.3, "top_k": 5},
        {"temperature": 0.7, "top_p": 0.5, "min_p": 0.1},
        {"temperature": 1.0, "repetition_penalty": 1.5, "frequency_penalty": 0.5},
        {"temperature": 2.0, "logprobs": 3},
    ]
    for own in ({"temperature": 0.9}, {"temperature": 1.1, "top_k": 40, "top_p": 0.9}):
        for seed in range(30):
            step = seed * 7 + 3
            alone = sample(target[None], [own], seeds=[seed], steps=[step])
            # The same request as row 3 of a batch whose other rows use every stage.
            logits = torch.cat([others[:3], target[None], others[3:]])
            params = neighbour_params[:3] + [own] + neighbour_params[3:]
            seeds = [seed + 1, seed + 2, seed, seed, 77, 5]
            steps = [step, step, 0, step, step, 1]
            prompts = [[1, 2], [3], [4, 5, 6], [], [7, 7, 8], [9]]
            outputs = [[10], [], [11, 11], [], [12], []]
            batch = sample(logits, params, seeds=seeds, steps=steps, prompts=prompts,
                           outputs=outputs, suppress=[(0, 3), (5, 2)])
            assert batch[3].item() == alone[0].item()
            again = sample(logits, params, seeds=seeds, steps=steps, prompts=prompts,
                           outputs=outputs, suppress=[(0, 3), (5, 2)])
            assert torch.equal(batch, again)


def test_different_seeds_and_steps_differ() -> None:
    flat = torch.zeros(100, 1000)
    by_seed = sample(flat, [{}] * 100, seeds=list(range(100)), steps=[5] * 100)
    by_step = sample(flat, [{}] * 100, seeds=[5] * 100, steps=list(range(100)))
    # 100 uniform draws over 1000 tokens: about 95 distinct values expected.
    assert len(set(by_seed.tolist())) > 80
    assert len(set(by_step.tolist())) > 80
    assert not torch.equal(by_seed, by_step)


# ---- greedy, top-k, top-p, min-p -----------------------------------------------------------

@pytest.mark.parametrize("temperature", [0.05, 1.0, 5.0])
def test_top_k_1_is_greedy(temperature: float) -> None:
    torch.manual_seed(1)
    logits = torch.randn(64, 300)
    toks = sample(logits, [{"temperature": temperature, "top_k": 1}] * 64, seeds=list(range(64)))
    assert torch.equal(toks, logits.argmax(dim=-1))


def test_greedy_rows_unaffected_by_other_rows() -> None:
    torch.manual_seed(2)
    logits = torch.randn(6, 200)
    params = [{"temperature": 0.0}, {"temperature": 1.5, "top_k": 3},
              {"temperature": 0.0, "top_p": 0.1, "min_p": 0.9},
              {"temperature": 0.8, "top_p": 0.3, "presence_penalty": 2.0},
              {"temperature": 0.0, "logprobs": 2}, {"temperature": 3.0, "min_p": 0.2}]
    toks = sample(logits, params, outputs=[[], [int(logits[1].argmax())], [], [5], [], []],
                  prompts=[[]] * 6)
    for row in (0, 2, 4):
        assert toks[row].item() == logits[row].argmax().item()


def test_top_k_known_distribution() -> None:
    seen = draws([0.4, 0.3, 0.2, 0.1], 2000, top_k=2)
    assert set(seen) == {0, 1}


@pytest.mark.parametrize(("top_p", "allowed"), [(0.8, {0, 1}), (0.81, {0, 1, 2}),
                                                (0.3, {0}), (0.96, {0, 1, 2, 3}), (1e-9, {0})])
def test_top_p_known_distribution(top_p: float, allowed: set[int]) -> None:
    seen = draws([0.5, 0.3, 0.15, 0.05], 2000, top_p=top_p)
    assert set(seen) == allowed


@pytest.mark.parametrize(("min_p", "allowed"), [(0.35, {0, 1}), (0.25, {0, 1, 2}),
                                                (0.05, {0, 1, 2, 3}), (1.0, {0})])
def test_min_p_known_distribution(min_p: float, allowed: set[int]) -> None:
    # Thresholds min_p * 0.5: 0.175, 0.125, 0.025, 0.5.
    seen = draws([0.5, 0.3, 0.15, 0.05], 2000, min_p=min_p)
    assert set(seen) == allowed


def test_rows_with_a_stage_off_pass_through_it_bit_identical() -> None:
    # A peaked row whose tail mass is below float32 rounding of the cumulative sum: a top_p = 1
    # row must still keep every token, or its draws would depend on its neighbours' settings.
    torch.manual_seed(6)
    peaked = torch.cat([torch.tensor([20.0]), torch.randn(999)])
    logits = torch.stack([peaked, torch.randn(1000), peaked])
    params = [{}, {"top_k": 7, "top_p": 0.5, "min_p": 0.3}, {"top_p": 1.0, "top_k": -1}]
    t = build(params, vocab=1000)
    assert t.any_top_k and t.any_top_p and t.any_min_p
    masked = apply_min_p(apply_top_k_top_p(logits, t), t.min_ps)
    assert torch.equal(masked[0], logits[0]) and torch.equal(masked[2], logits[2])
    assert torch.isfinite(masked[1]).sum().item() <= 7


# ---- the distribution itself ----------------------------------------------------------------

N_STAT = 4000
TOL = 0.03  # ~4 standard errors at p = 0.5 for 4000 draws; the seeds are fixed, so no flakes


def _assert_matches(seen: Counter, expected: torch.Tensor) -> None:
    freq = torch.tensor([seen.get(i, 0) / N_STAT for i in range(expected.numel())])
    assert (freq - expected).abs().max().item() < TOL, (freq, expected)


@pytest.mark.parametrize("temperature", [1.0, 0.6, 1.7])
def test_temperature_sampling_matches_softmax(temperature: float) -> None:
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5, -1.5])
    expected = torch.softmax(logits / temperature, dim=-1)
    toks = sample(logits.expand(N_STAT, -1).contiguous(), [{"temperature": temperature}] * N_STAT,
                  seeds=list(range(N_STAT)), steps=[3] * N_STAT)
    _assert_matches(Counter(toks.tolist()), expected)


def test_one_request_over_many_steps_matches_softmax() -> None:
    logits = torch.tensor([0.3, 0.0, -0.2, -1.0])
    expected = torch.softmax(logits, dim=-1)
    toks = sample(logits.expand(N_STAT, -1).contiguous(), [{}] * N_STAT,
                  seeds=[1234] * N_STAT, steps=list(range(N_STAT)))
    _assert_matches(Counter(toks.tolist()), expected)


def test_top_k_top_p_min_p_renormalise() -> None:
    probs = torch.tensor([0.35, 0.25, 0.2, 0.12, 0.08])
    cases = [({"top_k": 3}, [0.35, 0.25, 0.2, 0, 0]),
             ({"top_p": 0.75}, [0.35, 0.25, 0.2, 0, 0]),
             ({"top_k": 4, "top_p": 0.7}, [0.35, 0.25, 0.2, 0, 0]),  # 0.6 of 0.92 < 0.7
             ({"min_p": 0.3}, [0.35, 0.25, 0.2, 0.12, 0])]  # threshold 0.105
    for fields, kept in cases:
        expected = torch.tensor(kept) / sum(kept)
        _assert_matches(draws(probs.tolist(), N_STAT, **fields), expected)


# ---- penalties, suppression, logprobs -------------------------------------------------------

def _penalised_ref(logits: list[float], prompt: list[int], output: list[int],
                   rep: float, pres: float, freq: float) -> list[float]:
    out = list(logits)
    counts = Counter(output)
    for tok in range(len(out)):
        if tok in prompt or tok in counts:
            out[tok] = out[tok] / rep if out[tok] > 0 else out[tok] * rep
        if counts[tok] > 0:
            out[tok] -= pres
        out[tok] -= freq * counts[tok]
    return out


def test_penalties_match_python_reference() -> None:
    torch.manual_seed(3)
    vocab = 30
    logits = torch.randn(5, vocab) * 3
    params = [{"repetition_penalty": 1.3}, {"presence_penalty": 0.7},
              {"frequency_penalty": -0.4, "repetition_penalty": 0.8},
              {"repetition_penalty": 2.0, "presence_penalty": -1.0, "frequency_penalty": 1.5},
              {}]
    prompts = [[0, 1, 2, 2, 29], [3, 4], [5, 6, 7], [8, 9, 9, 10], [1, 2, 3]]
    outputs = [[3, 3, 4], [4, 4, 4, 11], [5, 12, 12], [10, 10, 13], [4, 4]]
    t = build([SamplingParams(**p) for p in params], vocab=vocab, prompts=prompts,
              outputs=outputs)
    got = apply_penalties(logits, t)
    for r, p in enumerate(params):
        ref = _penalised_ref(logits[r].tolist(), prompts[r], outputs[r],
                             p.get("repetition_penalty", 1.0), p.get("presence_penalty", 0.0),
                             p.get("frequency_penalty", 0.0))
        torch.testing.assert_close(got[r], torch.tensor(ref), rtol=1e-6, atol=1e-6)
    assert torch.equal(got[4], logits[4])  # neutral row is bit-identical
    # Greedy rows pick the argmax of the penalised logits.
    greedy = Sampler()(logits, build([{**p, "temperature": 0.0} for p in params], vocab=vocab,
                                     prompts=prompts, outputs=outputs))
    assert torch.equal(greedy.sampled_token_ids, got.argmax(dim=-1))


def test_strong_repetition_penalty_avoids_seen_tokens() -> None:
    logits = torch.tensor([[5.0, 4.9, 1.0, 0.0]])  # seen: 0.5, 0.49
    toks = sample(logits, [{"temperature": 0.0, "repetition_penalty": 10.0}],
                  prompts=[[0]], outputs=[[1]])
    assert toks.tolist() == [2]


def test_suppressed_tokens_never_sampled() -> None:
    n = 500
    logits = torch.tensor([3.0, 2.0, 1.0, 0.0, -1.0]).expand(n + 1, -1).contiguous()
    params = [{"temperature": 0.0}] + [{"temperature": 1.5}] * n
    # Row 0 is greedy with its argmax banned; every sampled row bans tokens 0 and 2.
    suppress = [(0, 0)] + [(r, tok) for r in range(1, n + 1) for tok in (0, 2)]
    toks = sample(logits, params, seeds=list(range(n + 1)), suppress=suppress)
    assert toks[0].item() == 1
    assert set(toks[1:].tolist()) == {1, 3, 4}


def test_logprobs_are_raw_model_logprobs() -> None:
    torch.manual_seed(4)
    logits = torch.randn(4, 50) * 2
    params = [{"logprobs": 3, "temperature": 0.0}, {"logprobs": None, "temperature": 0.7},
              {"logprobs": 5, "temperature": 1.0, "top_k": 4, "repetition_penalty": 1.7},
              {"logprobs": 0, "temperature": 1.2, "presence_penalty": 1.0}]
    t = build(params, vocab=50, prompts=[[1, 2]] * 4, outputs=[[3]] * 4, suppress=[(0, 7)])
    assert t.max_num_logprobs == 5
    out = Sampler()(logits, t)
    ref = torch.log_softmax(logits, dim=-1)
    rows = torch.arange(4)
    torch.testing.assert_close(out.logprobs, ref[rows, out.sampled_token_ids])
    top = torch.topk(ref, 5, dim=-1)
    torch.testing.assert_close(out.top_logprobs, top.values)
    assert torch.equal(out.top_token_ids, top.indices)
    assert out.top_logprobs.shape == (4, 5) and out.top_token_ids.dtype == torch.int64


def test_no_logprobs_when_not_requested_and_zero_means_sampled_only() -> None:
    logits = torch.randn(2, 10)
    out = Sampler()(logits, build([{}, {"temperature": 0.0}], vocab=10))
    assert out.logprobs is None and out.top_logprobs is None and out.top_token_ids is None
    out = Sampler()(logits, build([{"logprobs": 0}, {}], vocab=10))
    assert out.top_logprobs.shape == (2, 0)
    ref = torch.log_softmax(logits, dim=-1)
    torch.testing.assert_close(out.logprobs, ref[torch.arange(2), out.sampled_token_ids])


# ---- building the tensors -------------------------------------------------------------------

def test_build_tensors_and_flags() -> None:
    params = [SamplingParams(temperature=0.0, top_k=3),
              SamplingParams(temperature=0.8, top_k=0, top_p=0.9),
              {"temperature": 1e-7, "min_p": 0.2, "frequency_penalty": 0.5},
              {"temperature": 1.0, "top_k": 100}]
    t = build(params, seeds=[1, 2, 3, 2**63 - 1], steps=[0, 4, 2, 9], vocab=8,
              prompts=[[0, 1], [7], [], [2, 2]], outputs=[[1, 1, 3], [], [5], [7, 7, 7]],
              suppress=[(1, 6), (3, 0)])
    assert t.temperatures.tolist() == pytest.approx([0.0, 0.8, 0.0, 1.0])  # 1e-7 -> greedy
    assert t.top_ks.tolist() == [3, 8, 8, 8] and t.top_ks.dtype == torch.int32
    assert t.seeds.tolist() == [1, 2, 3, 2**63 - 1] and t.sample_steps.tolist() == [0, 4, 2, 9]
    assert (t.any_top_k, t.any_top_p, t.any_min_p) == (False, True, False)  # greedy rows only
    assert t.any_penalty and not t.all_greedy and t.max_num_logprobs == -1
    mask = torch.zeros(4, 8, dtype=torch.bool)
    for r, toks in enumerate([[0, 1], [7], [], [2, 2]]):
        mask[r, toks] = True
    counts = torch.zeros(4, 8, dtype=torch.int32)
    for r, toks in enumerate([[1, 1, 3], [], [5], [7, 7, 7]]):
        for tok in toks:
            counts[r, tok] += 1
    assert torch.equal(t.prompt_mask, mask) and torch.equal(t.output_counts, counts)
    assert t.suppress_token_ids.tolist() == [[1, 6], [3, 0]]
    plain = build([{"temperature": 0.0}] * 2, vocab=8)
    assert plain.all_greedy and not plain.any_penalty and plain.prompt_mask is None
    with pytest.raises(ValueError, match="penalties need"):
        SamplingTensors.build([SamplingParams(presence_penalty=1.0)], [0], [0], None, None,
                              [], 8, "cpu")


def test_build_rows_sharing_params_objects() -> None:
    """Rows that share one SamplingParams object (as LLM.generate gives) and rows with their
    own, equal or not, each get their own settings; batch flags count sampled rows only."""
    greedy = SamplingParams(temperature=0.0, top_k=3, logprobs=2)  # its top_k is moot
    nucleus = SamplingParams(temperature=0.7, top_p=0.8)
    nucleus_copy = SamplingParams(temperature=0.7, top_p=0.8)
    min_p = SamplingParams(temperature=1.0, min_p=0.1, logprobs=5)
    params = [greedy, nucleus, greedy, nucleus_copy, min_p, nucleus, greedy]
    t = SamplingTensors.build(params, list(range(10, 17)), list(range(7)), None, None, [], 16,
                              "cpu")
    assert t.temperatures.tolist() == pytest.approx([0.0, 0.7, 0.0, 0.7, 1.0, 0.7, 0.0])
    assert t.top_ks.tolist() == [3, 16, 3, 16, 16, 16, 3]
    assert t.top_ps.tolist() == pytest.approx([1.0, 0.8, 1.0, 0.8, 1.0, 0.8, 1.0])
    assert t.min_ps.tolist() == pytest.approx([0.0, 0.0, 0.0, 0.0, 0.1, 0.0, 0.0])
    assert t.seeds.tolist() == list(range(10, 17)) and t.sample_steps.tolist() == list(range(7))
    assert t.max_num_logprobs == 5
    assert (t.all_greedy, t.any_top_k, t.any_top_p, t.any_min_p, t.any_penalty) == \
        (False, False, True, True, False)
    shared = SamplingParams(temperature=0.0, presence_penalty=0.5)
    t = build([shared, {"temperature": 0.0}, shared], vocab=8)
    assert t.all_greedy and t.any_penalty and t.max_num_logprobs == -1
    assert t.presence_penalties.tolist() == [0.5, 0.0, 0.5]
    t = build([shared] * 3, vocab=8)  # one object for the whole batch
    assert t.all_greedy and t.any_penalty and t.presence_penalties.tolist() == [0.5] * 3
    one = SamplingParams(temperature=0.5, top_k=4, min_p=0.2, repetition_penalty=1.5,
                         logprobs=3)
    t = build([one] * 4, seeds=[7, 8, 9, 10], steps=[1, 2, 3, 4], vocab=8)
    assert t.temperatures.tolist() == [0.5] * 4 and t.top_ks.tolist() == [4] * 4
    assert t.min_ps.tolist() == pytest.approx([0.2] * 4) and t.top_ps.tolist() == [1.0] * 4
    assert t.repetition_penalties.tolist() == [1.5] * 4
    assert t.frequency_penalties.tolist() == [0.0] * 4
    assert t.seeds.tolist() == [7, 8, 9, 10] and t.sample_steps.tolist() == [1, 2, 3, 4]
    assert (t.all_greedy, t.any_top_k, t.any_top_p, t.any_min_p, t.any_penalty) == \
        (False, True, False, True, True)
    assert t.max_num_logprobs == 3 and t.prompt_mask.shape == (4, 8)


def test_all_greedy_batch_is_argmax() -> None:
    torch.manual_seed(5)
    logits = torch.randn(8, 64)
    toks = sample(logits, [SamplingParams(temperature=0.0)] * 8)
    assert torch.equal(toks, logits.argmax(dim=-1)) and toks.dtype == torch.int64


def test_logits_not_modified_in_place() -> None:
    logits = torch.randn(3, 20)
    before = logits.clone()
    sample(logits, [{"temperature": 0.9, "top_k": 3, "top_p": 0.5, "min_p": 0.1,
                     "repetition_penalty": 1.2}] * 3, prompts=[[1]] * 3, outputs=[[2]] * 3,
           suppress=[(0, 1)])
    assert torch.equal(logits, before)
    assert not math.isnan(logits.sum().item())


# ---- sharded sampling (tensor-parallel ranks each draw over their vocab range) --------------

@pytest.mark.parametrize("shards", [2, 3, 4])
def test_shard_bests_combine_to_the_whole_row_draw(shards: int) -> None:
    """Each shard's best (value, global index), reduced over the shards by the collective's
    rule, is the token `forward` draws from the whole row: greedy and sampled rows, a row
    with ties across a shard boundary (the lower index must win), and an all -inf row."""
    from models.layers.sampler import _shard_best
    from models.parallel import tp_argmax

    vocab = 50
    gen = torch.Generator().manual_seed(shards)
    logits = torch.randn(5, vocab, generator=gen) * 3
    logits[2, 10:40] = 7.0  # greedy ties: spans every boundary of 2, 3 and 4 shards
    logits[4] = -math.inf
    params = [{"temperature": 0.0}, {"temperature": 0.7}, {"temperature": 0.0},
              {"temperature": 1.3}, {"temperature": 0.0}]
    t = build(params, seeds=[3, 1, 4, 1 << 40, 9], steps=[0, 5, 2, 7, 1], vocab=vocab)
    assert t.temperature_only
    expected = Sampler()(logits, t).sampled_token_ids
    bounds = [round(i * vocab / shards) for i in range(shards + 1)]
    parts = [_shard_best(logits[:, lo:hi], t, lo)
             for lo, hi in zip(bounds[:-1], bounds[1:], strict=True)]
    values = torch.cat([v for v, _ in parts], dim=1)  # [B, shards]
    indices = torch.cat([i for _, i in parts], dim=1)
    got = tp_argmax(values, indices)  # no process group: the reduction alone
    assert got.tolist() == expected.tolist()
    assert got[2].item() == 10 and got[4].item() == 0


def test_shard_sampling_is_refused_where_more_than_temperature_shapes_the_draw() -> None:
    for fields in ({"temperature": 0.8, "top_k": 5}, {"temperature": 0.8, "top_p": 0.5},
                   {"temperature": 0.8, "min_p": 0.1}, {"temperature": 0.8, "logprobs": 2},
                   {"temperature": 0.8, "presence_penalty": 0.5}):
        t = build([fields], vocab=8)
        assert not t.temperature_only, fields
        with pytest.raises(AssertionError, match="temperature alone"):
            Sampler().sample_shard(torch.zeros(1, 8), t, 0)
    assert not build([{"temperature": 0.8}], vocab=8, suppress=[(0, 3)]).temperature_only
    assert build([{"temperature": 0.8}, {"temperature": 0.0}], vocab=8).temperature_only


# ---- logit bias and token bitmasks ---------------------------------------------------------


def test_token_bitmask_matches_xgrammar() -> None:
    xgr = pytest.importorskip("xgrammar")
    gen = torch.Generator().manual_seed(0)
    vocab = 1000  # not a multiple of 32: the last word's high bits lie past the vocabulary
    bitmask = torch.randint(-2**31, 2**31 - 1, (5, -(-vocab // 32)), dtype=torch.int32,
                            generator=gen)
    logits = torch.randn(5, vocab, generator=gen)
    expected = logits.clone()
    xgr.apply_token_bitmask_inplace(expected, bitmask, vocab_size=vocab)
    assert torch.equal(apply_token_bitmask(logits, bitmask), expected)


def test_bitmask_bias_and_logprobs_together() -> None:
    """A masked token is never drawn even with +100 bias on it; the bias moves the draw
    among allowed tokens; logprobs stay the model's own (before bias and mask)."""
    logits = torch.zeros(2, 40)
    params = [SamplingParams(temperature=1.0, logit_bias={3: 100.0, 33: 100.0}, logprobs=1),
              SamplingParams(temperature=0.0, logit_bias={7: -100.0})]
    bias = [(r, t, b) for r, p in enumerate(params) for t, b in p.logit_bias.items()]
    t = SamplingTensors.build(params, [1, 2], [0, 0], None, None, [], 40, "cpu", bias, True)
    assert not t.temperature_only
    mask = torch.full((2, 2), -1, dtype=torch.int32)
    mask[0, 0] = 0  # tokens 0..31 banned in row 0: the +100 on token 3 cannot win
    t.token_bitmask = mask
    out = Sampler()(logits, t)
    assert out.sampled_token_ids.tolist() == [33, 0]  # row 1: greedy over 0s, 7 pushed down
    assert out.logprobs is not None
    assert out.logprobs[0].item() == pytest.approx(-math.log(40))
