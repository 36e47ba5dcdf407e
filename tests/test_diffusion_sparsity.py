"""dLLM-Serve's head-sparse attention in the diffusion engine (DiffusionParams.retention_ratio,
delay_step; dual cache only), against the dual-cache reference loop of
tests/test_diffusion_caches.py over transformers' Llama (LLaDA) / Qwen2 (Dream), whose
attention is replaced (transformers' AttentionInterface) by one written here from the rules:

- a block's passes before `delay_step` attend fully (the first is the dual cache's refresh);
- at pass `delay_step`, which attends fully too, each layer's KV head scores every candidate
  key (each position outside the block: the prompt and the suffix, as the dual cache holds
  them) by the mean over the block's queries of q.k / sqrt(d), the max over the query heads
  sharing the KV head; the scores are max-pooled over neighbouring candidates (kernel 3, the
  candidates in position order) and the max(1, int(C * retention_ratio)) best candidates are
  kept (ties: the earlier position);
- the block's later passes attend, per KV head, only to the kept keys and the block's own
  keys (every query of the pass, Dream's scoring row too); the next block starts full again.

The engine must give the reference's tokens with requests joining at different passes and
sparse, dual, prefix and uncached requests in one batch. Also: retention 1.0 gives the dual
cache's tokens, a small one changes some, agreement and forward-pass counts are recorded, the
backend never sees the sparse rows, a request's kept keys last one block, bad values name
their field, and every KV block is free after each test.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from transformers import AttentionInterface

from engine_service import SamplingParams
from engine_service.common.sampling_params import DiffusionParams
from tests.helpers import random_prompts
from tests.test_diffusion_caches import (  # noqa: F401 (every_block_free_after: autouse)
    every_block_free_after,
    make_engine,
    reference_tokens,
    run,
    with_cache,
)
from tests.test_diffusion_models import FAMILIES, hf_model

ATTENTION = "nanoserve_head_sparse_reference"


# ---------------------------------------------------------------- the reference's attention


@dataclass
class Pass:
    """What the reference's attention needs to know of its current forward."""

    phase: str = "full"  # "full", "choose" (full, then pick the kept keys) or "sparse"
    block: tuple[int, int] = (0, 0)
    key_positions: list[int] = field(default_factory=list)  # of the forward's keys, in order
    num_unstored: int = 0  # leading queries outside the block (Dream's scoring row)
    ratio: float = 1.0
    kept: dict[int, list[set[int]]] = field(default_factory=dict)  # layer -> per KV head


CURRENT = Pass()


def before_forward_for(p: DiffusionParams):
    """RefSeq's hook for one request: sets CURRENT before each of its passes' forwards. Kept
    keys are per twin (a guided request's twin has K/V of its own) and per block."""
    kept: list[dict[int, list[set[int]]]] = [{}, {}]

    def before_forward(twin: int, block: tuple[int, int], pass_in_block: int,
                       span: tuple[int, int, int, int]) -> None:
        global CURRENT
        start, end, seq_len, unstored = span
        if pass_in_block == 0:
            kept[twin] = {}
        phase = "full"
        if p.retention_ratio is not None and pass_in_block >= p.delay_step:
            phase = "choose" if pass_in_block == p.delay_step else "sparse"
        # RefSeq.forward's key order: the cached positions, then the pass's queries.
        cached = [i for i in range(seq_len) if not start + unstored <= i < end]
        CURRENT = Pass(phase, block, cached + list(range(start, end)), unstored,
                       p.retention_ratio or 1.0, kept[twin])

    return before_forward


def choose_kept(query: torch.Tensor, key: torch.Tensor, scaling: float) -> list[set[int]]:
    """Each KV head's kept candidate positions. query [1, H, q, D], key [1, Hkv, k, D]."""
    lo, hi = CURRENT.block
    group = query.shape[1] // key.shape[1]
    mean_q = query[0, :, CURRENT.num_unstored:].double().mean(1)  # [H, D]: the block's
    num_cached = len(CURRENT.key_positions) - query.shape[2]  # the rest: the pass's own
    candidates = [(j, pos) for j, pos in enumerate(CURRENT.key_positions[:num_cached])
                  if not lo <= pos < hi]  # (key index, position), positions ascending
    n_keep = min(len(candidates), max(1, int(len(candidates) * CURRENT.ratio)))
    kept = []
    for kv_head in range(key.shape[1]):
        keys = key[0, kv_head, [j for j, _ in candidates]].double()  # [C, D]
        heads = mean_q[kv_head * group:(kv_head + 1) * group]  # [group, D]
        scores = ((heads @ keys.T) * scaling).max(0).values.tolist()  # [C]
        pooled = [max(scores[max(c - 1, 0):c + 2]) for c in range(len(scores))]
        best = sorted(range(len(pooled)), key=lambda c: (-pooled[c], c))[:n_keep]
        kept.append({candidates[c][1] for c in best})
    return kept


def head_sparse_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          attention_mask: torch.Tensor | None, scaling: float,
                          dropout: float = 0.0, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention interface: query [1, H, q, D], key/value [1, Hkv, k, D]
    (rotated keys), attention_mask [1, 1, q, k] additive -> ([1, q, H, D], None)."""
    num_heads, num_kv_heads = query.shape[1], key.shape[1]
    group = num_heads // num_kv_heads
    mask = torch.zeros(1, num_heads, query.shape[2], key.shape[2], dtype=torch.float64)
    if attention_mask is not None:
        mask = mask + attention_mask
    if CURRENT.phase == "choose":
        CURRENT.kept[module.layer_idx] = choose_kept(query, key, scaling)
    elif CURRENT.phase == "sparse":
        lo, hi = CURRENT.block
        kept = CURRENT.kept[module.layer_idx]
        allowed = torch.tensor([[lo <= pos < hi or pos in kept[head // group]
                                 for pos in CURRENT.key_positions]
                                for head in range(num_heads)])  # [H, k]
        mask = mask.masked_fill(~allowed[None, :, None, :], -torch.inf)
    k = key.double().repeat_interleave(group, dim=1)  # [1, H, k, D]
    v = value.double().repeat_interleave(group, dim=1)
    probs = ((query.double() @ k.transpose(2, 3)) * scaling + mask).softmax(-1)
    return (probs @ v).transpose(1, 2).to(query.dtype).contiguous(), None


AttentionInterface.register(ATTENTION, head_sparse_attention)


def reference(hf, family, mask_id: int, prompt: list[int], p: DiffusionParams, seed: int
              ) -> tuple[list[int], int]:
    global CURRENT
    CURRENT = Pass()  # the prompt's pass attends as its mask says
    return reference_tokens(hf, family, mask_id, prompt, p, seed, before_forward_for(p))


# ---------------------------------------------------------------- fixtures


@pytest.fixture(scope="module", params=["llada", "dream"])
def family_setup(request, tmp_path_factory):
    """A family (Dream's tiny checkpoint has GQA: 2 query heads a KV head), its checkpoint,
    and transformers' model over it with the reference's attention."""
    family = next(f for f in FAMILIES if f.id == request.param)
    model_dir = Path(family.make(tmp_path_factory.mktemp(family.id), seed=3,
                                 **family.make_kwargs))
    hf = hf_model(family, model_dir)
    hf.set_attn_implementation(ATTENTION)
    return family, model_dir, hf


def sparse(ratio: float, delay: int = 1, **kwargs) -> DiffusionParams:
    return DiffusionParams(dllm_cache="dual", retention_ratio=ratio, delay_step=delay, **kwargs)


# ---------------------------------------------------------------- against the reference


# (delay 2 with blocks of 4: test_sparse_and_dense_requests_share_one_forward.)
SETTINGS = [
    sparse(0.3, gen_length=16, steps=16, block_length=8),
    sparse(0.2, 3, gen_length=16, steps=16, block_length=8, remasking="random"),
    # Blocks of 1 to 8 passes: some end before any sparse pass.
    sparse(0.4, gen_length=16, steps=16, block_length=8, confidence_threshold=0.1),
    sparse(0.4, gen_length=8, steps=8, block_length=4, cfg_scale=1.5),
]


@pytest.mark.parametrize("params", SETTINGS, ids=lambda p: f"g{p.gen_length}s{p.steps}"
                         f"b{p.block_length}-r{p.retention_ratio}-d{p.delay_step}"
                         f"-{p.remasking}-t{p.confidence_threshold}-cfg{p.cfg_scale}")
def test_sparse_engine_equals_the_reference_loop(family_setup, params):
    """Three requests (prompts of 1 to 12 tokens) joining two passes apart, so one chooses
    its keys while another attends sparsely: each equals its reference, same passes."""
    family, model_dir, hf = family_setup
    engine = make_engine(model_dir)
    prompts = random_prompts(3, engine.vocab_size - 2, seed=params.gen_length + params.steps,
                             lo=1, hi=12)
    results, _ = run(engine, [(prompt, params, 10 + i) for i, prompt in enumerate(prompts)],
                     gap=2)
    for i, prompt in enumerate(prompts):
        want, passes = reference(hf, family, engine.mask_token_id, prompt, params, 10 + i)
        got = results[f"r{i}"]
        assert got["tokens"] == want, f"request {i} (prompt of {len(prompt)})"
        assert got["passes"] == passes and got["finish"] == "length"


def test_sparse_and_dense_requests_share_one_forward(family_setup):
    """Sparse requests of different ratios and delays beside dual, prefix and uncached ones,
    joining at different passes of each other's blocks: each equals its own reference."""
    family, model_dir, hf = family_setup
    engine = make_engine(model_dir)
    prompts = random_prompts(5, engine.vocab_size - 2, seed=5, lo=2, hi=11)
    base = DiffusionParams(gen_length=16, steps=16, block_length=8)
    params = [sparse(0.3, gen_length=16, steps=16, block_length=8),
              with_cache(base, "dual"),
              sparse(0.6, 2, gen_length=12, steps=12, block_length=4),
              base,
              with_cache(base, "prefix")]
    requests = [(prompt, p, i) for i, (prompt, p) in enumerate(zip(prompts, params,
                                                                    strict=True))]
    results, forwarded = run(engine, requests, gap=2)
    assert max(forwarded) > min(forwarded)
    for i, (prompt, p, seed) in enumerate(requests):
        want, passes = reference(hf, family, engine.mask_token_id, prompt, p, seed)
        assert results[f"r{i}"]["tokens"] == want, f"request {i} ({p})"
        assert results[f"r{i}"]["passes"] == passes


# ---------------------------------------------------------------- the engine's side


def test_sparse_rows_skip_the_backend_and_keep_keys_for_one_block(family_setup):
    """The backend attends every query but those of passes after a choosing pass (never
    computed twice), a dual request's beside them included; a request holds [layers, KV
    heads, n_keep] kept positions, outside its block, from its choosing pass to its block's
    end."""
    _, model_dir, _ = family_setup
    engine = make_engine(model_dir)
    backend = engine.model_runner.backend
    layers = engine.model_runner.model.attention_layers()
    seen: list[int] = []
    dense_forward = backend.forward

    def spy(query, *args, **kwargs):
        seen.append(query.shape[0])
        return dense_forward(query, *args, **kwargs)

    backend.forward = spy
    p = sparse(0.5, 2, gen_length=16, steps=8, block_length=8)  # 4 passes a block
    prompt = random_prompts(1, engine.vocab_size - 2, seed=3, lo=9, hi=9)[0]
    engine.add_request("r0", prompt, SamplingParams(diffusion=p, ignore_eos=True, seed=0))
    dual = with_cache(DiffusionParams(gen_length=16, steps=8, block_length=8), "dual")
    engine.add_request("r1", prompt[:5], SamplingParams(diffusion=dual, ignore_eos=True))
    req = engine.get("r0")
    shapes, backend_tokens, forwarded = [], [], []
    while engine.has_unfinished():
        seen.clear()
        before = engine.total_stats.num_prefill_tokens
        block = req.block
        engine.step()
        forwarded.append(engine.total_stats.num_prefill_tokens - before)
        backend_tokens.append(sum(seen) // len(layers))
        assert all(n == seen[0] for n in seen)  # every layer alike
        shapes.append((block, [tuple(s.shape) for s in req.selections]))
        if req.selections:
            kept = req.selections[0]
            start = req.block_start
            assert not ((kept >= start) & (kept < start + 8)).any()
            assert (kept >= 0).all() and (kept < len(prompt) + 16).all()
    candidates = len(prompt) + 16 - 8
    held = [(len(layers), layers[0].num_kv_heads, candidates // 2)]
    # Per block: refresh, a full pass, the choosing pass, one sparse pass (the last pass of
    # block 0 starts block 1, whose kept keys are not chosen yet; block 1 ends the request).
    assert shapes == [(0, []), (0, []), (0, held), (0, []), (1, []), (1, []), (1, held),
                      (1, held)]
    # r0's sparse passes query its block (and Dream's scoring row); r1 is dual throughout.
    sparse_tokens = 8 + int(engine.model_runner.model.predicts_next_token)
    for step, (n, fwd) in enumerate(zip(backend_tokens, forwarded, strict=True)):
        assert n == fwd - (sparse_tokens if step in (3, 7) else 0), step
    assert forwarded[3] == forwarded[7] == 2 * sparse_tokens


# ---------------------------------------------------------------- agreement and counts


def test_full_retention_is_dual_and_agreement_is_recorded(family_setup):
    """retention_ratio 1.0 keeps every key: the dual cache's tokens exactly. Smaller ratios
    against caches off and the dual cache: token agreement and forward passes printed; the
    same passes and tokens forwarded as dual (sparsity changes what a pass reads, not what it
    queries); the smallest ratio changes some token."""
    family, model_dir, _ = family_setup
    base = DiffusionParams(gen_length=16, steps=8, block_length=8)  # 4 passes a block
    prompts = random_prompts(3, 120, seed=21, lo=5, hi=20)
    engine = make_engine(model_dir)
    tokens, forwarded, passes = {}, {}, {}
    variants = {mode: with_cache(base, mode) for mode in ("none", "dual")}
    variants |= {f"sparse {r}": sparse(r, gen_length=16, steps=8, block_length=8)
                 for r in (1.0, 0.5, 0.1)}
    for name, p in variants.items():
        results, steps = run(engine, [(prompt, p, i) for i, prompt in enumerate(prompts)])
        tokens[name] = [results[f"r{i}"]["tokens"] for i in range(len(prompts))]
        passes[name] = sum(r["passes"] for r in results.values())
        # Plus the prompt tokens a later run takes from the prefix cache instead.
        forwarded[name] = sum(steps) + sum(r["cached"] for r in results.values())
    total = sum(len(t) for t in tokens["none"])

    def agree(a: str, b: str) -> int:
        return sum(x == y for ra, rb in zip(tokens[a], tokens[b], strict=True)
                   for x, y in zip(ra, rb, strict=True))

    assert tokens["sparse 1.0"] == tokens["dual"]
    for name in ("sparse 1.0", "sparse 0.5", "sparse 0.1"):
        assert passes[name] == passes["dual"] == len(prompts) * base.steps
        assert forwarded[name] == forwarded["dual"]
        print(f"{family.id} {name}: {agree(name, 'none')}/{total} tokens agree with caches "
              f"off, {agree(name, 'dual')}/{total} with dual; {passes[name]} forward passes, "
              f"{forwarded[name]} tokens forwarded")
    assert agree("sparse 0.1", "dual") < total


# ---------------------------------------------------------------- parameters


@pytest.mark.parametrize("kwargs, field_name", [
    (dict(dllm_cache="dual", retention_ratio=0.0), "retention_ratio"),
    (dict(dllm_cache="dual", retention_ratio=1.5), "retention_ratio"),
    (dict(dllm_cache="dual", retention_ratio=-0.5), "retention_ratio"),
    (dict(retention_ratio=0.5), "retention_ratio"),
    (dict(dllm_cache="prefix", retention_ratio=0.5), "retention_ratio"),
    (dict(dllm_cache="dual", retention_ratio=0.5, delay_step=0), "delay_step"),
    (dict(delay_step=-1), "delay_step"),
    (dict(delay_step=1.5), "delay_step"),
])
def test_bad_sparsity_parameters_name_the_field(kwargs, field_name):
    with pytest.raises(ValueError, match=field_name):
        DiffusionParams(**kwargs)


def test_sparsity_on_the_wire():
    """The proto fields map both ways (floats as the decimals sent); a ratio without the dual
    cache is refused naming retention_ratio."""
    from engine_service.common.proto_convert import (
        diffusion_params_from_proto,
        diffusion_params_to_proto,
    )
    from nanoserve.v1 import nanoserve_pb2 as pb

    defaults = diffusion_params_from_proto(pb.DiffusionParams())
    assert defaults.retention_ratio is None and defaults.delay_step == 1
    p = sparse(0.3, 4)
    msg = diffusion_params_to_proto(p)
    assert msg.HasField("retention_ratio") and msg.delay_step == 4
    assert diffusion_params_from_proto(msg) == p
    assert diffusion_params_to_proto(DiffusionParams()) == pb.DiffusionParams()
    with pytest.raises(ValueError, match="retention_ratio"):
        diffusion_params_from_proto(pb.DiffusionParams(retention_ratio=0.5))
    with pytest.raises(ValueError, match="delay_step"):
        diffusion_params_from_proto(pb.DiffusionParams(dllm_cache="dual", delay_step=0))
