"""Compile every Triton kernel of models/kernels for an H100/H200 (sm_90) on this CPU machine.

The interpreter tests (TRITON_INTERPRET=1) run kernel bodies as Python, so source the real
compiler rejects (a name bound in only one constexpr branch and used in a dead one, a dtype
clash, inline PTX that ptxas refuses, a tile over the shared-memory limit) passes them and
fails at the first launch on a GPU. `triton.compile` needs no device for an explicit target:
each case here goes through Triton's whole pipeline down to a cubin (the wheel's ptxas), with
the constexprs its launcher passes and the signature Triton would build from the launcher's
arguments: pointers 16-byte aligned (torch allocations), int arguments specialised on their
value (== 1: a constant, a multiple of 16: divisibility) unless the kernel opts out with
do_not_specialize, floats fp32.

Triton's on-disk cache: its key hashes the kernel's source (with every @jit function it
calls), the signature, the constants and the options, and a failed compile stores nothing; a
hit therefore means this exact source compiled for this target before. A warm cache makes the
file fast, never vacuous: any edit to a kernel misses it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from typing import Any

import pytest

if os.environ.get("TRITON_INTERPRET", "0").lower() not in ("", "0", "false", "off"):
    pytest.skip("TRITON_INTERPRET is set: these tests compile for a real GPU",
                allow_module_level=True)
torch = pytest.importorskip("torch")
triton = pytest.importorskip("triton")


def _missing_cuda_backend() -> str | None:
    """Why an sm_90 cubin cannot be built here, or None."""
    try:
        from triton.backends import backends
        from triton.backends.nvidia.compiler import get_ptxas
    except ImportError as exc:
        return f"triton has no CUDA backend: {exc}"
    if "nvidia" not in backends:
        return "triton's nvidia backend is not installed"
    try:
        path = get_ptxas(90).path
    except (RuntimeError, OSError) as exc:
        return f"no ptxas for sm_90: {exc}"
    return None if path and os.path.exists(path) else "no ptxas for sm_90"


_REASON = _missing_cuda_backend()
if _REASON is not None:
    pytest.skip(_REASON, allow_module_level=True)

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from models.kernels import (  # noqa: E402
    all_reduce_norm,
    fused_gemv,
    gemv,
    qk_norm_rope,
    sample,
    store_kv,
    tp_argmax,
)
from models.kernels import paged_attention as pa  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)  # H100 / H200: compute capability 9.0, 32-lane warps
# sm_90's shared memory per block with the opt-in carve-out (227 KiB): a kernel needing
# more raises OutOfResources when the GPU loads it.
SM90_MAX_SHARED_BYTES = 227 * 1024
_I32_MAX = 2**31 - 1
_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


@dataclass(frozen=True)
class Case:
    """One compiled variant of a kernel: what its launcher passes for one model layout."""

    kernel: Any  # a triton JITFunction
    pointers: dict[str, str]  # every *_ptr / *_ptrs argument -> Triton type ("*bf16")
    constexprs: dict[str, object]  # every tl.constexpr argument
    num_warps: int
    num_stages: int | None = None  # None: Triton's default (launchers that pass none)
    ints: dict[str, int] = field(default_factory=dict)  # int args' values in a real launch
    floats: tuple[str, ...] = ()  # fp32 scalars; other unlisted args are plain i32


def signature(case: Case) -> tuple[dict[str, str], dict[str, object], dict[tuple, list]]:
    """(signature, constexprs, attrs) for ASTSource, specialised as a launch would be."""
    kernel = case.kernel
    name = kernel.__name__
    params = {p.name: p for p in kernel.params}
    given = set(case.pointers) | set(case.constexprs) | set(case.ints) | set(case.floats)
    assert given <= set(params), f"{name} has no argument {sorted(given - set(params))}"
    wanted = {n for n, p in params.items() if p.is_constexpr}
    assert set(case.constexprs) == wanted, (
        f"{name}: constexprs given {sorted(case.constexprs)}, kernel has {sorted(wanted)}")
    pointer_args = {n for n in params if n.endswith(("_ptr", "_ptrs"))}
    assert set(case.pointers) == pointer_args, (
        f"{name}: pointers given {sorted(case.pointers)}, kernel has {sorted(pointer_args)}")
    sig: dict[str, str] = {}
    consts = dict(case.constexprs)
    attrs: dict[tuple, list] = {}
    divisible = [["tt.divisibility", 16]]
    for i, arg in enumerate(kernel.arg_names):
        if arg in case.constexprs:
            sig[arg] = "constexpr"
        elif arg in case.pointers:
            sig[arg] = case.pointers[arg]
            attrs[(i,)] = divisible
        elif arg in case.floats:
            sig[arg] = "fp32"
        elif arg in case.ints:
            value = case.ints[arg]
            specialize = not params[arg].do_not_specialize
            if specialize and value == 1:
                sig[arg] = "constexpr"
                consts[arg] = 1
                continue
            sig[arg] = "i32" if -_I32_MAX - 1 <= value <= _I32_MAX else "i64"
            if specialize and value % 16 == 0:
                attrs[(i,)] = divisible
        else:
            sig[arg] = "i32"
    return sig, consts, attrs


def _ptrs(dtype: str, *names: str) -> dict[str, str]:
    return {n: f"*{dtype}" for n in names}


# --------------------------------------------------------------------------- paged attention

# Layouts of one rank: (label, num_heads, num_kv_heads, head_dim, dtype, split counts).
# fp32 is the tiny test model's (the GPU tests run it); the serving models are bf16. Split
# counts 2..32 compile the same code with a wider merge tile, so the 8B layout (whose GQA
# group of 4 gives other tiles) takes the ends of that range only, to keep this file's
# cold-cache run near a minute on two cores.
_ALL_SPLITS = tuple(1 << i for i in range(pa.MAX_SPLITS.bit_length()))
_ATTN_LAYOUTS = (
    ("qwen3-0.6b", 16, 8, 128, torch.bfloat16, _ALL_SPLITS),
    ("tiny", 4, 2, 16, torch.float32, _ALL_SPLITS),
    ("qwen3-8b", 32, 8, 128, torch.bfloat16, (1, 2, pa.MAX_SPLITS)),
)
# Layouts (label, num_heads, num_kv_heads, head_dim) whose bf16 decode launches take the
# fused q/k norm + rotary + K/V store: Qwen3-0.6B and Qwen3-8B at TP=4 (one rank's heads).
_QK_ATTN_LAYOUTS = (("qwen3-0.6b", 16, 8, 128), ("qwen3-8b-tp4", 8, 2, 128))


def _attention_case(num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                    launch: pa.AttentionLaunch, block_size: int,
                    qk_norm_rope: bool = False) -> Case:
    """paged_attention's launch over a contiguous [T, H, D] query and a [blocks,
    block_size, Hkv, D] cache (block_size 1: forward_no_cache's view of the step's K/V).
    qk_norm_rope: the fused decode launch of TritonAttentionBackend.decode_attention_qk_
    norm_rope instead, whose query, key and value are column views of the packed [T, (H +
    2 * Hkv) * D] qkv, with full rotary (Qwen3's); without it the launcher passes the query
    for every fused pointer and zeros for their strides and eps."""
    nq = num_heads // num_kv_heads
    group_pad = pa._group_pad(nq)
    block_m = launch.block_q * group_pad
    dt = _DTYPE_NAMES[dtype]
    slot = num_kv_heads * head_dim
    fused_ptrs = ("new_k_ptr", "new_v_ptr", "positions_ptr", "slot_mapping_ptr", "cos_sin_ptr",
                  "q_weight_ptr", "k_weight_ptr")
    if qk_norm_rope:
        qkv_width = (num_heads + 2 * num_kv_heads) * head_dim
        fused = {**_ptrs(dt, "new_k_ptr", "new_v_ptr", "q_weight_ptr", "k_weight_ptr"),
                 **_ptrs("i64", "positions_ptr", "slot_mapping_ptr"),
                 **_ptrs("fp32", "cos_sin_ptr")}
        stride_qt, rotary_dim = qkv_width, head_dim
        fused_ints = dict(stride_new_t=qkv_width, stride_new_h=head_dim,
                          stride_cos_sin=rotary_dim)
    else:
        fused = _ptrs(dt, *fused_ptrs)
        stride_qt, rotary_dim = num_heads * head_dim, 0
        fused_ints = dict(stride_new_t=0, stride_new_h=0, stride_cos_sin=0)
    return Case(
        kernel=pa._paged_attention_kernel,
        pointers={**_ptrs(dt, "q_ptr", "k_cache_ptr", "v_cache_ptr", "out_ptr"),
                  **_ptrs("fp32", "ws_acc_ptr", "ws_max_ptr", "ws_sum_ptr"),
                  **_ptrs("i32", "counters_ptr", "cu_seqlens_q_ptr", "seq_lens_ptr",
                          "block_tables_ptr"),
                  **fused},
        constexprs=dict(
            NUM_Q_PER_KV=nq, GROUP_PAD=group_pad, BLOCK_Q=launch.block_q, BLOCK_M=block_m,
            BLOCK_N=launch.block_n, HEAD_DIM=head_dim, NUM_SPLITS=launch.num_splits,
            MERGE_ROWS=pa._merge_rows(block_m, head_dim, launch),
            DOT_PRECISION="ieee" if dtype == torch.float32 else "tf32", PDL=True,
            PREFETCH_KV=launch.prefetch_kv, QK_NORM_ROPE=qk_norm_rope, ROTARY_DIM=rotary_dim),
        num_warps=launch.num_warps, num_stages=launch.num_stages,
        ints=dict(num_heads=num_heads, block_size=block_size,
                  stride_qt=stride_qt, stride_qh=head_dim,
                  stride_ot=num_heads * head_dim, stride_oh=head_dim,
                  stride_k_slot=slot, stride_k_head=head_dim,
                  stride_v_slot=slot, stride_v_head=head_dim, **fused_ints),
        floats=("qk_scale", "eps"),
    )


def _attention_cases() -> list[Any]:
    cases = []
    for label, heads, kv_heads, head_dim, dtype, splits in _ATTN_LAYOUTS:
        variants = pa.launch_variants(heads // kv_heads, dtype)
        assert {v.num_splits for v in variants} >= set(splits), f"{label}: {variants}"
        for v in (v for v in variants if v.num_splits in splits):
            case = _attention_case(heads, kv_heads, head_dim, dtype, v, block_size=16)
            vid = (f"{label}-q{v.block_q}-n{v.block_n}-s{v.num_splits}-w{v.num_warps}"
                   f"-min{v.min_split_len}" + "-prefetch" * v.prefetch_kv)
            cases.append(pytest.param(case, id=f"paged_attention-{vid}"))
    # forward_no_cache (the profiling pass) launches with block_size 1, which Triton turns
    # into a constant: a compile of its own, on prefill tiles (decode_only=False).
    heads, kv_heads, head_dim, dtype = 16, 8, 128, torch.bfloat16
    _, prefill_q = pa._block_qs(pa._group_pad(heads // kv_heads))
    for v in pa.launch_variants(heads // kv_heads, dtype):
        if v.block_q == prefill_q:
            case = _attention_case(heads, kv_heads, head_dim, dtype, v, block_size=1)
            cases.append(pytest.param(
                case, id=f"paged_attention-qwen3-0.6b-block1-q{v.block_q}-s{v.num_splits}"))
    # The fused q/k norm + rotary + K/V store decode launch (decode_attention_qk_norm_rope):
    # every decode launch choose_launch can return (what warm_up compiles with it) for the
    # serving layouts that fuse.
    for label, heads, kv_heads, head_dim in _QK_ATTN_LAYOUTS:
        decode = pa.decode_launch_variants(heads // kv_heads, torch.bfloat16)
        decode_q, _ = pa._block_qs(pa._group_pad(heads // kv_heads))
        assert {v.block_q for v in decode} == {decode_q}, f"{label}: {decode}"
        assert {v.num_splits for v in decode} == set(_ALL_SPLITS), f"{label}: {decode}"
        for v in decode:
            case = _attention_case(heads, kv_heads, head_dim, torch.bfloat16, v,
                                   block_size=16, qk_norm_rope=True)
            vid = (f"{label}-q{v.block_q}-n{v.block_n}-s{v.num_splits}-w{v.num_warps}"
                   f"-min{v.min_split_len}" + "-prefetch" * v.prefetch_kv)
            cases.append(pytest.param(case, id=f"paged_attention-qk_norm_rope-{vid}"))
    return cases


# --------------------------------------------------------------------------- GEMVs

def _fused_gemv_cases() -> list[Any]:
    """Every TUNED config, with each valid input stage (a residual needs the norm): the
    model takes norm + residual (norm alone on the first layer) for qkv and gate_up at
    TP=1, and SiLU alone for the TP shards' gate_up."""
    cases = []
    for (n, k, itemsize, silu_mul), cfg in fused_gemv.TUNED.items():
        dtype = {2: "bf16", 4: "fp32"}[itemsize]
        for has_norm, has_residual in ((False, False), (True, False), (True, True)):
            case = Case(
                kernel=fused_gemv._fused_gemv_kernel,
                pointers=_ptrs(dtype, "x_ptr", "r_ptr", "nw_ptr", "w_ptr", "out_ptr",
                               "r_out_ptr"),
                constexprs=dict(BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, VEC=16 // itemsize,
                                EVEN_K=k % cfg.block_k == 0, HAS_NORM=has_norm,
                                HAS_RESIDUAL=has_residual, SILU_MUL=silu_mul, PDL=True),
                num_warps=cfg.num_warps,
                ints=dict(n_out=n // 2 if silu_mul else n, K=k),
                floats=("eps",),
            )
            flags = "norm" * has_norm + "-res" * has_residual + "-silu" * silu_mul or "plain"
            cases.append(pytest.param(
                case, id=f"fused_gemv-n{n}-k{k}-{dtype}-bn{cfg.block_n}-bk{cfg.block_k}"
                         f"-w{cfg.num_warps}-{flags.strip('-')}"))
    return cases


def _gemv_case(n: int, k: int, dtype: str, cfg: gemv.GemvConfig, has_bias: bool,
               m: int = 1, push: tuple[int, int] | None = None) -> Case:
    """push: (rank, world size) of a launch that pushes into the fused norm's buffers."""
    itemsize = 4 if dtype == "fp32" else 2
    k_chunk = triton.cdiv(triton.cdiv(k, cfg.split_k), cfg.block_k) * cfg.block_k
    rank, world = push or (0, 1)
    push_dtype = "i64" if push else dtype  # without a push the launcher passes x
    return Case(
        kernel=gemv._gemv_kernel,
        pointers={**_ptrs(dtype, "x_ptr", "w_ptr", "b_ptr", "out_ptr"),
                  **_ptrs("fp32" if k_chunk < k else dtype, "ws_ptr"),
                  **_ptrs(push_dtype, "push_ptrs"),
                  **_ptrs("i32" if push else dtype, "epochs_ptr")},
        constexprs=dict(BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, VEC=16 // itemsize,
                        USE_MMA=cfg.kind == "mma",
                        DOT_PRECISION="ieee" if dtype == "fp32" else "tf32",
                        EVEN_K=k % cfg.block_k == 0, HAS_BIAS=has_bias,
                        SPLIT_K=k_chunk < k, PDL=True,
                        ROWS=gemv.row_bucket(cfg, m), PUSH=push is not None, RANK=rank,
                        WORLD=world),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        ints=dict(M=m, N=n, K=k, stride_xm=k, stride_om=n, k_chunk=k_chunk,
                  data_rows=min(1024, 256 * 1024 // (n * itemsize)) if push else 0),
    )


def _gemv_cases() -> list[Any]:
    cases = []
    for (n, k, itemsize), cfg in gemv.TUNED.items():
        if cfg is None:  # cuBLAS keeps the shape
            continue
        dtype = {2: "bf16", 4: "fp32"}[itemsize]
        cases.append(pytest.param(
            _gemv_case(n, k, dtype, cfg, has_bias=False),
            id=f"gemv-n{n}-k{k}-{dtype}-{cfg.kind}-bn{cfg.block_n}-bk{cfg.block_k}"))
    # Paths no TUNED entry takes today but gemv() serves (a biased linear, the benchmark's
    # mma and split-K configs): compile one of each so they do not rot unseen.
    extra = (
        ("bias", 1024, 3072, "bf16", gemv.GemvConfig(block_n=1, block_k=1024), True),
        ("mma", 4096, 4096, "bf16", gemv.GemvConfig(block_n=64, block_k=128, kind="mma",
                                                    num_stages=4), False),
        ("mma-fp32", 1024, 1024, "fp32", gemv.GemvConfig(block_n=32, block_k=64, kind="mma",
                                                         num_stages=3), False),
        ("split-k", 1024, 3072, "bf16", gemv.GemvConfig(block_n=1, block_k=512, split_k=3),
         True),
    )
    for label, n, k, dtype, cfg, has_bias in extra:
        cases.append(pytest.param(_gemv_case(n, k, dtype, cfg, has_bias, m=4),
                                  id=f"gemv-{label}-n{n}-k{k}-{dtype}"))
    # Row-parallel shards that push their partials into the fused norm's buffers (TP=2 and
    # TP=4 o_proj and down of the 8B; one rank each: RANK only picks the order of the
    # stores), a biased fma one, and a 2-row one.
    pushes = [(4096, 2048, "bf16", 2, 1, False), (4096, 6144, "bf16", 2, 1, False),
              (4096, 1024, "bf16", 4, 1, False), (4096, 3072, "bf16", 4, 1, False),
              (1024, 3072, "bf16", 2, 1, True), (1536, 4096, "bf16", 4, 2, False)]
    for n, k, dtype, world, m, has_bias in pushes:
        cfg = gemv.choose_config(n, k, torch.bfloat16)
        cases.append(pytest.param(
            _gemv_case(n, k, dtype, cfg, has_bias, m=m, push=(world - 1, world)),
            id=f"gemv-push-n{n}-k{k}-{dtype}-w{world}-m{m}-{cfg.kind}"))
    # The other fma row buckets (each its own compile; bucket 4 is above).
    for m in (2, 8):
        cases.append(pytest.param(
            _gemv_case(1536, 4096, "bf16", gemv.GemvConfig(block_n=1, block_k=1024), False, m=m),
            id=f"gemv-rows{m}-n1536-k4096-bf16"))
    for has_bias in (False, True):
        case = Case(
            kernel=gemv._split_k_finalize_kernel,
            pointers={**_ptrs("fp32", "ws_ptr"), **_ptrs("bf16", "b_ptr", "out_ptr")},
            constexprs=dict(HAS_BIAS=has_bias, BLOCK=gemv._FINALIZE_BLOCK, PDL=True),
            num_warps=4, ints=dict(M=4, N=1024, stride_om=1024),
        )
        cases.append(pytest.param(case, id=f"gemv-split_k_finalize-bias{int(has_bias)}"))
    return cases


# --------------------------------------------------------------------------- small kernels

# Per-rank layouts of the serving models (TP shards split the heads) and the tiny model:
# (label, num_heads, num_kv_heads, head_dim, dtype).
_HEAD_LAYOUTS = (
    ("qwen3-0.6b", 16, 8, 128, "bf16"),
    ("qwen3-8b", 32, 8, 128, "bf16"),
    ("qwen3-8b-tp2", 16, 4, 128, "bf16"),
    ("qwen3-8b-tp4", 8, 2, 128, "bf16"),
    ("tiny", 4, 2, 16, "fp32"),
)


def _store_kv_cases() -> list[Any]:
    """store_kv's key/value are strided views of the fused qkv projection."""
    cases = []
    for label, heads, kv_heads, head_dim, dt in _HEAD_LAYOUTS:
        qkv_width = (heads + 2 * kv_heads) * head_dim
        case = Case(
            kernel=store_kv._store_kv_kernel,
            pointers={**_ptrs(dt, "key_ptr", "value_ptr", "k_cache_ptr", "v_cache_ptr"),
                      **_ptrs("i64", "slot_mapping_ptr")},
            constexprs=dict(NUM_KV_HEADS=kv_heads,
                            HEADS_PAD=triton.next_power_of_2(kv_heads), HEAD_DIM=head_dim),
            num_warps=4 if kv_heads * head_dim >= 1024 else 2,
            ints=dict(stride_kt=qkv_width, stride_kh=head_dim, stride_vt=qkv_width,
                      stride_vh=head_dim, stride_cache_slot=kv_heads * head_dim,
                      stride_cache_head=head_dim),
        )
        cases.append(pytest.param(case, id=f"store_kv-{label}"))
    return cases


def _qk_norm_rope_cases() -> list[Any]:
    """Every heads-per-program the launcher's rule picks for the layout (one head a program
    below its program threshold, head blocks from it on)."""
    cases = []
    for label, heads, kv_heads, head_dim, dt in _HEAD_LAYOUTS:
        choices = sorted({qk_norm_rope.choose_heads_per_program(num_tokens, heads, kv_heads)
                          for num_tokens in (1, qk_norm_rope.HEAD_BLOCK_MIN_PROGRAMS)})
        for per_program in choices:
            case = Case(
                kernel=qk_norm_rope._qk_norm_rope_store_kernel,
                pointers={**_ptrs(dt, "qkv_ptr", "q_weight_ptr", "k_weight_ptr", "k_cache_ptr",
                                  "v_cache_ptr", "out_ptr"),
                          **_ptrs("i64", "positions_ptr", "slot_mapping_ptr"),
                          **_ptrs("fp32", "cos_sin_ptr")},
                constexprs=dict(NUM_HEADS=heads, NUM_KV_HEADS=kv_heads, HEADS=per_program,
                                HEAD_DIM=head_dim, ROTARY_DIM=head_dim, PDL=True),
                num_warps=qk_norm_rope._num_warps(head_dim, per_program),
                ints=dict(stride_qkv_t=(heads + 2 * kv_heads) * head_dim,
                          stride_out_t=heads * head_dim, stride_cos_sin=head_dim,
                          stride_cache_slot=kv_heads * head_dim, stride_cache_head=head_dim),
                floats=("eps",),
            )
            cases.append(pytest.param(case, id=f"qk_norm_rope-{label}-heads{per_program}"))
    return cases


def _sample_cases() -> list[Any]:
    """The sampler compiles the race for the model dtype and float32 logits (penalised
    logits are float32); vocab sizes and split counts are do_not_specialize."""
    cases = []
    for dt in ("bf16", "fp32"):
        case = Case(
            kernel=sample._race_partial_kernel,
            pointers={**_ptrs(dt, "logits_ptr"),
                      **_ptrs("fp32", "temps_ptr", "part_val_ptr"),
                      **_ptrs("i64", "seeds_ptr", "steps_ptr"),
                      **_ptrs("i32", "part_idx_ptr")},
            constexprs=dict(BLOCK=sample.BLOCK, LIBDEVICE=True, PDL=True),
            num_warps=sample.NUM_WARPS,
            # A TP=4 rank's shard of Qwen3's vocab (vocab_offset: rank 1's).
            ints=dict(vocab_size=37984, vocab_offset=37984, stride_row=37984, chunk=1024,
                      num_splits=38),
        )
        cases.append(pytest.param(case, id=f"sample-race_partial-{dt}"))
    combine = Case(
        kernel=sample._combine_kernel,
        pointers={**_ptrs("fp32", "part_val_ptr"), **_ptrs("i32", "part_idx_ptr"),
                  **_ptrs("i64", "tokens_ptr")},
        constexprs=dict(SPLITS_PAD=sample.MAX_SPLITS, PDL=True),
        num_warps=1, ints=dict(num_splits=1),
    )
    cases.append(pytest.param(combine, id="sample-combine"))
    return cases


def _all_reduce_norm_cases() -> list[Any]:
    """Every group size the fused norm serves (powers of two up to 8), for the 8B hidden
    size in both FAST_DTYPES (start-up self-checks both) and the 0.6B's: every rank of 2
    and 4, the first and last of 8 (RANK only picks which unrolled peer is skipped)."""
    cases = []
    for hidden, dt in ((4096, "bf16"), (4096, "fp32"), (1024, "bf16")):
        itemsize = 4 if dt == "fp32" else 2
        block_h = triton.next_power_of_2(hidden)
        for world in (2, 4, 8):
            data_rows = min(1024, 256 * 1024 // (hidden * itemsize))
            for rank in range(world) if world <= 4 else (0, world - 1):
                # Layer 0's call has no residual (the embedding's partial sum alone).
                has_residual = rank != world - 1 or world == 2
                # A call whose partials a GEMV pushed (the 8B's TP=2/4 decode layers).
                pushed = hidden == 4096 and dt == "bf16" and world <= 4 and rank == 0
                case = Case(
                    kernel=all_reduce_norm._all_reduce_add_rms_norm_kernel,
                    pointers={**_ptrs(dt, "x_ptr", "residual_ptr", "weight_ptr", "out_ptr",
                                      "residual_out_ptr"),
                              **_ptrs("i64", "data_ptrs"),
                              **_ptrs("i32", "epochs_ptr")},
                    constexprs=dict(RANK=rank, WORLD=world, BLOCK_H=block_h, PDL=True,
                                    HAS_RESIDUAL=has_residual, PUSHED=False),
                    num_warps=all_reduce_norm.norm_num_warps(block_h, world),
                    ints=dict(hidden=hidden, data_rows=data_rows,
                              stride_x=hidden, stride_r=hidden, stride_o=hidden,
                              stride_ro=hidden),
                    floats=("eps",),
                )
                cases.append(pytest.param(
                    case, id=f"all_reduce_norm-h{hidden}-{dt}-w{world}-r{rank}"
                             f"{'' if has_residual else '-first'}"))
                if pushed:
                    cases.append(pytest.param(
                        replace(case, constexprs={**case.constexprs, "PUSHED": True}),
                        id=f"all_reduce_norm-pushed-h{hidden}-{dt}-w{world}-r{rank}"))
    return cases


def _tp_argmax_cases() -> list[Any]:
    """The cross-rank argmax: one variant per (rank, world size), like the fused norm's;
    every rank of 2 and 4, the first and last of 8, and one rank of 3 (a padded peer
    tile)."""
    cases = []
    for world, ranks in ((2, (0, 1)), (4, (0, 1, 2, 3)), (8, (0, 7)), (3, (1,))):
        for rank in ranks:
            case = Case(
                kernel=tp_argmax._tp_argmax_kernel,
                pointers={**_ptrs("fp32", "values_ptr"), **_ptrs("i32", "indices_ptr"),
                          **_ptrs("i64", "out_ptr", "data_ptrs"),
                          **_ptrs("i32", "epochs_ptr")},
                constexprs=dict(RANK=rank, WORLD=world,
                                WORLD_PAD=triton.next_power_of_2(world),
                                S_PAD=tp_argmax.MAX_CANDIDATES, PDL=True),
                num_warps=1,
                ints=dict(num_candidates=38, data_rows=1024, stride_v=38, stride_i=38,
                          stride_o=1),
            )
            cases.append(pytest.param(case, id=f"tp_argmax-w{world}-r{rank}"))
    return cases


def _without_pdl(cases: list[Any]) -> list[Any]:
    """Kernels with a PDL switch are launched with it on sm_90+ (the cases above); without it
    (NANOSERVE_PDL=0, older GPUs) they compile other code, so each compiles so once (the
    fused decode mode of paged attention, QK_NORM_ROPE, counts as a kernel of its own)."""
    seen, plain = set(), []
    for param in cases:
        case = param.values[0]
        kind = (case.kernel, case.constexprs.get("QK_NORM_ROPE"))
        if case.constexprs.get("PDL") and kind not in seen:
            seen.add(kind)
            plain.append(pytest.param(
                replace(case, constexprs={**case.constexprs, "PDL": False}),
                id=f"{param.id}-no_pdl"))
    return plain


CASES = (_attention_cases() + _fused_gemv_cases() + _gemv_cases() + _store_kv_cases()
         + _qk_norm_rope_cases() + _sample_cases() + _all_reduce_norm_cases()
         + _tp_argmax_cases())
CASES += _without_pdl(CASES)


@pytest.mark.parametrize("case", CASES)
def test_compiles_for_sm90(case: Case) -> None:
    sig, consts, attrs = signature(case)
    options: dict[str, int] = {"num_warps": case.num_warps}
    if case.constexprs.get("PDL"):
        options["launch_pdl"] = True  # what the launcher passes with PDL on
    if case.num_stages is not None:
        options["num_stages"] = case.num_stages
    src = ASTSource(fn=case.kernel, signature=sig, constexprs=consts, attrs=attrs)
    compiled = triton.compile(src, target=TARGET, options=options)
    name = case.kernel.__name__
    assert compiled.asm.get("cubin"), f"{name}: ptxas produced no cubin"
    assert ".target sm_90" in compiled.asm["ptx"], f"{name}: PTX not built for sm_90"
    # With PDL on, the kernel must wait for the previous one (or it races with it), and the
    # kernels that prefetch before that wait must issue the prefetch.
    pdl = bool(case.constexprs.get("PDL"))
    assert ("griddepcontrol.wait" in compiled.asm["ptx"]) == pdl, f"{name}: PDL={pdl}"
    prefetches = pdl and (
        case.kernel is fused_gemv._fused_gemv_kernel
        or (case.kernel is gemv._gemv_kernel and not case.constexprs["SPLIT_K"])
        or (case.kernel is pa._paged_attention_kernel and case.constexprs["PREFETCH_KV"]))
    assert ("cp.async.bulk.prefetch.L2" in compiled.asm["ptx"]) == prefetches, (
        f"{name}: expected L2 prefetch {prefetches}")
    assert compiled.metadata.shared <= SM90_MAX_SHARED_BYTES, (
        f"{name} needs {compiled.metadata.shared} bytes of shared memory, "
        f"sm_90 has {SM90_MAX_SHARED_BYTES} per block")


def test_every_kernel_is_covered() -> None:
    """Each @triton.jit kernel a launcher in models/kernels starts (`name[grid](...)`) has
    compile cases here: a new kernel or kernel file fails this until it gets some."""
    import importlib
    import inspect
    import pkgutil

    from triton.runtime.jit import JITFunction

    import models.kernels

    launched = set()
    for info in pkgutil.iter_modules(models.kernels.__path__):
        module = importlib.import_module(f"models.kernels.{info.name}")
        source = inspect.getsource(module)
        launched |= {name for name, obj in vars(module).items()
                     if isinstance(obj, JITFunction) and obj.__module__ == module.__name__
                     and f"{name}[" in source}
    covered = {case.values[0].kernel.__name__ for case in CASES}
    assert len(launched) >= 9, f"found only {sorted(launched)}: is the scan broken?"
    assert launched <= covered, f"kernels without compile cases: {sorted(launched - covered)}"
