"""The fused race-sampling kernel and the Sampler's kernel path on CUDA, at Qwen3's vocab.

Reference: the sampler's torch path on the same device and inputs (the hash words are
integer math, so they agree bit for bit; the race's float log may differ by an ulp, so rows
whose perturbed top-2 are within NEAR_TIE_REL may differ, and those must stay rare).
"""

from __future__ import annotations

import pytest
import torch

from engine_service.common.sampling_params import SamplingParams
from models.kernels.sample import MAX_SPLITS, race_argmax, race_partials
from models.layers.sampler import Sampler, SamplingTensors, apply_penalties
from models.parallel import tp_argmax
from models.sampling_hash import NO_INDEX
from tests.test_sample_kernel import assert_tokens_match, race_reference

DEVICE = torch.device("cuda")
VOCAB = 151936  # Qwen3
TEMPS = [0.0, 0.05, 0.6, 1.0, 1.7, 1e4]
# chi-square, 7 degrees of freedom: P(X > 24.32) = 0.001 (fixed seeds: no flakes).
CHI2_7DOF_999 = 24.32


def _inputs(num_rows: int, dtype: torch.dtype, seed: int
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    logits = (torch.randn(num_rows, VOCAB, generator=gen, device=DEVICE) * 4).to(dtype)
    pick = torch.randint(0, len(TEMPS), (num_rows,), generator=gen, device=DEVICE)
    temps = torch.tensor(TEMPS, device=DEVICE)[pick]
    seeds = torch.randint(-2**63, 2**63 - 1, (num_rows,), generator=gen, device=DEVICE)
    steps = torch.randint(0, 2**40, (num_rows,), generator=gen, device=DEVICE)
    return logits, temps, seeds, steps


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_race_argmax_matches_torch_reference(dtype: torch.dtype) -> None:
    rows = near = 0
    for num_rows in (1, 3, 64, 256):
        for rep in range(4 if num_rows < 64 else 1):
            logits, temps, seeds, steps = _inputs(num_rows, dtype, seed=num_rows * 10 + rep)
            if num_rows >= 64:
                # -inf masks of every density, a row with one survivor, a constant row.
                dens = torch.linspace(0.0, 0.999, num_rows // 2, device=DEVICE)[:, None]
                drop = torch.rand(num_rows // 2, VOCAB, device=DEVICE) < dens
                logits[: num_rows // 2][drop] = float("-inf")
                logits[-1] = float("-inf")
                logits[-1, VOCAB - 1] = 1.0
                logits[-2] = 0.5
            got = race_argmax(logits, temps, seeds, steps)
            ref, is_near = race_reference(logits, temps, seeds, steps)
            near += assert_tokens_match(got, ref, is_near, f"B={num_rows} rep={rep}")
            rows += int((temps > 0).sum())
            if num_rows >= 64:
                assert got[-1].item() == VOCAB - 1
                if temps[-2] == 0:
                    assert got[-2].item() == 0
    assert near < 0.01 * rows, (near, rows)


def test_launch_choices_and_layouts_give_the_same_tokens() -> None:
    logits, temps, seeds, steps = _inputs(3, torch.float32, seed=7)
    temps[0] = 0.0
    want = race_argmax(logits, temps, seeds, steps)
    for block, splits in [(256, 1), (1024, 7), (4096, 3), (512, MAX_SPLITS), (1024, None)]:
        got = race_argmax(logits, temps, seeds, steps, block=block, num_splits=splits)
        assert torch.equal(got, want), (block, splits)
    # A row slice of a wider tensor (row stride != V) and half-precision inputs.
    wide = torch.full((3, VOCAB + 100), float("nan"), device=DEVICE)
    wide[:, 33:33 + VOCAB] = logits
    assert torch.equal(race_argmax(wide[:, 33:33 + VOCAB], temps, seeds, steps), want)
    half = logits.half()
    ref, near = race_reference(half, temps, seeds, steps)
    assert_tokens_match(race_argmax(half, temps, seeds, steps), ref, near, "fp16")


def test_greedy_ties_pick_the_lowest_index() -> None:
    logits = torch.zeros(4, VOCAB, device=DEVICE, dtype=torch.bfloat16)
    logits[1:, [VOCAB - 1, 100_000, 5_000, 5_000 + 1024]] = 3.0
    zeros = torch.zeros(4, dtype=torch.int64, device=DEVICE)
    got = race_argmax(logits, torch.zeros(4, device=DEVICE), zeros, zeros)
    assert got.tolist() == [0, 5_000, 5_000, 5_000]
    assert torch.equal(got, logits.argmax(-1))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("num_rows", [1, 3])
@pytest.mark.parametrize("world", [2, 4])
def test_vocab_shards_reduce_to_the_full_row(dtype: torch.dtype, num_rows: int,
                                             world: int) -> None:
    """Each TP rank's shard raced with its vocab offset (race_partials), every shard's
    partials reduced by tp_argmax (one process: the local reduction), is exactly
    race_argmax on the full row: greedy rows, sampled rows and a mix, with the row's max
    tied across a shard boundary and a -inf run over a whole shard."""
    shard = VOCAB // world
    for rep, kind in enumerate(("greedy", "sampled", "mix")):
        logits, _, seeds, steps = _inputs(num_rows, dtype, seed=100 * world + 10 * num_rows + rep)
        logits[0, [shard - 1, shard, VOCAB - 1]] = logits[0].float().amax().to(dtype) + 1
        if num_rows > 1:
            logits[1, shard - 1000:2 * shard + 1000] = float("-inf")
        temps = {"greedy": torch.zeros(num_rows, device=DEVICE),
                 "sampled": torch.full((num_rows,), 0.7, device=DEVICE),
                 "mix": torch.tensor([0.7, 0.0, 0.7][:num_rows], device=DEVICE)}[kind]
        want = race_argmax(logits, temps, seeds, steps)
        parts = [race_partials(logits[:, r * shard:(r + 1) * shard], temps, seeds, steps,
                               vocab_offset=r * shard) for r in range(world)]
        for r, (_, idx) in enumerate(parts):
            inside = (idx >= r * shard) & (idx < (r + 1) * shard)
            assert torch.all(inside | (idx == NO_INDEX)), f"shard {r}: indices not global"
        got = tp_argmax(torch.cat([v for v, _ in parts], dim=1),
                        torch.cat([i for _, i in parts], dim=1))
        assert torch.equal(got, want), (kind, got.tolist(), want.tolist())
        if kind == "greedy":
            assert got[0].item() == shard - 1
        if num_rows > 1:
            assert torch.isfinite(logits[1, got[1]].float())


def test_draw_frequencies_match_softmax() -> None:
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5, -1.0, 1.5, -0.3, 0.2], device=DEVICE)
    n = 20000
    for temp in (0.7, 1.0, 2.0):
        expected = torch.softmax(logits.double() / temp, dim=-1) * n
        for seeds, steps in [(torch.arange(n), torch.full((n,), 5)),
                             (torch.full((n,), 123), torch.arange(n))]:
            toks = race_argmax(logits.expand(n, -1), torch.full((n,), temp, device=DEVICE),
                               seeds.to(DEVICE), steps.to(DEVICE))
            seen = torch.bincount(toks, minlength=8).double()
            chi2 = ((seen - expected) ** 2 / expected).sum().item()
            assert chi2 < CHI2_7DOF_999, (temp, chi2)


# ---- the Sampler end to end -----------------------------------------------------------------

BATCH_KINDS = [
    dict(temperature=0.0), dict(temperature=0.6), dict(temperature=1.0, top_k=20),
    dict(temperature=0.8, top_p=0.9), dict(temperature=1.2, min_p=0.1),
    dict(temperature=0.7, top_k=50, top_p=0.95, min_p=0.02),
    dict(temperature=1.0, repetition_penalty=1.3, presence_penalty=0.5),
    dict(temperature=0.0, top_k=5, frequency_penalty=0.7), dict(temperature=0.9, logprobs=3),
]


def _masked_logits(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    """What the race sees in the torch path: penalised, suppressed, / T, masked."""
    x = logits.float()
    if t.any_penalty:
        x = apply_penalties(x, t)
    if t.suppress_token_ids is not None:
        sup = t.suppress_token_ids
        x = x.index_put((sup[:, 0], sup[:, 1]), x.new_full((sup.shape[0],), float("-inf")))
    return Sampler._scale_and_mask(x, t)


@pytest.mark.parametrize("kinds", [BATCH_KINDS, BATCH_KINDS[:2], BATCH_KINDS[6:8],
                                   BATCH_KINDS[:1] * 2],
                         ids=["mixed", "temperature-only", "penalties-only", "all-greedy"])
@pytest.mark.parametrize("num_rows", [3, 64])
def test_sampler_kernel_path_matches_torch_path(kinds: list[dict], num_rows: int) -> None:
    gen = torch.Generator(device=DEVICE).manual_seed(num_rows + len(kinds))
    logits = (torch.randn(num_rows, VOCAB, generator=gen, device=DEVICE) * 4).bfloat16()
    params = [SamplingParams(**kinds[i % len(kinds)]) for i in range(num_rows)]
    cpu_gen = torch.Generator().manual_seed(num_rows)
    prompts = [torch.randint(0, VOCAB, (20,), generator=cpu_gen).tolist() for _ in params]
    outputs = [torch.randint(0, VOCAB, (9,), generator=cpu_gen).tolist() for _ in params]
    suppress = [(0, int(logits[0].argmax())), (num_rows - 1, 17)]
    near_tol = 0
    for step in range(3):
        t = SamplingTensors.build(params, list(range(1000, 1000 + num_rows)),
                                  [step] * num_rows, prompts, outputs,
                                  suppress if kinds is BATCH_KINDS else [], VOCAB, DEVICE)
        got = Sampler()(logits, t)
        want = Sampler(use_kernel=False)(logits, t)
        unit = (t.temperatures > 0).float()
        _, near = race_reference(_masked_logits(logits, t), unit, t.seeds, t.sample_steps)
        near_tol += assert_tokens_match(got.sampled_token_ids, want.sampled_token_ids, near,
                                        f"step {step}")
        for name in ("logprobs", "top_logprobs", "top_token_ids"):
            a, b = getattr(got, name), getattr(want, name)
            assert (a is None) == (b is None), name
        if want.top_token_ids is not None:
            assert torch.equal(got.top_token_ids, want.top_token_ids)
    assert near_tol <= 1, near_tol
