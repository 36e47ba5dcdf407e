"""Every model family end to end: greedy token ids from the offline LLM equal transformers'
greedy `generate` on tiny random checkpoints that transformers itself wrote (`save_pretrained`,
float32), under chunked prefill, prefix-cache hits and preemption, at TP=1 and TP=2 (gloo);
and the configs nanoserve cannot run are refused when the model is loaded.

Each case is one checkpoint: Llama (rope default, llama3, linear, yarn, tied, one KV head),
Mistral, Qwen2 (q/k/v biases, tied and untied), Qwen3 (tied, untied), Qwen3-MoE (8 experts,
top-2, norm_topk_prob on and off, dense layers between sparse ones). Some config.json files
are rewritten after saving to look like released checkpoints (legacy top-level rope_scaling
and rope_theta, Qwen2.5's unused sliding_window); transformers loads the rewritten file for
the reference, so both sides read the same bytes.
"""

from __future__ import annotations

import json
import random
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from engine_service import LLM
from tests.helpers import (
    greedy,
    hf_greedy,
    shared_prefix_prompts,
    spy_preemptions,
    spy_prefill_chunks,
)

pytestmark = pytest.mark.timeout(300)

MAX_TOKENS = 12
VOCAB = 384
WEIGHT_STD = 0.2  # peaked next-token distributions: greedy ties are rare, outputs vary
# Engine settings shared by every parity run: blocks of 4 tokens, a 32-token step budget
# (prompts of 41-90 tokens are prefilled in chunks, mixed with decode rows) and 32 blocks
# (128 token slots: two long sequences do not fit together, so the scheduler preempts).
ENGINE = dict(device="cpu", dtype="float32", kv_block_size=4, num_kv_blocks=32,
              max_model_len=112, max_num_batched_tokens=32)

BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
            rms_norm_eps=1e-6, initializer_range=WEIGHT_STD, hidden_act="silu")
_DELETE = object()  # config_edits: remove this key
MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, head_dim=16)


@dataclass(frozen=True)
class Case:
    id: str
    arch: str  # transformers' model class, also config.json's `architectures`
    config: dict = field(default_factory=dict)  # the config class's keyword arguments
    tp2: bool = False  # also run at TP=2
    sharded: bool = False  # several safetensors files + model.safetensors.index.json
    # Rewrite config.json as released Llama-3.1 checkpoints have it: rope_scaling and
    # rope_theta at the top level, torch_dtype, no head_dim, no rope_parameters.
    legacy_rope_keys: bool = False
    config_edits: dict = field(default_factory=dict)  # keys set in config.json after saving
    bare: bool = False  # only config.json + safetensors (no generation_config.json)
    moe_layers: tuple[int, ...] | None = None  # the sparse layers (checked on transformers)


LLAMA3_ROPE = dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
                   high_freq_factor=4.0, original_max_position_embeddings=64)

CASES = [
    Case("llama-default_rope", "LlamaForCausalLM"),
    Case("llama-llama3_rope", "LlamaForCausalLM", dict(rope_parameters=LLAMA3_ROPE)),
    Case("llama-llama3_rope_legacy_keys", "LlamaForCausalLM",
         dict(rope_parameters=LLAMA3_ROPE), legacy_rope_keys=True),
    Case("llama-linear_rope", "LlamaForCausalLM",
         dict(rope_parameters=dict(rope_type="linear", rope_theta=10000.0, factor=2.0))),
    Case("llama-yarn_rope", "LlamaForCausalLM",
         dict(rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
                                   original_max_position_embeddings=64))),
    Case("llama-tied", "LlamaForCausalLM", dict(tie_word_embeddings=True)),
    # One KV head: fewer KV heads than TP ranks, so each rank holds a copy of it.
    Case("llama-one_kv_head", "LlamaForCausalLM", dict(num_key_value_heads=1), tp2=True),
    Case("mistral-no_window", "MistralForCausalLM", dict(sliding_window=None), tp2=True),
    # Qwen2.5 ships sliding_window set but use_sliding_window false: full attention.
    Case("qwen2-untied", "Qwen2ForCausalLM", dict(tie_word_embeddings=False), tp2=True,
         config_edits=dict(sliding_window=32768, use_sliding_window=False,
                           max_window_layers=21)),
    Case("qwen2-tied", "Qwen2ForCausalLM", dict(tie_word_embeddings=True)),
    Case("qwen3-tied", "Qwen3ForCausalLM", dict(tie_word_embeddings=True, head_dim=16),
         tp2=True, bare=True),
    # head_dim 32 with 4 heads: q_proj is 128 wide on a hidden size of 64. The config keys
    # as released Qwen3 checkpoints have them: rope_theta at the top, rope_scaling null.
    Case("qwen3-untied_sharded", "Qwen3ForCausalLM",
         dict(tie_word_embeddings=False, head_dim=32), sharded=True,
         config_edits=dict(rope_parameters=_DELETE, rope_scaling=None, rope_theta=1e6)),
    Case("qwen3_moe-norm_topk", "Qwen3MoeForCausalLM", dict(MOE, norm_topk_prob=True),
         tp2=True, moe_layers=(0, 1)),
    # transformers writes num_local_experts; released Qwen3-MoE configs say num_experts.
    Case("qwen3_moe-no_norm_topk", "Qwen3MoeForCausalLM", dict(MOE, norm_topk_prob=False),
         tp2=True, moe_layers=(0, 1),
         config_edits=dict(num_local_experts=_DELETE, num_experts=8)),
    # 4 layers, sparse every 2nd (layers 1, 3) but layer 1 listed dense: only layer 3 is MoE.
    Case("qwen3_moe-dense_and_sparse_layers", "Qwen3MoeForCausalLM",
         dict(MOE, norm_topk_prob=True, num_hidden_layers=4, mlp_only_layers=[1],
              decoder_sparse_step=2), tp2=True, sharded=True, moe_layers=(3,)),
]
CASE_BY_ID = {c.id: c for c in CASES}
assert len(CASE_BY_ID) == len(CASES)


# ---------------------------------------------------------------- checkpoints


def hf_classes(arch: str):
    import transformers

    config_cls = getattr(transformers, arch.replace("ForCausalLM", "Config"))
    return config_cls, getattr(transformers, arch)


def randomize(model: torch.nn.Module, seed: int) -> None:
    """Every weight ~ normal(0, WEIGHT_STD), norm weights ~ 1 + normal(0, 0.1), from a
    seeded generator (independent of transformers' own init)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):  # a tied head comes once
            noise = torch.randn(param.shape, generator=gen, dtype=torch.float32)
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.1 * noise)
            else:
                param.copy_(WEIGHT_STD * noise)


def save_checkpoint(out_dir: Path, arch: str, config_kw: dict, seed: int = 0,
                    sharded: bool = False) -> Path:
    """A random float32 checkpoint written by transformers' save_pretrained."""
    config_cls, model_cls = hf_classes(arch)
    config = config_cls(**{**BASE, **config_kw})
    model = model_cls(config).float().eval()
    randomize(model, seed)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, max_shard_size="40KB" if sharded else "1GB")
    return out_dir


def edit_config(model_dir: Path, **changes) -> dict:
    path = model_dir / "config.json"
    raw = json.loads(path.read_text())
    for key, value in changes.items():
        if value is _DELETE:
            raw.pop(key, None)
        else:
            raw[key] = value
    path.write_text(json.dumps(raw, indent=2))
    return raw


def to_legacy_rope_keys(model_dir: Path) -> None:
    raw = json.loads((model_dir / "config.json").read_text())
    params = dict(raw["rope_parameters"])
    theta = params.pop("rope_theta")
    edit_config(model_dir, rope_parameters=_DELETE, rope_scaling=params, rope_theta=theta,
                head_dim=_DELETE, dtype=_DELETE, torch_dtype="float32")


def prompt_passes(seed: int) -> tuple[list[list[int]], list[list[int]]]:
    """Two generate passes. The first: three prompts sharing a 40-token prefix, and prompts
    of 1, 9, 70 and 90 tokens (positions past 64, the scaled ropes' original context). The
    second: three other prompts on the same 40-token prefix, and the 90-token one again, so
    the second pass hits the prefix cache."""
    shared = shared_prefix_prompts(seed, shared_len=40, n=6, vocab=VOCAB)
    rng = random.Random(seed + 1)
    singles = [[rng.randrange(VOCAB) for _ in range(n)] for n in (1, 9, 70, 90)]
    return shared[:3] + singles, shared[3:] + [singles[-1]]


@dataclass
class Built:
    model_dir: Path
    passes: tuple[list[list[int]], list[list[int]]]
    references: tuple[list[list[int]], list[list[int]]]


def build_case(case: Case, root: Path) -> Built:
    seed = zlib.crc32(case.id.encode())
    model_dir = save_checkpoint(root / case.id, case.arch, case.config, seed=seed,
                                sharded=case.sharded)
    if case.legacy_rope_keys:
        to_legacy_rope_keys(model_dir)
    if case.config_edits:
        edit_config(model_dir, **case.config_edits)
    if case.bare:
        (model_dir / "generation_config.json").unlink()
    files = sorted(p.name for p in model_dir.iterdir())
    if case.sharded:
        assert "model.safetensors.index.json" in files
        assert sum(f.endswith(".safetensors") for f in files) > 2, files
    if case.bare:
        assert files == ["config.json", "model.safetensors"], files

    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    assert type(hf).__name__ == case.arch
    if case.moe_layers is not None:
        sparse = tuple(i for i, layer in enumerate(hf.model.layers)
                       if type(layer.mlp).__name__.endswith("SparseMoeBlock"))
        assert sparse == case.moe_layers, sparse
    hf.generation_config.eos_token_id = None  # ignore eos, as nanoserve's ignore_eos does
    # transformers read the rope the case asks for (also from legacy top-level keys).
    want_rope = case.config.get("rope_parameters", {"rope_type": "default"})
    got_rope = hf.config.rope_parameters
    assert {k: got_rope.get(k) for k in want_rope} == want_rope, got_rope
    if "rope_theta" in case.config_edits:
        assert got_rope["rope_theta"] == case.config_edits["rope_theta"], got_rope
    passes = prompt_passes(seed)
    references = tuple([hf_greedy(hf, p, MAX_TOKENS) for p in ps] for ps in passes)
    check_not_degenerate(references[0] + references[1])
    return Built(model_dir, passes, references)


def check_not_degenerate(continuations: list[list[int]]) -> None:
    """Parity only means something if the model says different things: most continuations
    are not one token repeated, and they do not all say the same."""
    repeated = sum(len(set(c)) == 1 for c in continuations)
    assert repeated <= len(continuations) // 4, continuations
    assert len({t for c in continuations for t in c}) >= 3 * MAX_TOKENS, continuations


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """case id -> its checkpoint and transformers' references, built once per module."""
    cache: dict[str, Built] = {}
    root = tmp_path_factory.mktemp("families")

    def get(case_id: str) -> Built:
        if case_id not in cache:
            cache[case_id] = build_case(CASE_BY_ID[case_id], root)
        return cache[case_id]

    return get


# ---------------------------------------------------------------- greedy parity


def run_and_compare(b: Built, **engine_kw) -> None:
    """Both passes through one LLM; token ids equal transformers', prompts were prefilled
    in chunks, the scheduler preempted, and the second pass hit the prefix cache."""
    llm = LLM(str(b.model_dir), **{**ENGINE, **engine_kw})
    try:
        preempted = spy_preemptions(llm)
        chunks = spy_prefill_chunks(llm)
        outs = [llm.generate(ps, greedy(MAX_TOKENS), use_tqdm=False) for ps in b.passes]
    finally:
        llm.engine.shutdown()
    for i, (pass_outs, refs, prompts) in enumerate(zip(outs, b.references, b.passes,
                                                       strict=True)):
        got = [o.token_ids for o in pass_outs]
        bad = [f"prompt {j} ({len(p)} tokens): got {g}, want {r}"
               for j, (p, g, r) in enumerate(zip(prompts, got, refs, strict=True)) if g != r]
        assert not bad, f"pass {i + 1}: " + "; ".join(bad)
        assert all(o.finish_reason == "length" for o in pass_outs)
    cached = [o.num_cached_tokens for o in outs[1]]
    assert any(c >= 40 for c in cached), f"second pass missed the prefix cache: {cached}"
    assert chunks, "a 32-token step budget was meant to split the long prompts"
    assert preempted, "32 KV blocks of 4 tokens were meant to force preemption"


@pytest.mark.parametrize("case_id", [c.id for c in CASES])
def test_greedy_matches_transformers(built, case_id):
    run_and_compare(built(case_id))


@pytest.mark.slow
@pytest.mark.parametrize("case_id", [c.id for c in CASES if c.tp2])
def test_tp2_greedy_matches_transformers(built, case_id):
    run_and_compare(built(case_id), tensor_parallel_size=2)


# ---------------------------------------------------------------- refusals


def refused_checkpoint(tmp_path: Path, arch: str, config_kw: dict) -> Path:
    """A one-layer checkpoint that transformers writes (and loads) happily."""
    return save_checkpoint(tmp_path / "model", arch, {"num_hidden_layers": 1, **config_kw})


def load(model_dir: Path) -> LLM:
    return LLM(str(model_dir), **ENGINE)


def test_unknown_architecture_is_refused_with_the_supported_list(tmp_path):
    model_dir = refused_checkpoint(tmp_path, "Qwen3ForCausalLM", dict(head_dim=16))
    edit_config(model_dir, architectures=["FooBarForCausalLM"])
    with pytest.raises(ValueError, match="FooBarForCausalLM") as exc:
        load(model_dir)
    assert "LlamaForCausalLM" in str(exc.value), str(exc.value)


@pytest.mark.parametrize("arch, config_kw, match", [
    pytest.param("MistralForCausalLM", dict(sliding_window=16), "sliding_window",
                 id="mistral-sliding_window_16"),
    pytest.param("Qwen2ForCausalLM",
                 dict(use_sliding_window=True, sliding_window=16, max_window_layers=0),
                 "sliding_window", id="qwen2-use_sliding_window"),
    pytest.param("LlamaForCausalLM",
                 dict(rope_parameters=dict(rope_type="dynamic", rope_theta=10000.0,
                                           factor=2.0)),
                 "dynamic", id="llama-dynamic_rope"),
    pytest.param("LlamaForCausalLM", dict(hidden_act="gelu"), "hidden_act",
                 id="llama-gelu"),
])
def test_unsupported_config_is_refused(tmp_path, arch, config_kw, match):
    model_dir = refused_checkpoint(tmp_path, arch, config_kw)
    with pytest.raises(ValueError, match=match):
        load(model_dir)
