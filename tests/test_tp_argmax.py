"""`models.parallel.tp_argmax`, the vocab-parallel sampler's cross-rank argmax, on CPU.

- torch path: one process without a process group, and two gloo ranks (all-gathers);
- the symmetric-memory kernel (models/kernels/tp_argmax.py) under TRITON_INTERPRET=1: W
  processes whose word buffers are shared CPU memory that every process maps (what symmetric
  memory is on GPUs), several calls in a row (both parities, per-row call counts), every
  rank polling its peers' words for real.

Every rank's candidates come from (seed, rank), so each rank rebuilds all ranks' inputs and
checks its answer against a plain-Python reference over all of them: the largest value, the
lowest index among equal values, NaN / -inf / NO_INDEX never win, 0 when nothing is left.
"""

from __future__ import annotations

import importlib.util
import math
import os
import signal
import struct

import pytest
import torch

from models.parallel import NO_INDEX, tp_argmax
from tests.interpret import interpreted_check_test, run_checks

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
        # rank wins. The NaNs are all ones, the bits of the kernel's EMPTY half-word: never
        # to be sent as a value.
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


def packed_words(values: torch.Tensor, indices: torch.Tensor) -> list[int]:
    """Per row, the int64 word a rank sends: its best value's float32 bits high, the index
    low."""
    words = []
    for row in range(values.shape[0]):
        value, index = best_pair(list(zip(values[row].tolist(), indices[row].tolist(),
                                          strict=True)))
        bits = struct.unpack("<I", struct.pack("<f", value))[0]
        word = bits << 32 | index
        words.append(word - (1 << 64) if word >= 1 << 63 else word)
    return words


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
    from benchmarks.allreduce_bench import launch

    answers = launch(_gloo_rank, 2, backend="gloo")  # raises if any rank's check failed
    assert answers is not None and len(answers) == 4


# --------------------------------------------------------------------------- the kernel

pytest_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                   reason="triton is not installed")
KERNEL_CHECKS = ["kernel_protocol", "kernel_2_ranks", "kernel_3_ranks"]
test_kernel_interpreted = pytest_triton(interpreted_check_test(__file__, KERNEL_CHECKS))

ROWS = 16  # rows per parity and rank in the word buffers
# A kernel that waits for a word that never comes (a broken protocol) fails the check after
# this long instead of hanging: the interpreter polls in Python, so a signal handler's
# exception stops it. A correct run takes seconds.
WAIT_LIMIT_S = 90
# (B, S) of each call in order: row counts that differ move some rows' parities apart. At
# S = 256 no padding lane holds -inf: rank 0's row 1 is then NaN only.
CALLS = [(SPECIAL_ROWS + 3, 5), (SPECIAL_ROWS + 3, 5), (3, 1), (1, 256), (2, 256),
         (SPECIAL_ROWS, 38), (SPECIAL_ROWS + 3, 2)]


def _give_up(signum: int, frame: object) -> None:
    raise TimeoutError(f"a kernel call waited {WAIT_LIMIT_S} s for a word that never came")


def _wait_limit(seconds: int) -> None:
    """From now on, raise TimeoutError after `seconds` (0: never)."""
    signal.signal(signal.SIGALRM, _give_up)
    signal.alarm(seconds)


def _kernel_rank(rank: int, world: int, buffers: list[torch.Tensor]) -> None:
    """One rank under the interpreter; buffers: every rank's word buffer, shared memory."""
    _wait_limit(WAIT_LIMIT_S)
    from models.kernels.tp_argmax import EMPTY_WORD, tp_argmax_

    data_ptrs = torch.tensor([b.data_ptr() for b in buffers], dtype=torch.int64)
    epochs = torch.zeros(ROWS, dtype=torch.int32)
    calls = torch.zeros(ROWS, dtype=torch.int32)
    for seed, (num_rows, num_candidates) in enumerate(CALLS):
        values, indices = candidates(rank, world, num_rows, num_candidates, seed)
        if seed == 1:  # candidates a row stride apart that is not S
            wide = torch.full((num_rows, 2 * num_candidates + 3), math.nan)
            wide[:, :num_candidates] = values
            values = wide[:, :num_candidates]
        static = torch.full((num_rows + 2,), -7, dtype=torch.int64)
        out = static[1:1 + num_rows]
        got = tp_argmax_(values, indices, out, data_ptrs=data_ptrs, epochs=epochs, rank=rank,
                         world_size=world, rows=ROWS)
        want = expected(world, num_rows, num_candidates, seed)
        assert got is out and got.tolist() == want, (rank, seed, got.tolist(), want)
        assert static[0].item() == static[-1].item() == -7
        calls[:num_rows] += 1
        assert torch.equal(epochs, calls), (epochs.tolist(), calls.tolist())
    # Every call left this rank's slots empty again.
    assert torch.all(buffers[rank] == EMPTY_WORD), (buffers[rank] != EMPTY_WORD).nonzero()


def _check_protocol() -> None:
    """Rank 0 of 2 in this process, its peer played by hand: the peer already wrote its
    words of two calls (a fast peer may be a call ahead), one per parity half. Each call
    must take the words of its own half only, answer as the reference, leave that half
    empty, and deliver rank 0's word in the agreed format to the peer's buffer."""
    from models.kernels.tp_argmax import EMPTY_WORD, fill_empty_words_, tp_argmax_

    _wait_limit(WAIT_LIMIT_S)
    world, num_rows, num_candidates = 2, SPECIAL_ROWS + 2, 4
    buffers = [torch.empty(2, world, ROWS, dtype=torch.int64) for _ in range(world)]
    for buffer in buffers:
        fill_empty_words_(buffer)
    data_ptrs = torch.tensor([b.data_ptr() for b in buffers], dtype=torch.int64)
    epochs = torch.zeros(ROWS, dtype=torch.int32)
    calls = [[candidates(rank, world, num_rows, num_candidates, seed) for rank in range(world)]
             for seed in (10, 11)]
    for parity, (_, peer) in enumerate(calls):
        buffers[0][parity, 1, :num_rows] = torch.tensor(packed_words(*peer))
    for parity, parts in enumerate(calls):
        got = tp_argmax_(*parts[0], torch.empty(num_rows, dtype=torch.int64),
                         data_ptrs=data_ptrs, epochs=epochs, rank=0, world_size=world,
                         rows=ROWS)
        want = reference([v for v, _ in parts], [i for _, i in parts])
        assert got.tolist() == want, (parity, got.tolist(), want)
        assert torch.all(buffers[0][parity] == EMPTY_WORD), parity
        sent = buffers[1][parity, 0, :num_rows].tolist()
        assert sent == packed_words(*parts[0]), (parity, sent)
        assert torch.all(buffers[1][parity, 0, num_rows:] == EMPTY_WORD), parity
        assert torch.all(buffers[1][parity, 1] == EMPTY_WORD), parity
    assert epochs[:num_rows].tolist() == [2] * num_rows and not epochs[num_rows:].any()
    _wait_limit(0)


def _run_kernel_ranks(world: int) -> None:
    import torch.multiprocessing as mp

    from models.kernels.tp_argmax import fill_empty_words_

    buffers = [torch.empty(2 * world * ROWS, dtype=torch.int64).share_memory_()
               for _ in range(world)]
    for buffer in buffers:
        fill_empty_words_(buffer)
    assert all(torch.all(b == -1) for b in buffers)
    mp.spawn(_kernel_rank, args=(world, buffers), nprocs=world, join=True)


def _main() -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1"
    run_checks([("kernel_protocol", _check_protocol),
                ("kernel_2_ranks", lambda: _run_kernel_ranks(2)),
                ("kernel_3_ranks", lambda: _run_kernel_ranks(3))])


if __name__ == "__main__":
    _main()
