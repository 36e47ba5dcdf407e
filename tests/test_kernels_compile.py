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
from dataclasses import dataclass, field
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

from models.kernels import decode_gemv, rope_store, sample, store_kv  # noqa: E402
from models.kernels import fused_moe as moe  # noqa: E402
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


def _attention_case(num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                    launch: pa.AttentionLaunch, block_size: int, causal: bool = True) -> Case:
    """paged_attention's launch over a contiguous [T, H, D] query and a [blocks,
    block_size, Hkv, D] cache (block_size 1: forward_no_cache's view of the step's K/V)."""
    nq = num_heads // num_kv_heads
    group_pad = pa._group_pad(nq)
    block_m = launch.block_q * group_pad
    dt = _DTYPE_NAMES[dtype]
    slot = num_kv_heads * head_dim
    return Case(
        kernel=pa._paged_attention_kernel,
        pointers={**_ptrs(dt, "q_ptr", "k_cache_ptr", "v_cache_ptr", "out_ptr"),
                  **_ptrs("fp32", "ws_acc_ptr", "ws_max_ptr", "ws_sum_ptr"),
                  **_ptrs("i32", "counters_ptr", "cu_seqlens_q_ptr", "seq_lens_ptr",
                          "block_tables_ptr")},
        constexprs=dict(
            NUM_Q_PER_KV=nq, GROUP_PAD=group_pad, BLOCK_Q=launch.block_q, BLOCK_M=block_m,
            BLOCK_N=launch.block_n, HEAD_DIM=head_dim, NUM_SPLITS=launch.num_splits,
            MERGE_ROWS=pa._merge_rows(block_m, head_dim, launch),
            DOT_PRECISION="ieee" if dtype == torch.float32 else "tf32", CAUSAL=causal),
        num_warps=launch.num_warps, num_stages=launch.num_stages,
        ints=dict(num_heads=num_heads, block_size=block_size,
                  stride_qt=num_heads * head_dim, stride_qh=head_dim,
                  stride_ot=num_heads * head_dim, stride_oh=head_dim,
                  stride_k_slot=slot, stride_k_head=head_dim,
                  stride_v_slot=slot, stride_v_head=head_dim),
        floats=("qk_scale",),
    )


def _attention_cases() -> list[Any]:
    cases = []
    for label, heads, kv_heads, head_dim, dtype, splits in _ATTN_LAYOUTS:
        variants = pa.launch_variants(heads // kv_heads, dtype)
        assert {v.num_splits for v in variants} >= set(splits), f"{label}: {variants}"
        for v in (v for v in variants if v.num_splits in splits):
            case = _attention_case(heads, kv_heads, head_dim, dtype, v, block_size=16)
            vid = (f"{label}-q{v.block_q}-n{v.block_n}-s{v.num_splits}-w{v.num_warps}"
                   f"-min{v.min_split_len}" + "-small" * v.small_decode)
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
    # Diffusion models (LLaDA-8B's heads) attend without the causal mask, on prefill tiles.
    heads, kv_heads, head_dim = 32, 32, 128
    _, prefill_q = pa._block_qs(pa._group_pad(1))
    for v in pa.launch_variants(1, torch.bfloat16):
        if v.block_q == prefill_q:
            case = _attention_case(heads, kv_heads, head_dim, torch.bfloat16, v, block_size=16,
                                   causal=False)
            cases.append(pytest.param(
                case, id=f"paged_attention-llada-8b-non-causal-q{v.block_q}-s{v.num_splits}"))
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


def _sample_cases() -> list[Any]:
    """The sampler compiles the race for the model dtype and float32 logits (penalised
    logits are float32); vocab sizes and split counts are do_not_specialize."""
    cases = []
    # A TP=4 rank's shard of Qwen3's vocab (vocab_offset: rank 1's); masked draws (structured
    # output) see the whole vocabulary on one rank.
    shard = dict(vocab_size=37984, vocab_offset=37984, stride_row=37984, stride_mask=0,
                 chunk=1024, num_splits=38)
    whole = dict(vocab_size=151936, vocab_offset=0, stride_row=151936, stride_mask=4748,
                 chunk=4096, num_splits=38)
    for dt, has_mask, ints in (("bf16", False, shard), ("fp32", False, shard),
                               ("bf16", True, whole)):
        case = Case(
            kernel=sample._race_partial_kernel,
            pointers={**_ptrs(dt, "logits_ptr"),
                      **_ptrs("fp32", "temps_ptr", "part_val_ptr"),
                      **_ptrs("i64", "seeds_ptr", "steps_ptr"),
                      **_ptrs("i32", "part_idx_ptr", "mask_ptr")},
            constexprs=dict(BLOCK=sample.BLOCK, LIBDEVICE=True, HAS_MASK=has_mask),
            num_warps=sample.NUM_WARPS, ints=ints,
        )
        cases.append(pytest.param(case, id=f"sample-race_partial-{dt}{'-mask' * has_mask}"))
    combine = Case(
        kernel=sample._combine_kernel,
        pointers={**_ptrs("fp32", "part_val_ptr"), **_ptrs("i32", "part_idx_ptr"),
                  **_ptrs("i64", "tokens_ptr")},
        constexprs=dict(SPLITS_PAD=sample.MAX_SPLITS),
        num_warps=1, ints=dict(num_splits=1),
    )
    cases.append(pytest.param(combine, id="sample-combine"))
    return cases


# --------------------------------------------------------------------------- decode GEMV

def _decode_gemv_cases() -> list[Any]:
    """Qwen3-0.6B's batch-1 linears as the decode ops launch them: qkv with the norm folded
    in, gate_up with the norm and SiLU-and-mul, down plain, a biased Qwen2-style qkv."""
    cases = []
    for label, n_out, k, norm, silu, bias in (("qkv-norm", 4096, 1024, True, False, False),
                                              ("gate_up-norm-silu", 3072, 1024, True, True,
                                               False),
                                              ("down", 1024, 3072, False, False, False),
                                              ("qkv-bias", 4096, 1024, True, False, True)):
        cfg = decode_gemv.choose_config(n_out, k, torch.bfloat16, norm)
        case = Case(
            kernel=decode_gemv._decode_gemv_kernel,
            pointers=_ptrs("bf16", "x_ptr", "r_ptr", "nw_ptr", "w_ptr", "b_ptr", "out_ptr",
                           "r_out_ptr"),
            constexprs=dict(BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, VEC=8,
                            EVEN_K=k % cfg.block_k == 0, HAS_BIAS=bias, NORM=norm,
                            HAS_RESIDUAL=norm, SILU_MUL=silu, PDL=True),
            num_warps=cfg.num_warps, ints=dict(M=1, N=n_out, K=k, stride_xm=k, stride_rm=k,
                                               stride_om=n_out, stride_rom=k),
            floats=("eps",))
        cases.append(pytest.param(case, id=f"decode_gemv-{label}"))
    return cases


def _rope_store_cases() -> list[Any]:
    cases = []
    for label, heads, kv_heads, head_dim, dt, norm in (("qwen3-0.6b", 16, 8, 128, "bf16", True),
                                                       ("llama-1b", 32, 8, 64, "bf16", False),
                                                       ("tiny", 4, 2, 16, "fp32", True)):
        width = (heads + 2 * kv_heads) * head_dim
        case = Case(
            kernel=rope_store._rope_store_kernel,
            pointers={**_ptrs(dt, "qkv_ptr", "q_weight_ptr", "k_weight_ptr", "k_cache_ptr",
                              "v_cache_ptr", "out_ptr"),
                      **_ptrs("i64", "positions_ptr", "slot_mapping_ptr"),
                      **_ptrs("fp32", "cos_sin_ptr")},
            constexprs=dict(NUM_HEADS=heads, NUM_KV_HEADS=kv_heads, HEADS=1,
                            HEAD_DIM=head_dim, ROTARY_DIM=head_dim, HAS_QK_NORM=norm),
            num_warps=max(1, head_dim // 128),
            ints=dict(stride_qkv_t=width, stride_out_t=heads * head_dim,
                      stride_cos_sin=head_dim, stride_cache_slot=kv_heads * head_dim,
                      stride_cache_head=head_dim),
            floats=("eps",))
        cases.append(pytest.param(case, id=f"rope_store-{label}"))
    return cases


# --------------------------------------------------------------------------- fused MoE

def _fused_moe_cases() -> list[Any]:
    """Qwen3-30B-A3B's experts (128, top-8, hidden 2048, moe_intermediate 768) in bf16 at the
    first tile of the table, and the tiny test shape in fp32."""
    cases = []
    for counted, chunk in ((False, 1024), (True, 2048)):
        cases.append(Case(
            kernel=moe._align_kernel,
            pointers={**_ptrs("i64", "topk_ids_ptr"),
                      **_ptrs("i32", "counts_ptr", "sorted_slots_ptr", "block_experts_ptr")},
            constexprs=dict(NUM_LOCAL=128, BINS=256, BLOCK_M=16, CHUNK=chunk,
                            CHUNKS_PAD=64, COUNTED=counted, BLOCKS=16),
            num_warps=8 if counted else 4, ints=dict(num_slots=8, first_expert=0,
                                                     max_blocks=8)))
    cases.append(Case(
        kernel=moe._count_kernel,
        pointers={**_ptrs("i64", "topk_ids_ptr"), **_ptrs("i32", "counts_ptr")},
        constexprs=dict(NUM_LOCAL=128, BINS=256, CHUNK=1024), num_warps=4,
        ints=dict(num_slots=8, first_expert=0)))
    for config, dt, hidden, inter in ((moe._BF16_TABLE[0][1], "bf16", 2048, 768),
                                      (moe._FP32_CONFIG, "fp32", 32, 16)):
        precision = "ieee" if dt == "fp32" else "tf32"
        tile = config.gate_up
        cases.append(Case(
            kernel=moe._gate_up_kernel,
            pointers={**_ptrs(dt, "x_ptr", "w_ptr", "h_ptr"),
                      **_ptrs("i32", "sorted_slots_ptr", "block_experts_ptr")},
            constexprs=dict(TOP_K=8, BLOCK_M=config.block_m, BLOCK_N=tile.block_n,
                            BLOCK_K=tile.block_k, GROUP_M=config.group_m,
                            EVEN_K=hidden % tile.block_k == 0, DOT_PRECISION=precision),
            num_warps=tile.num_warps, num_stages=tile.num_stages,
            ints=dict(num_slots=8, num_m_blocks=8, N=inter, K=hidden, stride_xt=hidden,
                      stride_we=2 * inter * hidden, stride_wn=hidden, stride_hm=inter)))
        tile = config.down
        cases.append(Case(
            kernel=moe._down_kernel,
            pointers={**_ptrs(dt, "h_ptr", "w_ptr", "y_ptr"), **_ptrs("fp32", "topk_weights_ptr"),
                      **_ptrs("i32", "sorted_slots_ptr", "block_experts_ptr")},
            constexprs=dict(BLOCK_M=config.block_m, BLOCK_N=tile.block_n,
                            BLOCK_K=tile.block_k, GROUP_M=config.group_m,
                            EVEN_K=inter % tile.block_k == 0, DOT_PRECISION=precision),
            num_warps=tile.num_warps, num_stages=tile.num_stages,
            ints=dict(num_slots=8, num_m_blocks=8, N=hidden, K=inter, stride_hm=inter,
                      stride_we=hidden * inter, stride_wn=inter, stride_ys=hidden)))
    cases.append(Case(
        kernel=moe._sum_kernel,
        pointers={**_ptrs("bf16", "y_ptr", "out_ptr"), **_ptrs("i64", "topk_ids_ptr")},
        constexprs=dict(TOP_K=8, NUM_LOCAL=128, BLOCK_N=1024), num_warps=4,
        ints=dict(first_expert=0, N=2048, stride_ys=2048, stride_ot=2048)))
    cases.append(Case(
        kernel=moe._topk_kernel,
        pointers={**_ptrs("fp32", "logits_ptr", "weights_ptr"), **_ptrs("i32", "ids_ptr")},
        constexprs=dict(TOP_K=8, K_PAD=8, E_PAD=128, BLOCK_T=16, RENORMALIZE=True),
        num_warps=4, ints=dict(num_tokens=8, num_experts=128, stride_lt=128)))
    return [pytest.param(c, id=f"fused_moe-{c.kernel.__name__}-{i}")
            for i, c in enumerate(cases)]


CASES = (_attention_cases() + _store_kv_cases() + _sample_cases()
         + _decode_gemv_cases() + _rope_store_cases() + _fused_moe_cases())


@pytest.mark.parametrize("case", CASES)
def test_compiles_for_sm90(case: Case) -> None:
    sig, consts, attrs = signature(case)
    options: dict[str, int] = {"num_warps": case.num_warps}
    if case.num_stages is not None:
        options["num_stages"] = case.num_stages
    src = ASTSource(fn=case.kernel, signature=sig, constexprs=consts, attrs=attrs)
    compiled = triton.compile(src, target=TARGET, options=options)
    name = case.kernel.__name__
    assert compiled.asm.get("cubin"), f"{name}: ptxas produced no cubin"
    assert ".target sm_90" in compiled.asm["ptx"], f"{name}: PTX not built for sm_90"
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
    assert len(launched) >= 5, f"found only {sorted(launched)}: is the scan broken?"
    assert launched <= covered, f"kernels without compile cases: {sorted(launched - covered)}"
