"""paged_attention's fused decode mode (`qk_norm_rope=`) on CPU, under TRITON_INTERPRET=1.

The fused launch norms and rotates q and the step's k, stores k/v into the paged cache and
attends, in one kernel. It must give what `qk_norm_rope_store` followed by the plain launch
gives, bit for bit: the output of every real row and the whole cache storage (guard slots
on either side included), which starts as NaN so a stray or missing store shows. (Under the
interpreter both kernels reduce with numpy, so the bits agree; on a GPU their norm sums may
add in different orders, which tests/gpu/test_triton_attention.py allows for.) A row whose
slot is -1 stores nothing (its cache slot stays NaN) and reads that slot back like the
two-launch path (here: NaN out for both).
The padding row at the end of each batch (seq_len 0, slot -1, as CUDA-graph batches pad)
has unspecified output and stores nothing.

Checks run this file as a script in a fresh subprocess (tests/interpret.py); the host-side
argument checks run in the pytest process.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import pytest
import torch

from models.attention_metadata import AttentionMetadata, make_attention_metadata
from tests.helpers import assert_same_bits
from tests.interpret import interpreted_check_test, round_bf16_like_the_gpu, run_checks
from tests.test_qk_norm_rope_kernel import (
    EPS,
    TOL,
    Case,
    Inputs,
    assert_close,
    clone_inputs,
    make_inputs,
    reference,
    run_kernel,
)

if TYPE_CHECKING:  # triton: imported by the checks only, after the interpreter is set
    from models.kernels.paged_attention import AttentionLaunch

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                reason="triton is not installed")

F32, BF16 = torch.float32, torch.bfloat16
# Cached tokens per decode row: none, one, fewer than a key tile (16), a key tile exactly
# (the new key opens the next tile, alone in the last partition of a 2- or 4-way split),
# one short of it, and several blocks.
CACHED = [9, 0, 70, 16, 1, 37, 15]
SKIPPED = [2, 4]  # rows whose slot is -1: the 70-token row (several partitions) and a short one
# (heads, kv heads, head_dim): the interpreter tests' layouts, Qwen3-8B at TP=4, and a GQA
# group of 3 (padded to 4 rows a token).
LAYOUTS = [(4, 2, 32), (4, 1, 16), (8, 2, 128), (3, 1, 32)]
REF_TOL = {F32: 1e-4, BF16: 2e-2}  # per-row relative error vs float64 attention


@dataclass
class DecodeBatch:
    case: Case
    x: Inputs  # qkv, positions, weights, slot_mapping (with SKIPPED at -1), NaN cache
    full_slots: torch.Tensor  # [B] int64: every real row's slot (only the padding row -1)
    meta: AttentionMetadata  # decode_only; slot_mapping is x.slot_mapping
    num_real: int  # rows 0..num_real-1 are real; a padding row may follow

    @property
    def scale(self) -> float:
        return self.case.head_dim ** -0.5


def make_decode_batch(dtype: torch.dtype, layout: tuple[int, int, int], block_size: int,
                      gen: torch.Generator, cached: list[int] = CACHED,
                      skipped: list[int] = SKIPPED, rotary_dim: int | None = None,
                      strided: bool = False, pad: bool = True) -> DecodeBatch:
    """One decode token per row after `cached[i]` cached tokens (random K/V, NaN elsewhere
    in the cache), then (pad) a padding row: seq_len 0, slot -1. Blocks are shuffled over
    the cache; the storage has a NaN guard slot on either side (as make_inputs builds)."""
    heads, kv_heads, dim = layout
    num_seqs = len(cached) + pad
    case = Case(dtype, num_seqs, heads, kv_heads, dim, block_size=block_size,
                rotary_dim=rotary_dim, strided=strided, skip_every=0)
    x = make_inputs(case, gen)  # qkv, positions (random: the kernel must read them), weights
    lens = [c + 1 for c in cached] + [1] * pad  # the padding row's is set to 0 below
    need = [-(-n // block_size) for n in lens]
    num_blocks = sum(need) + 2
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables = [perm[sum(need[:i]):sum(need[:i + 1])] for i in range(num_seqs)]
    guard = kv_heads * dim
    storage = torch.full((2 * num_blocks * block_size * kv_heads * dim + 2 * guard,),
                         float("nan"), dtype=dtype)
    kv_cache = storage[guard:-guard].view(2, num_blocks, block_size, kv_heads, dim)
    flat = kv_cache.view(2, -1, kv_heads, dim)
    for row, num_cached in enumerate(cached):
        pos = torch.arange(num_cached)
        slots = torch.tensor(tables[row], dtype=torch.int64)[pos // block_size] * block_size
        flat[:, slots + pos % block_size] = torch.randn(
            2, num_cached, kv_heads, dim, generator=gen).to(dtype)
    meta = make_attention_metadata([1] * num_seqs, lens, tables, block_size)
    assert meta.decode_only
    full_slots = meta.slot_mapping.clone()
    if pad:
        meta.seq_lens[-1] = 0
        full_slots[-1] = -1
    slots = full_slots.clone()
    slots[skipped] = -1
    meta.slot_mapping = slots
    return DecodeBatch(case, replace(x, slot_mapping=slots, storage=storage, kv_cache=kv_cache),
                       full_slots, meta, len(cached))


def with_slots(x: Inputs, slots: torch.Tensor) -> Inputs:
    """A copy of x (fresh cache storage) that stores at `slots`."""
    return replace(clone_inputs(x), slot_mapping=slots)


def raw_qkv(b: DecodeBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [T, H, D], k and v [T, Hkv, D]: strided views of the step's qkv, as the model has."""
    c = b.case
    t, h, hkv, d = c.num_tokens, c.num_heads, c.num_kv_heads, c.head_dim
    q, k, v = b.x.qkv.split([h * d, hkv * d, hkv * d], dim=-1)
    return q.view(t, h, d), k.view(t, hkv, d), v.view(t, hkv, d)


def run_unfused(b: DecodeBatch, x: Inputs, q: torch.Tensor,
                launch: AttentionLaunch) -> torch.Tensor:
    from models.kernels.paged_attention import paged_attention

    out = torch.full_like(q, float("nan"))
    m = b.meta
    return paged_attention(q, x.kv_cache[0], x.kv_cache[1], m.cu_seqlens_q, m.seq_lens,
                           m.block_tables, b.scale, launch, out=out)


def run_fused(b: DecodeBatch, x: Inputs, launch: AttentionLaunch) -> torch.Tensor:
    """The fused launch on x's cache (stores into it)."""
    from models.kernels.paged_attention import paged_attention
    from models.kernels.qk_norm_rope import QKNormRope

    q, k, v = raw_qkv(b)
    fused = QKNormRope(key=k, value=v, positions=x.positions, slot_mapping=x.slot_mapping,
                       cos_sin_cache=x.cos_sin_cache, q_weight=x.q_weight,
                       k_weight=x.k_weight, eps=EPS,
                       rotary_dim=b.case.rotary_dim or b.case.head_dim)
    out = torch.full(q.shape, float("nan"), dtype=q.dtype)
    m = b.meta
    return paged_attention(q, x.kv_cache[0], x.kv_cache[1], m.cu_seqlens_q, m.seq_lens,
                           m.block_tables, b.scale, launch, out=out, qk_norm_rope=fused)


def decode_launches(layout: tuple[int, int, int]) -> list[AttentionLaunch]:
    """Unsplit, split 2 (with partitions of >= 16 keys, so short rows take one and a
    17-key row puts its new key alone in the second), split 4, and split 4 as the
    small-decode prefetch launch (8 warps)."""
    from models.kernels.paged_attention import AttentionLaunch, _block_qs, _group_pad

    heads, kv_heads, _ = layout
    block_q, _ = _block_qs(_group_pad(heads // kv_heads))
    return [AttentionLaunch(block_q=block_q, block_n=16, num_splits=1),
            AttentionLaunch(block_q=block_q, block_n=16, num_splits=2, min_split_len=16),
            AttentionLaunch(block_q=block_q, block_n=16, num_splits=4),
            AttentionLaunch(block_q=block_q, block_n=16, num_splits=4, prefetch_kv=True,
                            num_warps=8)]


def check_matches_unfused(b: DecodeBatch, launches: list[AttentionLaunch]) -> None:
    """Fused vs qk_norm_rope_store + paged_attention on the same launch, bit for bit."""
    # Unfused as given (SKIPPED rows not stored): the cache and output the fused launch
    # must give.
    skipped = clone_inputs(b.x)
    q = run_kernel(b.case, skipped)
    kv = b.case.num_kv_heads * b.case.head_dim
    stored = with_slots(b.x, b.full_slots)
    run_kernel(b.case, stored)
    not_stored = b.full_slots[(b.x.slot_mapping < 0) & (b.full_slots >= 0)]
    for slot in not_stored.tolist():  # the test can see a skipped row written
        assert skipped.kv_cache.view(2, -1, kv)[:, slot].isnan().all()
        assert not stored.kv_cache.view(2, -1, kv)[:, slot].isnan().any()
    real = b.x.slot_mapping[:b.num_real] >= 0  # [num_real]: rows whose new key is stored
    assert real.any() and not real.all()
    for launch in launches:
        what = f"{b.case} {launch}"
        want = run_unfused(b, skipped, q, launch)[:b.num_real]
        assert not want[real].isnan().any(), f"{what}: unfused output has NaN"
        x = clone_inputs(b.x)
        got = run_fused(b, x, launch)[:b.num_real]
        assert_same_bits(got[real], want[real], f"{what} output")
        # A skipped row reads its own unwritten (NaN) key, fused or not.
        assert got[~real].isnan().all() and want[~real].isnan().all(), what
        assert_same_bits(x.storage, skipped.storage, f"{what} cache storage")


def float64_attention(b: DecodeBatch, q: torch.Tensor, kv_cache: torch.Tensor,
                      row: int) -> torch.Tensor:
    """Dense attention of row `row`'s query [H, D] over its seq_len keys read through its
    block table, in float64."""
    seq_len = int(b.meta.seq_lens[row])
    _, _, block_size, kv_heads, dim = kv_cache.shape
    pos = torch.arange(seq_len)
    slots = b.meta.block_tables[row, pos // block_size].long() * block_size + pos % block_size
    flat = kv_cache.view(2, -1, kv_heads, dim)
    group = q.shape[1] // kv_heads
    k = flat[0, slots].double().repeat_interleave(group, 1)  # [S, H, D]
    v = flat[1, slots].double().repeat_interleave(group, 1)
    s = torch.einsum("hd,khd->hk", q[row].double(), k) * b.scale
    return torch.einsum("hk,khd->hd", s.softmax(-1), v)


def check_matches_reference(b: DecodeBatch, launches: list[AttentionLaunch]) -> None:
    """Fused vs the plain torch path (rms_norm, apply_rotary, store) and float64 attention."""
    full = with_slots(b.x, b.full_slots)
    q_ref = reference(b.case, full)  # every real row's new k in full's cache
    cache_ref = clone_inputs(b.x)
    reference(b.case, cache_ref)  # the cache as the skipped slots leave it
    tol = REF_TOL[b.case.dtype]
    for launch in launches:
        x = clone_inputs(b.x)
        got = run_fused(b, x, launch)
        for row in range(b.num_real):
            if b.x.slot_mapping[row] < 0:  # reads its unwritten key (check_matches_unfused)
                continue
            want = float64_attention(b, q_ref, full.kv_cache, row)
            err = ((got[row].double() - want).norm() / want.norm()).item()
            assert err < tol, f"{b.case} {launch} row {row}: relative error {err:.3g}"
        assert_close(x.storage, cache_ref.storage, TOL[b.case.dtype], f"{b.case} cache")


# --------------------------------------------------------------------------- pytest side

CHECKS = ["unfused_float32", "unfused_bfloat16", "partial_rotary", "reference", "backend",
          "warm_up"]

test_decode_qk_attention_interpreted = interpreted_check_test(__file__, CHECKS)


def _host_batch(num_seqs: int, num_tokens: int, dtype: torch.dtype = F32
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                           torch.Tensor, dict[str, Any]]:
    """CPU tensors for argument checks: (query, k_cache, v_cache, cu, seq_lens, tables,
    QKNormRope kwargs). No kernel may run: the checks must fire on the host first."""
    heads, kv_heads, dim, block_size = 4, 2, 32, 16
    query = torch.zeros(num_tokens, heads, dim, dtype=dtype)
    cache = torch.zeros(2, 4, block_size, kv_heads, dim, dtype=dtype)
    cu = torch.tensor([0, *range(num_tokens - num_seqs + 1, num_tokens + 1)],
                      dtype=torch.int32)  # row 0 takes the extra tokens
    seq_lens = torch.full((num_seqs,), 5, dtype=torch.int32)
    tables = torch.zeros(num_seqs, 1, dtype=torch.int32)
    fused = dict(key=torch.zeros(num_tokens, kv_heads, dim, dtype=dtype),
                 value=torch.zeros(num_tokens, kv_heads, dim, dtype=dtype),
                 positions=torch.zeros(num_tokens, dtype=torch.int64),
                 slot_mapping=torch.zeros(num_tokens, dtype=torch.int64),
                 cos_sin_cache=torch.zeros(64, dim, dtype=torch.float32),
                 q_weight=torch.ones(dim, dtype=dtype), k_weight=torch.ones(dim, dtype=dtype),
                 eps=EPS, rotary_dim=dim)
    return query, cache[0], cache[1], cu, seq_lens, tables, fused


def test_fused_attention_needs_a_decode_batch() -> None:
    """More tokens than rows, or a sub-batch (seq_base > 0): refused before any launch."""
    from models.kernels.paged_attention import AttentionLaunch, paged_attention
    from models.kernels.qk_norm_rope import QKNormRope

    launch = AttentionLaunch(block_q=8, block_n=16, num_splits=1)
    query, k_cache, v_cache, cu, seq_lens, tables, fused = _host_batch(2, 3)
    with pytest.raises(AssertionError, match="decode"):
        paged_attention(query, k_cache, v_cache, cu, seq_lens, tables, 0.1, launch,
                        qk_norm_rope=QKNormRope(**fused))
    # Rows 1..2 of a 3-row step: as many tokens as rows, but from row 1.
    query, k_cache, v_cache, cu, seq_lens, tables, fused = _host_batch(3, 3)
    with pytest.raises(AssertionError, match="seq_base"):
        paged_attention(query[1:], k_cache, v_cache, cu, seq_lens, tables, 0.1, launch,
                        seq_base=1, qk_norm_rope=QKNormRope(**{
                            **fused, **{n: fused[n][1:] for n in (
                                "key", "value", "positions", "slot_mapping")}}))


def test_fused_attention_checks_key_against_query() -> None:
    from models.kernels.paged_attention import AttentionLaunch, paged_attention
    from models.kernels.qk_norm_rope import QKNormRope

    launch = AttentionLaunch(block_q=8, block_n=16, num_splits=1)
    query, k_cache, v_cache, cu, seq_lens, tables, fused = _host_batch(2, 2)
    wrong_heads = {**fused, "key": torch.zeros(2, 1, 32), "value": torch.zeros(2, 1, 32)}
    with pytest.raises(AssertionError, match="key"):
        paged_attention(query, k_cache, v_cache, cu, seq_lens, tables, 0.1, launch,
                        qk_norm_rope=QKNormRope(**wrong_heads))
    bf16 = {**fused, **{n: fused[n].to(BF16) for n in ("key", "value", "q_weight",
                                                        "k_weight")}}
    with pytest.raises(AssertionError, match="key"):  # k/v in bf16, query and cache fp32
        paged_attention(query, k_cache, v_cache, cu, seq_lens, tables, 0.1, launch,
                        qk_norm_rope=QKNormRope(**bf16))


def test_qk_norm_rope_args_are_validated() -> None:
    from models.kernels.qk_norm_rope import QKNormRope

    *_, fused = _host_batch(2, 2)
    QKNormRope(**fused)  # the valid base case
    wide = torch.zeros(2, 4, 32)
    bad = {
        "value shape": dict(value=torch.zeros(2, 2, 16)),
        "value strides": dict(value=wide[:, :2]),
        "value dtype": dict(value=fused["value"].to(BF16)),
        "key head_dim not contiguous": dict(key=torch.zeros(2, 2, 64)[:, :, ::2],
                                            value=torch.zeros(2, 2, 64)[:, :, ::2]),
        "head_dim not a power of two": dict(key=torch.zeros(2, 2, 24),
                                            value=torch.zeros(2, 2, 24), rotary_dim=16,
                                            cos_sin_cache=torch.zeros(64, 16)),
        "positions shape": dict(positions=torch.zeros(3, dtype=torch.int64)),
        "slot_mapping shape": dict(slot_mapping=torch.zeros(2, 1, dtype=torch.int64)),
        "cos_sin width": dict(cos_sin_cache=torch.zeros(64, 16)),
        "cos_sin dtype": dict(cos_sin_cache=torch.zeros(64, 32, dtype=BF16)),
        "odd rotary_dim": dict(rotary_dim=31, cos_sin_cache=torch.zeros(64, 31)),
        "rotary_dim > head_dim": dict(rotary_dim=64, cos_sin_cache=torch.zeros(64, 64)),
        "q_weight shape": dict(q_weight=torch.ones(16)),
        "k_weight dtype": dict(k_weight=torch.ones(32, dtype=BF16)),
    }
    for what, override in bad.items():
        with pytest.raises(AssertionError):
            QKNormRope(**{**fused, **override})
            raise RuntimeError(f"{what} accepted")  # not an AssertionError: fails the test


def test_only_the_triton_backend_fuses_decode_attention() -> None:
    from models.backends.flash_attn_backend import FlashAttnBackend
    from models.backends.torch_backend import TorchAttentionBackend
    from models.backends.triton_backend import TritonAttentionBackend

    assert TorchAttentionBackend().decode_attention_qk_norm_rope is None
    assert FlashAttnBackend.decode_attention_qk_norm_rope is None
    assert callable(TritonAttentionBackend(num_sms=8).decode_attention_qk_norm_rope)


def test_backend_refuses_a_mixed_batch() -> None:
    from models.backends.triton_backend import TritonAttentionBackend

    heads, kv_heads, dim = 4, 2, 32
    meta = make_attention_metadata([1, 2], [3, 4], [[0], [1]], 16)
    assert not meta.decode_only
    qkv = torch.zeros(3, (heads + 2 * kv_heads) * dim)
    kv_cache = torch.zeros(2, 2, 16, kv_heads, dim)
    with pytest.raises(AssertionError, match="decode"):
        TritonAttentionBackend(num_sms=8).decode_attention_qk_norm_rope(
            qkv, torch.zeros(3, dtype=torch.int64), torch.zeros(64, dim), torch.ones(dim),
            torch.ones(dim), EPS, kv_cache, meta, heads, kv_heads, dim, dim, dim**-0.5)


# --------------------------------------------------------------------------- subprocess side


def dot_bf16_in_float32() -> None:
    """Script side: Triton 3.x's interpreter keeps bfloat16 tensors as uint16 bit patterns
    and its tl.dot multiplies those as integers (garbage of the right shape). Convert bf16
    operands to float32 first, as the tensor cores take them (exact products, float32
    sums), so bf16 attention can be held against a reference."""
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    original = builder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        a, b = (self.cast_impl(x, tl.float32) if x.dtype == tl.bfloat16 else x
                for x in (a, b))
        return original(self, a, b, d, input_precision, max_num_imprecise_acc)

    builder.create_dot = create_dot


def _main() -> None:
    from models.backends.triton_backend import TritonAttentionBackend
    from models.kernels.paged_attention import choose_launch

    round_bf16_like_the_gpu()
    dot_bf16_in_float32()
    gen = torch.Generator().manual_seed(2468)

    def check_unfused(dtype: torch.dtype, block_sizes: list[int],
                      launch_sets: list[list[int]]) -> Callable[[], None]:
        def check() -> None:
            for layout, block_size, pick in zip(LAYOUTS, block_sizes, launch_sets,
                                                strict=True):
                launches = [decode_launches(layout)[i] for i in pick]
                # Qwen3-8B's layout through a qkv with a row stride past its width.
                b = make_decode_batch(dtype, layout, block_size, gen,
                                      strided=layout == (8, 2, 128))
                check_matches_unfused(b, launches)
        return check

    every = [0, 1, 2, 3]
    check_unfused_float32 = check_unfused(F32, [4, 16, 4, 16], [every] * 4)
    # bf16: each launch on two layouts, each layout on both block sizes (with float32's).
    check_unfused_bfloat16 = check_unfused(BF16, [16, 4, 16, 4],
                                           [[0, 3], [1, 2], [2, 3], [0, 1]])

    def check_partial_rotary() -> None:
        # Dims past rotary_dim are normed, not rotated (not a Qwen3 layout: the kernel's
        # ROTARY_DIM < HEAD_DIM branch).
        for dtype, layout, rotary_dim in ((F32, (4, 2, 32), 16), (BF16, (8, 2, 128), 96)):
            b = make_decode_batch(dtype, layout, 16, gen, rotary_dim=rotary_dim)
            check_matches_unfused(b, [decode_launches(layout)[i] for i in (0, 2)])

    def check_reference() -> None:
        for dtype, layout, block_size in ((F32, (4, 2, 32), 4), (F32, (3, 1, 32), 16),
                                          (BF16, (8, 2, 128), 16)):
            b = make_decode_batch(dtype, layout, block_size, gen)
            check_matches_reference(b, [decode_launches(layout)[i] for i in (0, 2)])

    def check_backend() -> None:
        # num_sms 8: 4 rows + padding of 2 kv heads take 4 splits, 8 rows + padding of
        # Qwen3-8B's (TP=4) 2 kv heads the 2-way split of >= 512-key partitions, one row of
        # one kv head the 32-way prefetch launch.
        cases = [(F32, (4, 2, 32), 16, [40, 0, 9, 70], True),
                 (BF16, (8, 2, 128), 4, CACHED + [3], True),
                 (F32, (4, 1, 16), 16, [70], False)]
        splits = set()
        for dtype, layout, block_size, cached, pad in cases:
            backend = TritonAttentionBackend(num_sms=8)
            heads, kv_heads, dim = layout
            b = make_decode_batch(dtype, layout, block_size, gen, cached=cached, skipped=[],
                                  pad=pad)
            x = b.x
            num_seqs = b.meta.seq_lens.shape[0]
            launch = choose_launch(num_tokens=num_seqs, num_seqs=num_seqs,
                                   num_kv_heads=kv_heads, num_q_per_kv=heads // kv_heads,
                                   dtype=dtype, max_query_len=1,
                                   max_seq_len=b.meta.max_seq_len, decode_only=True,
                                   num_sms=8)
            splits.add((launch.num_splits, launch.min_split_len, launch.prefetch_kv))
            unfused = clone_inputs(x)
            q = backend.qk_norm_rope_store(x.qkv, x.positions, x.cos_sin_cache, x.q_weight,
                                           x.k_weight, EPS, unfused.kv_cache[0],
                                           unfused.kv_cache[1], b.meta.slot_mapping, heads,
                                           kv_heads, dim, dim)
            want = backend.forward(q, unfused.kv_cache, b.meta, b.scale)
            fused = clone_inputs(x)
            got = backend.decode_attention_qk_norm_rope(
                x.qkv, x.positions, x.cos_sin_cache, x.q_weight, x.k_weight, EPS,
                fused.kv_cache, b.meta, heads, kv_heads, dim, dim, b.scale)
            rows = slice(0, b.num_real)
            assert got.shape == (num_seqs, heads, dim) and got.dtype == dtype
            assert not want[rows].isnan().any()
            assert_same_bits(got[rows], want[rows], f"backend {layout} {dtype} output")
            assert_same_bits(fused.storage, unfused.storage, f"backend {layout} {dtype} cache")
        assert splits == {(4, 0, False), (2, 512, False), (32, 0, True)}, splits

    def check_warm_up() -> None:
        # Every plain and fused launch variant runs once on the cache; none may write it,
        # nor the guard slot on either side (where a store at slot -1 would land).
        for layout, rotary_dim in (((4, 2, 32), 32), ((3, 1, 32), 16)):
            heads, kv_heads, dim = layout
            guard = kv_heads * dim
            storage = torch.randn(2 * 3 * 16 * guard + 2 * guard, generator=gen)
            kv_cache = storage[guard:-guard].view(2, 3, 16, kv_heads, dim)
            before = storage.clone()
            TritonAttentionBackend(num_sms=8).warm_up(kv_cache, heads,
                                                      fused_decode_rotary_dim=rotary_dim)
            assert torch.equal(storage, before), f"warm_up wrote the cache ({layout})"

    checks = dict(unfused_float32=check_unfused_float32,
                  unfused_bfloat16=check_unfused_bfloat16, partial_rotary=check_partial_rotary,
                  reference=check_reference, backend=check_backend, warm_up=check_warm_up)
    run_checks([(name, checks[name]) for name in CHECKS])


if __name__ == "__main__":
    _main()
