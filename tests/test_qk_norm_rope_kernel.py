"""The fused q_norm/k_norm/rotary/store_kv kernel (models/kernels/qk_norm_rope.py) on CPU,
under TRITON_INTERPRET=1.

The interpreter must be on before triton is first imported, so the checks run this file as
a script in a fresh subprocess (tests/interpret.py). Reference: the unfused torch path on the
same inputs — `rms_norm`, `apply_rotary` with RotaryEmbedding's cos/sin cache, and
`TorchAttentionBackend().store_kv` into a copy of the cache. Caches (and a guard slot on
either side of them) start as NaN, so a missed, stray or skipped-slot write fails.
"""

from __future__ import annotations

import importlib.util
import math
from dataclasses import dataclass, replace

import pytest
import torch

from tests.interpret import (
    interpreted_check_test,
    round_bf16_like_the_gpu,
    run_checks,
)

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                reason="triton is not installed")

# Max abs error relative to the reference's max abs value.
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 1e-2}
EPS = 1e-6
MAX_POSITION = 4096
ROPE_THETA = 1e6  # Qwen3's


@dataclass(frozen=True)
class Case:
    dtype: torch.dtype
    num_tokens: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int = 16
    rotary_dim: int | None = None  # None: head_dim
    strided: bool = False  # qkv is a column slice of a wider tensor (row stride > width)
    skip_every: int = 5  # every skip_every-th token (from the 2nd) gets slot -1; 0: none
    heads_per_program: int | None = None  # None: the launcher's choice for num_tokens


@dataclass
class Inputs:
    qkv: torch.Tensor  # [T, (H + 2 * Hkv) * D]
    positions: torch.Tensor  # [T] int64, unsorted
    cos_sin_cache: torch.Tensor  # [MAX_POSITION, rotary_dim] float32
    q_weight: torch.Tensor  # [D]
    k_weight: torch.Tensor  # [D]
    slot_mapping: torch.Tensor  # [T] int64
    storage: torch.Tensor  # flat NaN buffer: guard slot | kv_cache | guard slot
    kv_cache: torch.Tensor  # [2, num_blocks, block_size, Hkv, D], a view into storage


def make_inputs(case: Case, gen: torch.Generator, device: str = "cpu") -> Inputs:
    from models.layers.rotary import RotaryEmbedding

    t, h, hkv, d = case.num_tokens, case.num_heads, case.num_kv_heads, case.head_dim
    width = (h + 2 * hkv) * d
    if case.strided:
        wide = torch.randn(t, width + 48, generator=gen) * 2
        qkv = wide.to(case.dtype).to(device)[:, 16:16 + width]
        assert qkv.stride(0) == width + 48
    else:
        qkv = (torch.randn(t, width, generator=gen) * 2).to(case.dtype).to(device)
    positions = torch.randperm(MAX_POSITION, generator=gen)[:t].to(device)
    rope = RotaryEmbedding(d, MAX_POSITION, ROPE_THETA, case.rotary_dim).to(device)
    # Weights far from 1, and different for q and k, so a mixed-up weight index shows.
    q_weight = (1 + 0.5 * torch.randn(d, generator=gen)).to(case.dtype).to(device)
    k_weight = (1 + 0.5 * torch.randn(d, generator=gen)).to(case.dtype).to(device)
    num_blocks = -(-2 * t // case.block_size) + 1
    num_slots = num_blocks * case.block_size
    slots = torch.randperm(num_slots, generator=gen)[:t]
    if case.skip_every:
        slots[1::case.skip_every] = -1
    guard = hkv * d  # one slot: what slot -1 of kv_cache[0] / kv_cache[1] would hit
    storage = torch.full((2 * num_slots * hkv * d + 2 * guard,), float("nan"),
                         dtype=case.dtype, device=device)
    kv_cache = storage[guard:-guard].view(2, num_blocks, case.block_size, hkv, d)
    return Inputs(qkv, positions, rope.cos_sin_cache, q_weight, k_weight, slots.to(device),
                  storage, kv_cache)


def clone_inputs(x: Inputs) -> Inputs:
    """Same inputs with a fresh copy of the cache storage (one for the kernel, one for the
    reference)."""
    storage = x.storage.clone()
    guard = x.kv_cache.shape[3] * x.kv_cache.shape[4]
    return Inputs(x.qkv, x.positions, x.cos_sin_cache, x.q_weight, x.k_weight, x.slot_mapping,
                  storage, storage[guard:-guard].view(x.kv_cache.shape))


def reference(case: Case, x: Inputs) -> torch.Tensor:
    """The unfused torch path; writes x.kv_cache, returns q [T, H, D]."""
    from models.backends.torch_backend import TorchAttentionBackend
    from models.layers.layernorm import rms_norm
    from models.layers.rotary import apply_rotary

    h, hkv, d = case.num_heads, case.num_kv_heads, case.head_dim
    q, k, v = x.qkv.split([h * d, hkv * d, hkv * d], dim=-1)
    q = rms_norm(q.reshape(-1, h, d), x.q_weight, EPS)
    k = rms_norm(k.reshape(-1, hkv, d), x.k_weight, EPS)
    q, k = apply_rotary(x.positions, q, k, x.cos_sin_cache, case.rotary_dim or d)
    TorchAttentionBackend().store_kv(k, v.reshape(-1, hkv, d), x.kv_cache, x.slot_mapping)
    return q


def run_kernel(case: Case, x: Inputs, out: torch.Tensor | None = None) -> torch.Tensor:
    from models.kernels.qk_norm_rope import qk_norm_rope_store

    return qk_norm_rope_store(x.qkv, x.positions, x.cos_sin_cache, x.q_weight, x.k_weight, EPS,
                              x.kv_cache[0], x.kv_cache[1], x.slot_mapping, case.num_heads,
                              case.num_kv_heads, case.head_dim, case.rotary_dim or case.head_dim,
                              out=out, heads_per_program=case.heads_per_program)


def assert_close(got: torch.Tensor, want: torch.Tensor, tol: float, what: str) -> None:
    """Same shape, dtype and NaN positions; finite values within tol of the value scale."""
    assert got.shape == want.shape and got.dtype == want.dtype, (what, got.shape, want.shape)
    nan_got, nan_want = got.isnan(), want.isnan()
    assert torch.equal(nan_got, nan_want), (
        f"{what}: NaN at {(nan_got != nan_want).nonzero().flatten().tolist()[:10]} differs "
        f"(got {int(nan_got.sum())} NaN, want {int(nan_want.sum())})")
    g, w = got[~nan_want].double(), want[~nan_want].double()
    if w.numel() == 0:
        return
    err = (g - w).abs().max().item() / max(w.abs().max().item(), 1e-30)
    assert err < tol, f"{what}: relative max error {err:.3g} >= {tol}"


def check_case(case: Case, gen: torch.Generator, device: str = "cpu") -> None:
    """Kernel vs reference on one case: q, the whole cache storage (guards included), and v
    bit for bit (it is only copied). q goes into a NaN buffer, so a head never written shows."""
    x = make_inputs(case, gen, device)
    ref = clone_inputs(x)
    want_q = reference(case, ref)
    out = torch.full((case.num_tokens, case.num_heads, case.head_dim), float("nan"),
                     dtype=case.dtype, device=device)
    got_q = run_kernel(case, x, out=out)
    assert got_q.shape == (case.num_tokens, case.num_heads, case.head_dim)
    tol = TOL[case.dtype]
    assert_close(got_q, want_q, tol, f"{case} q")
    assert_close(x.storage, ref.storage, tol, f"{case} cache")
    got_v, want_v = x.kv_cache[1], ref.kv_cache[1]
    assert torch.equal(got_v.nan_to_num(7.0), want_v.nan_to_num(7.0)), f"{case} v not exact"
    stored = int((x.slot_mapping >= 0).sum())
    assert int((~ref.kv_cache[0].isnan()).sum()) == stored * case.num_kv_heads * case.head_dim


# --------------------------------------------------------------------------- the cases

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
CASES = {
    "float32": [
        Case(F32, 1, 16, 8, 128, skip_every=0),
        Case(F32, 37, 8, 2, 64, block_size=1, strided=True),
        Case(F32, 3, 6, 3, 128),
        Case(F32, 3, 4, 4, 64, block_size=1),
    ],
    "bfloat16": [
        Case(BF16, 1, 16, 8, 128, block_size=1, skip_every=0),
        Case(BF16, 3, 4, 4, 64, strided=True),
        Case(BF16, 37, 6, 3, 64),
        Case(BF16, 3, 8, 2, 128, block_size=1),
    ],
    "float16": [Case(F16, 3, 8, 2, 64, strided=True)],
    # rotary_dim 96: half = 48 is not a power of two.
    "rotary_dim": [Case(F32, 3, 4, 4, 64, rotary_dim=32),
                   Case(BF16, 3, 8, 2, 128, block_size=1, rotary_dim=96, strided=True)],
}
CHECKS = [*CASES, "large_batch", "skipped_slots", "out_buffer", "validation"]


def with_head_blocks(case: Case) -> list[Case]:
    """The case as given, then with every multi-head block size its layout allows (powers of
    two up to 8 dividing both head counts), so both kernel paths see the same layouts."""
    common = math.gcd(case.num_heads, case.num_kv_heads)
    return [case] + [replace(case, heads_per_program=h) for h in (2, 4, 8) if common % h == 0]


test_qk_norm_rope_kernel_check_interpreted = interpreted_check_test(__file__, CHECKS)


def test_heads_per_program_choice() -> None:
    """One head a program for small grids; from HEAD_BLOCK_MIN_PROGRAMS one-head programs on
    a power of two <= 8 that divides both head counts (a block must be all q or all kv
    heads), as large as that allows."""
    from models.kernels.qk_norm_rope import HEAD_BLOCK_MIN_PROGRAMS, choose_heads_per_program

    layouts = [(16, 8), (32, 8), (16, 4), (8, 2), (4, 2), (6, 3), (12, 4), (64, 64), (40, 8)]
    for num_heads, num_kv_heads in layouts:
        first = -(-HEAD_BLOCK_MIN_PROGRAMS // (num_heads + num_kv_heads))  # smallest grouped T
        for num_tokens in (1, 2, 8, first - 1):
            assert choose_heads_per_program(num_tokens, num_heads, num_kv_heads) == 1
        divisors = [h for h in (1, 2, 4, 8)
                    if num_heads % h == 0 and num_kv_heads % h == 0]
        for num_tokens in (first, first + 1, 8192):
            chosen = choose_heads_per_program(num_tokens, num_heads, num_kv_heads)
            assert chosen == max(divisors), (num_tokens, num_heads, num_kv_heads)
    # The serving layouts: Qwen3-0.6B groups from 64 tokens, Qwen3-8B at TP=4 from 154.
    assert choose_heads_per_program(63, 16, 8) == 1 and choose_heads_per_program(64, 16, 8) == 8
    assert choose_heads_per_program(153, 8, 2) == 1 and choose_heads_per_program(154, 8, 2) == 2


# --------------------------------------------------------------------------- subprocess side


def _main() -> None:
    round_bf16_like_the_gpu()
    gen = torch.Generator().manual_seed(4321)

    def cases_check(name: str):
        def check() -> None:
            for case in CASES[name]:
                for variant in with_head_blocks(case):
                    check_case(variant, gen)
        return check

    def check_large_batch() -> None:
        # The first: past the threshold, so the launcher's own choice groups heads (4 here:
        # gcd(8, 4)); the second groups only in its explicit variants.
        for case in (Case(BF16, 128, 8, 4, 64, skip_every=3),
                     Case(F32, 64, 6, 2, 32, block_size=1, rotary_dim=16, strided=True)):
            for variant in with_head_blocks(case):
                check_case(variant, gen)

    def check_skipped_slots() -> None:
        # Every slot -1 (padding rows of a CUDA-graph batch): q is still computed, nothing at
        # all is written into the caches or their guards.
        for case in (Case(BF16, 1, 4, 4, 64), Case(F32, 3, 6, 3, 64, block_size=1),
                     Case(F32, 3, 8, 2, 64)):
            for variant in with_head_blocks(case):
                x = make_inputs(variant, gen)
                x.slot_mapping.fill_(-1)
                ref = clone_inputs(x)
                want_q = reference(variant, ref)
                assert_close(run_kernel(variant, x), want_q, TOL[case.dtype], f"{variant} q")
                assert x.storage.isnan().all(), f"{variant}: a skipped token was stored"

    def check_out_buffer() -> None:
        # A given `out` is written in place and returned; T = 0 is a no-op.
        for case in with_head_blocks(Case(BF16, 3, 8, 2, 64)):
            x = make_inputs(case, gen)
            ref = clone_inputs(x)
            want_q = reference(case, ref)
            out = torch.full((3, 8, 64), float("nan"), dtype=BF16)
            got = run_kernel(case, x, out=out)
            assert got is out
            assert_close(out, want_q, TOL[BF16], f"{case} out")
            assert_close(x.storage, ref.storage, TOL[BF16], f"{case} out cache")
            empty_case = replace(case, num_tokens=0)
            empty = make_inputs(empty_case, gen)
            got = run_kernel(empty_case, empty)
            assert got.shape == (0, 8, 64) and empty.storage.isnan().all()

    def check_validation() -> None:
        case = Case(F32, 2, 4, 2, 64)
        x = make_inputs(case, gen)
        bad = [
            dict(head_dim=48),  # not a power of two
            dict(num_heads=5),  # qkv width does not match
            dict(rotary_dim=33),  # odd
            dict(heads_per_program=3),  # not a power of two
            dict(heads_per_program=4),  # does not divide Hkv = 2 (a block would mix kinds)
            dict(heads_per_program=0),
        ]
        for override in bad:
            bad_case = Case(**{**case.__dict__, **override})
            with pytest.raises(AssertionError):
                run_kernel(bad_case, x)
        x.q_weight = x.q_weight.to(BF16)  # rms_norm would promote; the kernel refuses
        with pytest.raises(AssertionError):
            run_kernel(case, x)
        assert x.storage.isnan().all()

    checks = {name: cases_check(name) for name in CASES}
    checks.update(large_batch=check_large_batch, skipped_slots=check_skipped_slots,
                  out_buffer=check_out_buffer, validation=check_validation)
    run_checks([(name, checks[name]) for name in CHECKS])


if __name__ == "__main__":
    _main()
