"""`models.parallel.tp_argmax`, the vocab-parallel sampler's cross-rank argmax, on CPU: one
process without a process group, and two gloo ranks (all-gathers).

Every rank's candidates come from (seed, rank), so each rank rebuilds all ranks' inputs and
checks its answer against a plain-Python reference over all of them: the largest value, the
lowest index among equal values, NaN / -inf / NO_INDEX never win, 0 when nothing is left.
"""

from __future__ import annotations

import math

import pytest
import torch

from models.parallel import tp_argmax
from models.sampling_hash import NO_INDEX
from tests.ranks import launch

INF = float("inf")
# Rows with a planted case each; the rows after them are random.
SPECIAL_ROWS = 7


def candidates(rank: int, world: int, num_rows: int, num_candidates: int, seed: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank `rank`'s (values float32 [B, S], indices int32 [B, S]) for call `seed`: small
    integer values (many ties within and across ranks), indices unique over the ranks
    (rank + world * k) in random order, and planted rows while B allows."""
    gen = torch.Generator().manual_seed(seed * 1009 + rank)
    values = torch.randint(-3, 4, (num_rows, num_candidates), generator=gen).float()
    indices = rank + world * torch.randint(0, 50_000, (num_rows, num_candidates),
                                           generator=gen)
    last = world - 1
    planted = [
        lambda v, i: v.fill_(-INF),  # 0: nothing on any rank -> 0
        # 1: NaN only on rank 0, NaN and -inf on the others; one finite value on the last
        # rank wins.
        lambda v, i: (v.view(torch.int32).fill_(-1), v[::2].fill_(-INF) if rank else None,
                      v[-1].fill_(-5.0) if rank == last else None),
        # 2: every rank's max ties (7.0, at two places each): the lowest index wins.
        lambda v, i: (v.clamp_(max=6.0), v[0].fill_(7.0), v[-1].fill_(7.0)),
        # 3: a larger value with NO_INDEX on rank 0 and a NaN on the last rank never win.
        lambda v, i: (v.clamp_(max=6.0), v[0].fill_(100.0) if rank == 0 else None,
                      i[0].fill_(NO_INDEX) if rank == 0 else None,
                      v[-1].fill_(math.nan) if rank == last else None),
        # 4: +inf on two ranks (a tie of infinities) beats everything.
        lambda v, i: v[0].fill_(INF) if rank in (0, last) else None,
        # 5: -0.0 and +0.0 are equal values: the lowest index among them wins.
        lambda v, i: (v.fill_(-INF), v[0].fill_(-0.0 if rank % 2 else 0.0)),
        # 6: every index NO_INDEX, finite values -> 0.
        lambda v, i: i.fill_(NO_INDEX),
    ]
    for row, plant in enumerate(planted[:num_rows]):
        plant(values[row], indices[row])
    return values, indices.to(torch.int32)


def best_pair(pairs: list[tuple[float, int]]) -> tuple[float, int]:
    """The best (value, index) of `pairs`, (-inf, NO_INDEX) when none may win (plain
    Python)."""
    best = (-INF, NO_INDEX)
    for v, i in pairs:
        if math.isnan(v) or v == -INF or i == NO_INDEX:
            continue
        if best[1] == NO_INDEX or v > best[0] or (v == best[0] and i < best[1]):
            best = (v, i)
    return best


def reference(all_values: list[torch.Tensor], all_indices: list[torch.Tensor]) -> list[int]:
    """Per row, the index of the best candidate over every rank's."""
    answers = []
    for row in range(all_values[0].shape[0]):
        pairs = [pair for values, indices in zip(all_values, all_indices, strict=True)
                 for pair in zip(values[row].tolist(), indices[row].tolist(), strict=True)]
        index = best_pair(pairs)[1]
        answers.append(0 if index == NO_INDEX else index)
    return answers


def expected(world: int, num_rows: int, num_candidates: int, seed: int) -> list[int]:
    parts = [candidates(r, world, num_rows, num_candidates, seed) for r in range(world)]
    return reference([v for v, _ in parts], [i for _, i in parts])


def test_reference_sees_the_planted_rows() -> None:
    """The planted rows mean what they say (else the checks below would prove little)."""
    world, num_candidates = 3, 6
    want = expected(world, SPECIAL_ROWS, num_candidates, seed=1)
    parts = [candidates(r, world, SPECIAL_ROWS, num_candidates, 1) for r in range(world)]
    assert want[0] == 0 and want[6] == 0
    assert want[1] == parts[-1][1][1, -1].item()
    sevens = [i for v, idx in parts for i in idx[2][v[2] == 7.0].tolist()]
    assert len(sevens) == 2 * world and want[2] == min(sevens)
    assert want[3] != NO_INDEX and want[3] not in parts[0][1][3, :1].tolist()
    infs = [parts[0][1][4, 0].item(), parts[-1][1][4, 0].item()]
    assert want[4] == min(infs)
    zeros = [idx[5, 0].item() for _, idx in parts]
    assert want[5] == min(zeros)


@pytest.mark.parametrize("num_rows, num_candidates", [(SPECIAL_ROWS, 5), (12, 1), (3, 256),
                                                      (0, 4)])
def test_one_rank_without_a_group(num_rows: int, num_candidates: int) -> None:
    values, indices = candidates(0, 1, num_rows, num_candidates, seed=num_rows)
    got = tp_argmax(values, indices)
    assert got.dtype == torch.int64 and got.shape == (num_rows,)
    assert got.tolist() == reference([values], [indices])
    # Into a view of a bigger static buffer, left alone outside the view.
    static = torch.full((num_rows + 4,), -7, dtype=torch.int64)
    out = static[2:2 + num_rows]
    assert tp_argmax(values, indices, out) is out
    assert out.tolist() == got.tolist()
    assert static[:2].tolist() == [-7, -7] and static[2 + num_rows:].tolist() == [-7, -7]


def _gloo_rank(rank: int, world_size: int) -> list[list[int]]:
    """One gloo rank: several calls, each against the reference over all ranks' inputs."""
    answers = []
    for seed, (num_rows, num_candidates) in enumerate([(SPECIAL_ROWS, 4), (SPECIAL_ROWS + 9, 38),
                                                       (1, 1), (2, 256)]):
        values, indices = candidates(rank, world_size, num_rows, num_candidates, seed)
        got = tp_argmax(values, indices)
        want = expected(world_size, num_rows, num_candidates, seed)
        assert got.tolist() == want, (rank, seed, got.tolist(), want)
        answers.append(got.tolist())
    return answers


@pytest.mark.slow
def test_two_gloo_ranks() -> None:
    answers = launch(_gloo_rank, 2, backend="gloo")  # raises if any rank's check failed
    assert answers is not None and len(answers) == 4
