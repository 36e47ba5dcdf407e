"""A row-parallel GEMV that pushes its partial sums into the fused all-reduce + RMSNorm
kernel's buffers (`gemv_push`, models/kernels/gemv.py), and that kernel taking them
(`all_reduce_add_rms_norm` of a PushedPartial), under TRITON_INTERPRET=1.

W processes whose data buffers are shared CPU memory that every process maps (what symmetric
memory is on GPUs) each run several layer-like calls in a row: pushed calls, an unpushed call
between them (both kinds share the rows' parities and call counts), fma and mma GEMV tiles,
a bias on rank 0, several rows. Every rank rebuilds all ranks' inputs from the seeds, so it
checks its answer against the plain GEMV's partials summed in rank order (the new residual
bit for bit) and then normalized. A bf16 case makes a GEMV output round to -0.0, the
kernel's EMPTY marker: it must still arrive (else the receiver would wait for it forever).
"""

from __future__ import annotations

import importlib.util
import os
import signal

import pytest
import torch

from tests.interpret import interpreted_check_test, round_bf16_like_the_gpu, run_checks

pytest_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                   reason="triton is not installed")
CHECKS = ["push_2_ranks_fp32", "push_4_ranks_fp32", "push_2_ranks_bf16_empty_values",
          "broken_push_is_caught"]
test_push_interpreted = pytest_triton(interpreted_check_test(__file__, CHECKS))

ROWS = 16  # call counts per row (the epochs array)
# A call that waits for a row that never comes fails after this long instead of hanging
# (the interpreter polls in Python, so a signal handler's exception stops it).
WAIT_LIMIT_S = 120
# (M rows, N = hidden, K, GEMV kind, bias on rank 0, pushed) of each call in order.
CALLS = [(1, 64, 48, "fma", True, True), (1, 64, 48, "fma", False, False),
         (3, 64, 40, "fma", False, True), (2, 64, 64, "mma", False, True),
         (1, 64, 48, "fma", False, True)]
# The call whose GEMV outputs get a planted -0.0 (pushed, no bias, so it stays -0.0).
PLANT_CALL = 4
# An mma tile for the (64, 64) shape, which the tuned table does not hold.
MMA_TILE = dict(block_n=32, block_k=32, kind="mma", num_stages=2)


def _give_up(signum: int, frame: object) -> None:
    raise TimeoutError("a call waited too long for a row that never came")


def _inputs(rank: int, call: int, m: int, n: int, k: int, dtype: torch.dtype,
            bias_on: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Rank `rank`'s (x [m, k], weight shard [n, k], bias [n] or None) for call `call`."""
    gen = torch.Generator().manual_seed(1000 * call + rank)
    x = torch.randn(m, k, generator=gen).to(dtype)
    weight = (torch.randn(n, k, generator=gen) / 8).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype) if bias_on and rank == 0 else None
    return x, weight, bias


def _shared(call: int, m: int, n: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(residual [m, n], norm weight [n]): the same on every rank."""
    gen = torch.Generator().manual_seed(99 + call)
    return (torch.randn(m, n, generator=gen).to(dtype),
            (1 + torch.randn(n, generator=gen) / 4).to(dtype))


def _plant_negative_zero(x: torch.Tensor, weight: torch.Tensor, rank: int) -> None:
    """Output column `rank` of row 0 becomes a float32 denormal that rounds to -0.0 in
    bf16 (-2^-140 against bf16's least denormal 2^-133)."""
    weight[rank].zero_()
    weight[rank, 0] = -(2.0 ** -70)
    x[0, 0] = 2.0 ** -70


def _rank_main(rank: int, world: int, buffers: list[torch.Tensor], dtype: torch.dtype,
               plant: bool) -> None:
    signal.signal(signal.SIGALRM, _give_up)
    signal.alarm(WAIT_LIMIT_S)
    if dtype == torch.bfloat16:
        round_bf16_like_the_gpu()
    from models.kernels import gemv as gemv_module
    from models.kernels.all_reduce_norm import EMPTY_WORD, NormBuffers, all_reduce_add_rms_norm
    from models.layers.layernorm import add_rms_norm

    gemv_module.TUNED[(64, 64, dtype.itemsize)] = gemv_module.GemvConfig(**MMA_TILE)
    data_ptrs = torch.tensor([b.data_ptr() for b in buffers], dtype=torch.int64)
    epochs = torch.zeros(ROWS, dtype=torch.int32)
    norm_buffers = NormBuffers(data_ptrs, buffers[0].numel(), epochs, rank, world)
    counts = torch.zeros(ROWS, dtype=torch.int32)
    for call, (m, n, k, kind, bias_on, pushed) in enumerate(CALLS):
        assert gemv_module.choose_config(n, k, dtype).kind == kind
        parts = []
        for src in range(world):
            x, weight, bias = _inputs(src, call, m, n, k, dtype, bias_on)
            if plant and call == PLANT_CALL:
                _plant_negative_zero(x, weight, src)
            parts.append(gemv_module.gemv(x, weight, bias))  # what src's partial is
            if src == rank:
                mine = (x, weight, bias)
        residual, norm_weight = _shared(call, m, n, dtype)
        source = gemv_module.gemv_push(*mine, norm_buffers) if pushed else parts[rank]
        out, new_residual = all_reduce_add_rms_norm(source, residual, norm_weight, 1e-6,
                                                    norm_buffers)
        total = parts[0].float()
        for part in parts[1:]:
            total = total + part.float()
        want_out, want_residual = add_rms_norm(total.to(dtype), residual, norm_weight, 1e-6)
        assert torch.equal(new_residual, want_residual), (rank, call, new_residual - want_residual)
        tol = 1e-5 if dtype == torch.float32 else 2 ** -7
        assert torch.allclose(out.float(), want_out.float(), rtol=tol, atol=tol), (rank, call)
        if plant and call == PLANT_CALL:  # the planted columns were sent as EMPTY's value
            for src, part in enumerate(parts):
                assert part[0, src].view(torch.int16).item() == EMPTY_WORD, (src, part[0, src])
        counts[:m] += 1
        assert torch.equal(epochs, counts), (rank, call, epochs.tolist())
    # Every call left this rank's slots empty again.
    assert torch.all(buffers[rank].view(torch.int16) == EMPTY_WORD)
    signal.alarm(0)


def _run_ranks(world: int, dtype: torch.dtype, plant: bool = False) -> None:
    import torch.multiprocessing as mp

    from models.kernels.all_reduce_norm import fill_empty_

    # Two parity halves of W ranks' slots for ROWS rows of the widest hidden size.
    buffers = [torch.empty(2 * world * ROWS * 64 * 4, dtype=torch.uint8).share_memory_()
               for _ in range(world)]
    for buffer in buffers:
        fill_empty_(buffer)
    mp.spawn(_rank_main, args=(world, buffers, dtype, plant), nprocs=world, join=True)


def _broken_push_is_caught() -> None:
    """Rank 0 of 2 with its peer played by hand: a peer that pushed its row into the wrong
    parity half is never taken, and the call gives up instead of summing garbage."""
    from models.kernels.all_reduce_norm import NormBuffers, all_reduce_add_rms_norm, fill_empty_
    from models.kernels.gemv import gemv, gemv_push

    world, n, k = 2, 64, 48
    buffers = [torch.empty(2 * world * ROWS * n * 4, dtype=torch.uint8) for _ in range(world)]
    for buffer in buffers:
        fill_empty_(buffer)
    data_ptrs = torch.tensor([b.data_ptr() for b in buffers], dtype=torch.int64)
    norm_buffers = NormBuffers(data_ptrs, buffers[0].numel(), torch.zeros(ROWS, dtype=torch.int32),
                               0, world)
    x, weight, _ = _inputs(1, 0, 1, n, k, torch.float32, False)
    rows = norm_buffers.rows(n, 4)
    slots = buffers[0].view(torch.float32).view(2, world, -1, n)[:, :, :rows]
    slots[1, 1, 0] = gemv(x, weight)[0]  # half 1: the call after this one
    mine = _inputs(0, 0, 1, n, k, torch.float32, False)
    residual, norm_weight = _shared(0, 1, n, torch.float32)
    pushed = gemv_push(mine[0], mine[1], None, norm_buffers)  # before the clock: it returns
    signal.signal(signal.SIGALRM, _give_up)
    signal.alarm(3)
    try:
        all_reduce_add_rms_norm(pushed, residual, norm_weight, 1e-6, norm_buffers)
    except Exception as e:  # the interpreter wraps the TimeoutError in its own error
        assert "TimeoutError" in repr(e), e
    else:
        raise AssertionError("a row in the wrong half was taken")
    finally:
        signal.alarm(0)
    # Rank 0's own push landed in half 0 of both buffers, at its own source slot.
    sent = buffers[1].view(torch.float32).view(2, world, -1, n)[0, 0, 0]
    assert torch.equal(sent, gemv(mine[0], mine[1])[0])


def _main() -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1"
    run_checks([("push_2_ranks_fp32", lambda: _run_ranks(2, torch.float32)),
                ("push_4_ranks_fp32", lambda: _run_ranks(4, torch.float32)),
                ("push_2_ranks_bf16_empty_values",
                 lambda: _run_ranks(2, torch.bfloat16, plant=True)),
                ("broken_push_is_caught", _broken_push_is_caught)])


if __name__ == "__main__":
    _main()
