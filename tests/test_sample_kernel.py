"""The fused race-sampling kernel (models/kernels/sample.py) on CPU, under TRITON_INTERPRET=1.

The interpreter must be on before triton is first imported, so the checks run this file as
a script in a fresh subprocess (tests/interpret.py). Reference: the torch
path of the sampler, `race_perturbed(logits / T, seeds, steps).argmax(-1)` for sampled rows
and `logits.argmax(-1)` for greedy rows, plus softmax(logits / T) for the draw frequencies.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from tests.interpret import interpreted_check_test, run_checks

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                reason="triton is not installed")

# Perturbed top-2 closer than this (relative) may swap between log implementations (an ulp).
NEAR_TIE_REL = 1e-5


def race_reference(logits: torch.Tensor, temps: torch.Tensor, seeds: torch.Tensor,
                   steps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens [B], near_tie [B] bool) from the sampler's torch path on the same inputs."""
    from models.layers.sampler import race_perturbed

    x = logits.float()  # [B, V]
    sampled = temps > 0
    scaled = x / torch.where(sampled, temps, 1.0)[:, None]
    perturbed = race_perturbed(scaled, seeds, steps)  # [B, V]
    tokens = torch.where(sampled, perturbed.argmax(-1), x.argmax(-1))
    top2 = perturbed.topk(min(2, x.shape[1]), dim=-1).values  # [B, 2]
    if top2.shape[1] == 1:  # V = 1: nothing to tie with
        return tokens, torch.zeros_like(sampled)
    gap = top2[:, 0] - top2[:, 1]
    near = sampled & torch.isfinite(top2).all(dim=-1) & (gap <= NEAR_TIE_REL * top2.abs().amax(-1))
    return tokens, near


def assert_tokens_match(got: torch.Tensor, ref: torch.Tensor, near: torch.Tensor,
                        what: str) -> int:
    """Every row outside a near tie matches exactly; returns the number of near ties."""
    assert got.dtype == torch.int64 and got.shape == ref.shape, (what, got.dtype, got.shape)
    got, ref = got.cpu(), ref.cpu()
    bad = (got != ref) & ~near.cpu()
    assert not bad.any(), (f"{what}: rows {bad.nonzero().flatten().tolist()[:10]} differ: "
                           f"got {got[bad].tolist()[:10]}, want {ref[bad].tolist()[:10]}")
    return int(near.sum())


# "near_ties" runs last: the rows of every check before it count there.
CHECKS = ["reference", "launches", "edges", "distribution", "sampler", "shards", "near_ties"]


test_sample_kernel_check_interpreted = interpreted_check_test(__file__, CHECKS)


# --------------------------------------------------------------------------- subprocess side

# chi-square, 7 degrees of freedom: P(X > 24.32) = 0.001. The seeds are fixed (no flakes);
# a hash that drops or skews words lands far above it.
CHI2_7DOF_999 = 24.32


def _inputs(num_rows: int, vocab: int, gen: torch.Generator
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random logits, a mix of greedy / moderate / huge / tiny temperatures, int64 seeds over
    the whole range (negative ones included) and steps."""
    logits = torch.randn(num_rows, vocab, generator=gen) * 3
    choices = torch.tensor([0.0, 0.3, 1.0, 1.7, 1e4, 1e-4])
    temps = choices[torch.randint(0, len(choices), (num_rows,), generator=gen)]
    seeds = torch.randint(-2**63, 2**63 - 1, (num_rows,), generator=gen, dtype=torch.int64)
    steps = torch.randint(0, 2**40, (num_rows,), generator=gen, dtype=torch.int64)
    return logits, temps, seeds, steps


def _main() -> None:
    from models.kernels.sample import race_argmax

    gen = torch.Generator().manual_seed(1234)
    counts = {"rows": 0, "near": 0}

    def check(logits, temps, seeds, steps, what, **launch):
        got = race_argmax(logits, temps, seeds, steps, **launch)
        ref, near = race_reference(logits, temps, seeds, steps)
        counts["near"] += assert_tokens_match(got, ref, near, what)
        counts["rows"] += int((temps > 0).sum())
        return got

    def check_reference():
        # V = 600 is no multiple of 64: the last tile of a row is ragged.
        logits, temps, seeds, steps = _inputs(32, 600, gen)
        check(logits, temps, seeds, steps, "random", block=64, num_splits=3)
        # -inf masks: mostly masked rows, one survivor, a fully masked row (-> 0).
        masked = logits.clone()
        masked[:16][torch.rand(16, 600, generator=gen) < 0.9] = float("-inf")
        masked[16, :] = float("-inf")
        masked[16, 577] = 0.0
        masked[17, :] = float("-inf")
        got = check(masked, temps, seeds, steps, "masked", block=64, num_splits=3)
        assert got[16].item() == 577 and got[17].item() == 0
        finite = torch.isfinite(masked[:16]).gather(1, got[:16, None])
        assert finite.all(), "a -inf entry won in a row that had finite ones"
        # Ties: constant rows and a max repeated in the same lane of later tiles and in later
        # splits -> the lowest index, greedy or not (noise breaks ties for sampled rows).
        ties = torch.zeros(6, 600)
        ties[3:, [130, 130 + 64, 400, 599]] = 5.0
        t_temps = torch.tensor([0.0, 0.0, 1.0, 0.0, 0.0, 0.0])
        got = check(ties, t_temps, seeds[:6], steps[:6], "ties", block=64, num_splits=3)
        assert got[[0, 1, 3, 4, 5]].tolist() == [0, 0, 130, 130, 130]
        # B = 1 over several default-size tiles (the last split is empty), then a row slice
        # of a wider tensor (row stride != V) and a column-strided view.
        one = _inputs(1, 5000, gen)
        check(*one, "B=1", num_splits=4)
        check(one[0], torch.ones(1), *one[2:], "B=1 sampled", num_splits=4)
        wide = torch.randn(8, 900, generator=gen)
        sliced = wide[:, 17:17 + 600]
        assert sliced.stride(0) == 900
        check(sliced, temps[:8], seeds[:8], steps[:8], "row stride", block=128, num_splits=2)
        cols = torch.randn(600, 8, generator=gen).t()
        check(cols, temps[:8], seeds[:8], steps[:8], "column stride", block=128)
        # bf16 / fp16 logits go in as they are; the reference widens them to float32.
        for dtype in (torch.bfloat16, torch.float16):
            check(logits[:16].to(dtype), temps[:16], seeds[:16], steps[:16], f"{dtype}",
                  block=64, num_splits=2)
        # A token bitmask (structured output) read by the kernel equals -inf where its bits
        # are clear; rows of all ones change nothing, a row of zeros gives 0.
        from models.layers.sampler import apply_token_bitmask

        bits = torch.randint(-2**31, 2**31 - 1, (32, 19), generator=gen, dtype=torch.int32)
        bits[0], bits[1] = -1, 0
        got = race_argmax(logits, temps, seeds, steps, block=64, num_splits=3, bitmask=bits)
        ref, near = race_reference(apply_token_bitmask(logits, bits), temps, seeds, steps)
        assert_tokens_match(got, ref, near, "bitmask")
        assert got[1].item() == 0

    def check_launches():
        logits, temps, seeds, steps = _inputs(6, 333, gen)
        want = check(logits, temps, seeds, steps, "launch 16x1", block=16, num_splits=1)
        for block, splits in [(16, 7), (32, 30), (64, 2), (256, 4), (1024, None)]:
            got = race_argmax(logits, temps, seeds, steps, block=block, num_splits=splits)
            assert torch.equal(got, want), (block, splits, got.tolist(), want.tolist())

    def check_edges():
        # NaN never wins (and never crashes): the answer is that of the row with NaN -> -inf;
        # a row of NaNs answers 0.
        logits, temps, seeds, steps = _inputs(6, 300, gen)
        with_nan = logits.clone()
        with_nan[:5, ::7] = float("nan")
        with_nan[5] = float("nan")
        got = race_argmax(with_nan, temps, seeds, steps, block=64, num_splits=2)
        ref, near = race_reference(with_nan[:5].nan_to_num(float("-inf")), temps[:5],
                                   seeds[:5], steps[:5])
        assert_tokens_match(got[:5], ref, near, "nan")
        assert got[5].item() == 0
        empty = race_argmax(torch.empty(0, 10), torch.empty(0), torch.empty(0, dtype=torch.long),
                            torch.empty(0, dtype=torch.long))
        assert empty.shape == (0,) and empty.dtype == torch.int64
        # V = 1 and a vocab smaller than one tile.
        for vocab in (1, 5):
            x, t, s, st = _inputs(3, vocab, gen)
            check(x, t, s, st, f"V={vocab}")

    def check_distribution():
        # 8 tokens (expected counts >= 10 each): many seeds at one step, one seed over many
        # steps.
        logits = torch.tensor([1.0, 0.5, 0.0, -0.5, -1.0, 1.5, -0.3, 0.2])
        n = 300
        for temp, seeds, steps in [(0.8, torch.arange(n), torch.full((n,), 3)),
                                   (1.6, torch.full((n,), 99), torch.arange(n))]:
            expected = torch.softmax(logits.double() / temp, dim=-1) * n
            toks = check(logits.expand(n, -1), torch.full((n,), temp), seeds, steps,
                         f"T={temp}", block=8, num_splits=1)
            seen = torch.bincount(toks, minlength=8).double()
            chi2 = ((seen - expected) ** 2 / expected).sum().item()
            assert chi2 < CHI2_7DOF_999, (temp, chi2, seen.tolist(), expected.tolist())

    def check_sampler():
        # The Sampler's kernel draw on masked batches (top-k / top-p / min-p mixed with greedy
        # rows that carry masks of their own) against its torch path on the same logits.
        from engine_service.common.sampling_params import SamplingParams
        from models.layers.sampler import Sampler, SamplingTensors

        kinds = [dict(temperature=0.0, top_k=3, min_p=0.5), dict(temperature=0.7, top_k=5),
                 dict(temperature=1.3, top_p=0.6), dict(temperature=1.0, min_p=0.2),
                 dict(temperature=0.9, top_k=50, top_p=0.9, min_p=0.05),
                 dict(temperature=1.1), dict(temperature=0.0, top_p=0.5)]
        params = [SamplingParams(**kinds[i % len(kinds)]) for i in range(28)]
        vocab = 200
        logits = torch.randn(len(params), vocab, generator=gen) * 2
        logits[::4, 7] = logits[::4].amax(-1) + 1.0  # greedy and sampled rows with a tied max
        logits[::4, 150] = logits[::4, 7]
        seeds = torch.randint(0, 2**62, (len(params),), generator=gen).tolist()
        t = SamplingTensors.build(params, seeds, list(range(len(params))), None, None, [],
                                  vocab, "cpu")
        assert t.any_top_k and t.any_top_p and t.any_min_p and not t.all_greedy
        got = Sampler._sample_kernel(logits, t)
        want = torch.where(t.temperatures > 0, Sampler._sample(logits, t), logits.argmax(-1))
        unit = (t.temperatures > 0).float()
        _, near = race_reference(Sampler._scale_and_mask(logits, t), unit, t.seeds,
                                 t.sample_steps)
        counts["near"] += assert_tokens_match(got, want, near, "sampler masks")
        counts["rows"] += int(unit.sum())

    def check_shards():
        # Vocab-parallel sampling: each of W shards races its columns with its vocab offset,
        # and the partials of all shards, reduced by tp_argmax (one process: the local
        # reduction), give exactly the full row's race_argmax; the partials carry global
        # indices inside their shard and, for sampled rows, the full row's perturbed values
        # at those indices (the hash counts global indices).
        from models.kernels.sample import race_argmax, race_partials
        from models.layers.sampler import race_perturbed
        from models.parallel import tp_argmax
        from models.sampling_hash import NO_INDEX

        vocab = 600
        for world in (2, 3, 4):
            shard = vocab // world
            for num_rows, kind in ((1, "greedy"), (1, "sampled"), (3, "greedy"),
                                   (3, "sampled"), (3, "mix")):
                logits, _, seeds, steps = _inputs(num_rows, vocab, gen)
                # Row 0: the row's max tied across the first shard boundary and at the end.
                logits[0, [shard - 1, shard, vocab - 1]] = logits[0].amax() + 1.0
                if num_rows == 3:
                    # Row 1: a -inf run across a boundary and a whole shard, and the last
                    # shard all -inf. Row 2: -inf and NaN only (-> 0).
                    logits[1, shard - 40:2 * shard + 10] = float("-inf")
                    logits[1, vocab - shard:] = float("-inf")
                    logits[2] = float("-inf")
                    logits[2, ::7] = float("nan")
                temps = {"greedy": torch.zeros(num_rows), "sampled": torch.full((num_rows,), 0.7),
                         "mix": torch.tensor([0.7, 0.0, 0.7])}[kind]
                want = race_argmax(logits, temps, seeds, steps, block=64)
                for splits in (None, 3):
                    parts = [race_partials(logits[:, r * shard:(r + 1) * shard], temps, seeds,
                                           steps, vocab_offset=r * shard, num_splits=splits,
                                           block=64) for r in range(world)]
                    what = f"W={world} B={num_rows} {kind} splits={splits}"
                    for r, (val, idx) in enumerate(parts):
                        assert val.dtype == torch.float32 and idx.dtype == torch.int32, what
                        empty = idx == NO_INDEX
                        assert torch.all(val[empty] == float("-inf")), what
                        inside = (idx >= r * shard) & (idx < (r + 1) * shard)
                        assert torch.all(inside | empty), (what, r, idx.tolist())
                        rows = (~empty).nonzero()[:, 0]
                        at = idx[~empty].long()
                        greedy = temps[rows] == 0
                        scaled = logits / torch.where(temps > 0, temps, 1.0)[:, None]
                        noisy = race_perturbed(scaled, seeds, steps)[rows, at]
                        ref = torch.where(greedy, logits[rows, at], noisy)
                        assert torch.allclose(val[~empty], ref, rtol=1e-6, atol=0), (what, r)
                    got = tp_argmax(torch.cat([v for v, _ in parts], dim=1),
                                    torch.cat([i for _, i in parts], dim=1))
                    assert torch.equal(got, want), (what, got.tolist(), want.tolist())
                    no_nan = torch.where(logits.isnan(), float("-inf"), logits)
                    ref, near = race_reference(no_nan, temps, seeds, steps)
                    assert_tokens_match(got, ref, near, what)
                    if kind == "greedy":
                        assert got[0].item() == shard - 1, (what, got.tolist())
                    if num_rows == 3:
                        assert torch.isfinite(logits[1, got[1]]) and got[2].item() == 0, what

    def check_near_ties():
        # Runs last: the rows of every check above count here.
        assert counts["rows"] > 200, counts
        assert counts["near"] < 0.01 * counts["rows"], counts

    run_checks(list(zip(CHECKS, [check_reference, check_launches, check_edges,
                                 check_distribution, check_sampler, check_shards,
                                 check_near_ties],
                        strict=True)))


if __name__ == "__main__":
    _main()
