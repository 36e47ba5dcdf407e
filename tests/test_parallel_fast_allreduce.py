"""The fast all-reduce's CPU-checkable parts: which messages it takes and with which
algorithm, and its fail-safe set-up (gloo, two ranks): on CPU it stays out of the way; where
symmetric memory cannot start, every rank logs one warning and sums (and takes the
cross-rank argmax) through the process group as before. The sums themselves on GPUs:
tests/gpu/test_allreduce_gpu.py; the argmax: tests/test_tp_argmax.py."""

from __future__ import annotations

import logging
import os

import pytest
import torch

from models.parallel import (
    DEFAULT_FAST_ALL_REDUCE_BYTES,
    NCCL,
    NO_MULTICAST_ENV,
    ONE_SHOT,
    TWO_SHOT,
    SymmMemAllReduce,
    _all_ranks_agree,
    choose_algorithm,
    close_fast_all_reduce,
    default_one_shot_max_bytes,
    init_fast_all_reduce,
    tp_all_reduce,
    tp_argmax,
)
from tests.ranks import launch
from tests.test_tp_argmax import SPECIAL_ROWS, candidates
from tests.test_tp_argmax import expected as expected_argmax

MiB = 1 << 20
BF16, FP32 = torch.bfloat16, torch.float32


@pytest.mark.parametrize("dtype, nbytes, max_bytes, one_shot_max, expected", [
    (BF16, 1 * 4096 * 2, 8 * MiB, 8 * MiB, ONE_SHOT),        # decode, batch 1
    (BF16, 512 * 8192 * 2, 8 * MiB, 8 * MiB, ONE_SHOT),      # exactly the buffer
    (BF16, 512 * 8192 * 2 + 16, 8 * MiB, 8 * MiB, NCCL),     # one vector more
    (FP32, 8 * 4096 * 4, 8 * MiB, 8 * MiB, ONE_SHOT),
    (torch.float16, 8 * 4096 * 2, 8 * MiB, 8 * MiB, NCCL),  # no fp16 kernels in symm_mem
    (BF16, 3 * 1001 * 2, 8 * MiB, 8 * MiB, NCCL),           # not a whole number of vectors
    (BF16, 64 * 4096 * 2, 8 * MiB, 256 * 1024, TWO_SHOT),   # 512 KiB over the cut-off
    (BF16, 32 * 4096 * 2, 8 * MiB, 256 * 1024, ONE_SHOT),   # 256 KiB, at the cut-off
    (BF16, 16, 8 * MiB, 0, TWO_SHOT),                        # two-shot forced
])
def test_choose_algorithm(dtype, nbytes, max_bytes, one_shot_max, expected):
    assert choose_algorithm(dtype, nbytes, max_bytes, one_shot_max) == expected


def test_one_shot_cut_off_by_world_size():
    # Two ranks: one-shot for everything the buffer holds; more ranks switch to two-shot.
    assert default_one_shot_max_bytes(2, 8 * MiB) == 8 * MiB
    assert default_one_shot_max_bytes(4, 8 * MiB) == 512 * 1024
    assert default_one_shot_max_bytes(8, 8 * MiB) == 256 * 1024
    assert default_one_shot_max_bytes(8, 64 * 1024) == 64 * 1024
    # The default buffer covers the largest decode batch of the widest model: [512, 8192].
    assert DEFAULT_FAST_ALL_REDUCE_BYTES >= 512 * 8192 * 2


@pytest.mark.parametrize("max_bytes", [0, -16, 1000])
def test_buffer_size_must_hold_whole_vectors(max_bytes):
    with pytest.raises(ValueError, match="multiple of 16"):
        SymmMemAllReduce(torch.device("cuda"), max_bytes)


def test_one_process_is_the_identity():
    # No process group: this process is rank 0 of 1 and nothing is set up.
    assert not init_fast_all_reduce(torch.device("cuda"))
    x = torch.arange(6.0)
    assert tp_all_reduce(x) is x
    assert x.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _gloo_rank(rank: int, world_size: int) -> list[str]:
    """Runs in each of the two gloo ranks; returns the warnings `models.parallel` logged."""
    records = _Records()
    logging.getLogger("models.parallel").addHandler(records)
    expected = float(sum(range(1, world_size + 1)))  # rank r contributes r + 1

    # CPU: nothing to set up, nothing to warn about; gloo sums.
    assert not init_fast_all_reduce(torch.device("cpu"))
    x = torch.full((3, 5), rank + 1.0)
    assert tp_all_reduce(x) is x
    assert torch.all(x == expected)
    assert records.messages == []

    # CUDA asked for where symmetric memory cannot start (this torch has no CUDA): every
    # rank logs one warning, the multicast switches are still defaulted off, and the sums
    # go through the process group.
    for name in NO_MULTICAST_ENV:
        os.environ.pop(name, None)
    assert not init_fast_all_reduce(torch.device("cuda"))
    assert len(records.messages) == 1, records.messages
    assert "fast all-reduce off" in records.messages[0]
    assert {name: os.environ.get(name) for name in NO_MULTICAST_ENV} == NO_MULTICAST_ENV
    y = torch.full((4,), rank + 1.0, dtype=torch.bfloat16)
    assert torch.all(tp_all_reduce(y) == expected)
    # So does the cross-rank argmax (the vocab-parallel sampler's exchange).
    values, indices = candidates(rank, world_size, SPECIAL_ROWS, 4, seed=3)
    assert tp_argmax(values, indices).tolist() == expected_argmax(world_size, SPECIAL_ROWS, 4, 3)

    # The ranks go ahead only together, and only with the same rendezvous history.
    assert _all_ranks_agree(True, 3)
    assert not _all_ranks_agree(rank == 0, 3)
    assert not _all_ranks_agree(True, rank)
    close_fast_all_reduce()
    close_fast_all_reduce()  # idempotent
    return records.messages


@pytest.mark.slow
def test_fail_safe_on_gloo():
    messages = launch(_gloo_rank, 2, backend="gloo")
    assert messages is not None and len(messages) == 1
