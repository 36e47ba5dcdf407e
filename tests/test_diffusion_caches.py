"""Fast-dLLM's dLLM caches ("prefix", "dual") in the diffusion engine, against a reference loop
over transformers' Llama (LLaDA) / Qwen2 (Dream) written here from the rules alone:

- the prompt's KV comes from one pass over the prompt alone, block-causal at KV-block
  granularity: a token of prompt block i attends (bidirectionally) to blocks 0..i only;
- a block's first pass (refresh) queries [P, L) and rewrites their KV;
- its other passes query [block_start, L) ("prefix") or [block_start, block_end) ("dual");
- every query attends to all L positions: its pass's fresh K/V for the queries, the cached
  K/V for the rest;
- Dream scores position i from row i - 1: when that row is before the queries it is queried
  too, its own fresh key unused (the cache keeps the old one).

Each pass feeds transformers only the query tokens, with explicit position ids, a non-causal
4-D mask and a DynamicCache holding the other positions' K/V (non-causal attention does not
care about key order); the prompt's pass uses a block-causal 4-D mask instead. The engine,
requests joining at different passes with different settings in one batch, must give the
same tokens. Also: a request takes from the prefix cache the full prompt blocks it shares
with an earlier prompt (the router's chained hashes; only recomputing the ones evicted
since) and gives the tokens it gives alone, the shared blocks are never rewritten, the
tokens forwarded per step are counted honestly, and every KV block is free (cached ones
evictable) after each test.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from transformers import DynamicCache

from engine_service import LLM, SamplingParams
from engine_service.common.block_hash import hash_prompt_blocks
from engine_service.common.sampling_params import DLLM_CACHES, DiffusionParams
from engine_service.diffusion.engine import DiffusionEngine
from tests.helpers import check_block_manager, random_prompts
from tests.test_diffusion_engine import unmask_block
from tests.test_diffusion_models import FAMILIES, Family, hf_model

BLOCK = 4  # kv_block_size: prompts of a few tokens span several blocks
ENGINE = dict(device="cpu", dtype="float32", num_kv_blocks=128, max_model_len=256,
              kv_block_size=BLOCK)
_ENGINES: list[DiffusionEngine] = []


# ---------------------------------------------------------------- the reference


def _layer_kv(cache: DynamicCache, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    if hasattr(cache, "layers"):
        return cache.layers[layer].keys, cache.layers[layer].values
    return cache.key_cache[layer], cache.value_cache[layer]  # transformers < 4.56


class RefSeq:
    """One sequence of the reference: its tokens and, per layer, the K/V its cache holds at
    each position ([1, Hkv, L, D], transformers' layout, rotated keys)."""

    def __init__(self, model, tokens: list[int], num_prompt: int) -> None:
        self.model = model
        self.tokens = tokens
        self.num_prompt = num_prompt
        cfg = model.config
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        shape = (1, cfg.num_key_value_heads, len(tokens), head_dim)
        self.kv = [(torch.full(shape, torch.nan), torch.full(shape, torch.nan))
                   for _ in range(cfg.num_hidden_layers)]
        params = inspect.signature(model.forward).parameters
        self._cache_arg = "cache" if "cache" in params else "past_key_values"

    @torch.no_grad()
    def forward(self, start: int, end: int, seq_len: int, num_unstored: int) -> torch.Tensor:
        """Logits [end - start, V] of queries start..end-1 over positions [0, seq_len): the
        stored queries' fresh K/V (written back), the cached K/V of every other position."""
        stored = list(range(start + num_unstored, end))
        others = [i for i in range(seq_len) if not start + num_unstored <= i < end]
        cache = DynamicCache()
        if others:
            for layer, (k, v) in enumerate(self.kv):
                assert not k[:, :, others].isnan().any(), "read a position never computed"
                cache.update(k[:, :, others], v[:, :, others], layer)
        q_len = end - start
        mask = torch.zeros(1, 1, q_len, len(others) + q_len)
        mask[..., len(others):len(others) + num_unstored] = -torch.inf
        out = self.model(input_ids=torch.tensor([self.tokens[start:end]]), attention_mask=mask,
                         position_ids=torch.arange(start, end)[None], use_cache=True,
                         **{self._cache_arg: cache})
        for layer, (k, v) in enumerate(self.kv):
            fresh_k, fresh_v = _layer_kv(cache, layer)
            k[:, :, stored] = fresh_k[:, :, len(others) + num_unstored:]
            v[:, :, stored] = fresh_v[:, :, len(others) + num_unstored:]
        return out.logits[0]

    @torch.no_grad()
    def prompt_pass(self, block_size: int) -> None:
        """The prompt's K/V from one pass over it alone, block-causal: a token of KV block i
        attends to blocks 0..i (a 4-D mask)."""
        n = self.num_prompt
        block = torch.arange(n) // block_size  # [n]
        mask = torch.where(block[None, :] <= block[:, None], 0.0, -torch.inf)  # [n, n]
        cache = DynamicCache()
        self.model(input_ids=torch.tensor([self.tokens[:n]]), attention_mask=mask[None, None],
                   position_ids=torch.arange(n)[None], use_cache=True,
                   **{self._cache_arg: cache})
        for layer, (k, v) in enumerate(self.kv):
            fresh_k, fresh_v = _layer_kv(cache, layer)
            k[:, :, :n], v[:, :, :n] = fresh_k, fresh_v


def query_span(mode: str, num_prompt: int, length: int, start: int, end: int, refresh: bool,
               shift: int) -> tuple[int, int, int]:
    """(first query, end, unstored leading queries) of a pass, by the rules above."""
    if mode == "none":
        return 0, length, 0
    lo, hi = ((num_prompt, length) if refresh else
              (start, length) if mode == "prefix" else (start, end))
    extra = 1 if shift and start - 1 < lo else 0
    return lo - extra, hi, extra


def reference_tokens(model, family: Family, mask_id: int, prompt: list[int],
                     p: DiffusionParams, seed: int, before_forward: Callable | None = None
                     ) -> tuple[list[int], int]:
    """(generated tokens, passes) of one request by the block-wise loop, temperature 0, with
    p.dllm_cache's semantics. `before_forward(twin, block, pass_in_block, span)`, if given,
    hears of each pass's forward before it runs: the twin's index, the block (start, end)
    and RefSeq.forward's (start, end, seq_len, num_unstored) (tests/test_diffusion_sparsity.py)."""
    num_prompt, shift, n = len(prompt), int(family.predicts_next_token), p.block_length
    x = list(prompt) + [mask_id] * p.gen_length
    twins = [RefSeq(model, x, num_prompt)]
    if p.cfg_scale > 0:
        twins.append(RefSeq(model, [mask_id] * num_prompt + x[num_prompt:], num_prompt))
    if p.dllm_cache != "none":
        for twin in twins:
            twin.prompt_pass(BLOCK)
    passes = 0
    for b in range(p.num_blocks):
        start = num_prompt + b * n
        end = start + n
        base, extra = divmod(n, p.steps_per_block)
        schedule = [base + (i < extra) for i in range(p.steps_per_block)]
        i = 0
        while mask_id in x[start:end]:
            lo, hi, unstored = query_span(p.dllm_cache, num_prompt, len(x), start, end, i == 0,
                                          shift)
            rows = []
            for k, twin in enumerate(twins):
                twin.tokens[num_prompt:] = x[num_prompt:]
                if before_forward is not None:
                    before_forward(k, (start, end), i, (lo, hi, len(x), unstored))
                logits = twin.forward(lo, hi, len(x), unstored).double()
                rows.append(logits[start - shift - lo:end - shift - lo])  # [n, V]
            block = rows[0]
            if p.cfg_scale > 0:
                block = rows[1] + (p.cfg_scale + 1) * (rows[0] - rows[1])
            unmask_block(x, start, block, mask_id, p, seed, passes, b, schedule[i])
            i += 1
            passes += 1
    return x[num_prompt:], passes


# ---------------------------------------------------------------- fixtures and helpers


@pytest.fixture(scope="module", params=["llada", "dream"])
def family_setup(request, tmp_path_factory):
    family = next(f for f in FAMILIES if f.id == request.param)
    model_dir = Path(family.make(tmp_path_factory.mktemp(family.id), seed=3,
                                 **family.make_kwargs))
    return family, model_dir, hf_model(family, model_dir)


def make_engine(model_dir: Path, **overrides) -> DiffusionEngine:
    engine = LLM(str(model_dir), **dict(ENGINE, **overrides)).engine
    _ENGINES.append(engine)
    return engine


@pytest.fixture(autouse=True)
def every_block_free_after():
    """Each test's engines end with every KV block free (cached prompt blocks count: they
    are evictable) and a consistent block manager."""
    yield
    while _ENGINES:
        engine = _ENGINES.pop()
        bm = engine.block_manager
        assert not engine.has_unfinished()
        assert bm.num_free_blocks == bm.num_blocks and bm.all_free()
        check_block_manager(bm)


def run(engine: DiffusionEngine, requests: list[tuple[list[int], DiffusionParams, int]],
        gap: int = 0) -> tuple[dict[str, dict], list[int]]:
    """Requests added `gap` steps apart (0: all at once), run to the end: per request id
    r<i> its tokens, passes and cached tokens; and the tokens each step forwarded."""
    results = {f"r{i}": dict(tokens=[], passes=0, cached=None, finish=None)
               for i in range(len(requests))}
    forwarded: list[int] = []

    def step() -> None:
        before = engine.total_stats.num_prefill_tokens
        for out in engine.step():
            r = results[out.request_id]
            r["tokens"] += out.new_token_ids
            r["passes"], r["cached"] = out.num_forward_passes, out.num_cached_tokens
            r["finish"] = out.finish_reason
        forwarded.append(engine.total_stats.num_prefill_tokens - before)

    for i, (prompt, params, seed) in enumerate(requests):
        engine.add_request(f"r{i}", prompt, SamplingParams(diffusion=params, ignore_eos=True,
                                                           seed=seed))
        for _ in range(gap):
            step()
    while engine.has_unfinished():
        step()
    return results, forwarded


def with_cache(p: DiffusionParams, mode: str) -> DiffusionParams:
    return DiffusionParams(**dict(vars(p), dllm_cache=mode))


# ---------------------------------------------------------------- against the reference


SETTINGS = [
    DiffusionParams(gen_length=16, steps=8, block_length=8),
    DiffusionParams(gen_length=12, steps=12, block_length=4),
    DiffusionParams(gen_length=16, steps=4, block_length=16),
    DiffusionParams(gen_length=16, steps=16, block_length=8, remasking="random"),
    DiffusionParams(gen_length=16, steps=16, block_length=8, confidence_threshold=0.02),
    DiffusionParams(gen_length=8, steps=4, block_length=4, cfg_scale=1.5),
]


@pytest.mark.parametrize("mode", ["prefix", "dual"])
@pytest.mark.parametrize("params", SETTINGS, ids=lambda p: f"g{p.gen_length}s{p.steps}"
                         f"b{p.block_length}-{p.remasking}-t{p.confidence_threshold}"
                         f"-cfg{p.cfg_scale}")
def test_cached_engine_equals_the_reference_loop(family_setup, params, mode):
    """Three requests joining two passes apart (prompts of 1 to 12 tokens: partial and whole
    KV blocks), each equal to its reference, with the same passes."""
    family, model_dir, hf = family_setup
    engine = make_engine(model_dir)
    params = with_cache(params, mode)
    prompts = random_prompts(3, engine.vocab_size - 2, seed=params.gen_length + params.steps,
                             lo=1, hi=12)
    results, _ = run(engine, [(prompt, params, 10 + i) for i, prompt in enumerate(prompts)],
                     gap=2)
    fewest_passes = params.gen_length
    for i, prompt in enumerate(prompts):
        want, passes = reference_tokens(hf, family, engine.mask_token_id, prompt, params,
                                        10 + i)
        got = results[f"r{i}"]
        assert got["tokens"] == want, f"request {i} (prompt of {len(prompt)})"
        assert got["passes"] == passes and got["finish"] == "length"
        fewest_passes = min(fewest_passes, passes)
    if params.confidence_threshold is not None:  # some pass unmasked several positions
        assert fewest_passes < params.gen_length


def test_modes_and_settings_share_one_forward(family_setup):
    """none, prefix and dual requests with different settings, joining at different passes
    of each other's blocks, in the same steps: each equals its own reference."""
    family, model_dir, hf = family_setup
    engine = make_engine(model_dir)
    prompts = random_prompts(5, engine.vocab_size - 2, seed=5, lo=2, hi=11)
    params = [with_cache(SETTINGS[0], "dual"), with_cache(SETTINGS[1], "prefix"),
              SETTINGS[4], with_cache(SETTINGS[4], "dual"), with_cache(SETTINGS[5], "prefix")]
    requests = [(prompt, p, i) for i, (prompt, p) in enumerate(zip(prompts, params,
                                                                    strict=True))]
    results, forwarded = run(engine, requests, gap=3)
    assert max(forwarded) > min(forwarded)  # steps of different shapes
    for i, (prompt, p, seed) in enumerate(requests):
        want, passes = reference_tokens(hf, family, engine.mask_token_id, prompt, p, seed)
        assert results[f"r{i}"]["tokens"] == want, f"request {i} ({p.dllm_cache})"
        assert results[f"r{i}"]["passes"] == passes


# ---------------------------------------------------------------- the prefix cache


def alone(model_dir: Path, prompt: list[int], params: DiffusionParams) -> list[int]:
    """The tokens of one request on a fresh engine."""
    return run(make_engine(model_dir), [(prompt, params, 0)])[0]["r0"]["tokens"]


@pytest.mark.parametrize("mode", ["prefix", "dual"])
def test_shared_prompt_prefix_takes_the_cached_blocks(family_setup, mode):
    """Prompt blocks are hashed as the router hashes them (chained: block i's KV depends only
    on blocks 0..i). Later requests take from the prefix cache exactly the full blocks their
    prompt shares with the first one (num_cached_tokens, fewer tokens forwarded) and give
    the tokens they give alone on a fresh engine; a prompt differing in its first token takes
    none. The shared blocks are never rewritten."""
    family, model_dir, hf = family_setup
    engine = make_engine(model_dir)
    bm = engine.block_manager
    params = DiffusionParams(gen_length=8, steps=4, block_length=4, dllm_cache=mode)
    prompt = random_prompts(1, engine.vocab_size - 2, seed=11, lo=13, hi=13)[0]
    want, _ = reference_tokens(hf, family, engine.mask_token_id, prompt, params, 0)

    first, first_forwarded = run(engine, [(prompt, params, 0)])
    assert first["r0"]["tokens"] == want and first["r0"]["cached"] == 0
    hashes = hash_prompt_blocks(prompt, BLOCK)  # 3 full blocks of the 13 tokens
    assert [(e.kind, e.block_hashes) for e in bm.take_events()] == [("stored", hashes)]
    block_ids = [bm.hash_to_block[h] for h in hashes]
    kv = engine.model_runner.kv_cache
    kept = kv[:, :, block_ids].clone()

    # At once: the same prompt twice (3 blocks hit), one sharing the first two blocks (its
    # third differs), one differing in its first token (no hit).
    vocab = engine.vocab_size - 2
    two = prompt[:9] + [(prompt[9] + 1) % vocab] + prompt[10:]
    none = [(prompt[0] + 1) % vocab] + prompt[1:]
    again, again_forwarded = run(engine, [(prompt, params, 0), (prompt, params, 0),
                                          (two, params, 0), (none, params, 0)])
    assert [again[f"r{i}"]["cached"] for i in range(4)] == [3 * BLOCK, 3 * BLOCK, 2 * BLOCK, 0]
    assert again["r0"]["tokens"] == again["r1"]["tokens"] == want
    assert again["r2"]["tokens"] == alone(model_dir, two, params)
    assert again["r3"]["tokens"] == alone(model_dir, none, params)
    # Each forwards its uncached prompt tokens in the first step: 3 + 3 + 2 blocks fewer.
    assert again_forwarded[0] == 4 * first_forwarded[0] - 8 * BLOCK
    assert [(e.kind, e.block_hashes) for e in bm.take_events()] == [
        ("stored", hash_prompt_blocks(two, BLOCK)[2:] + hash_prompt_blocks(none, BLOCK))]
    assert torch.equal(kv[:, :, block_ids], kept), "a shared prompt block was rewritten"
    assert all(bm.hash_to_block[h] == b for h, b in zip(hashes, block_ids, strict=True))


def test_guidance_twins_hit_only_their_prompt_blocks(family_setup):
    """Guidance twins' prompts are all masks: a short prompt's twin shares the first blocks
    of a longer one's, but never past its own full prompt blocks (its generated positions
    are rewritten every pass), so the longer request, still running, keeps its KV: both
    equal their references."""
    family, model_dir, hf = family_setup
    engine = make_engine(model_dir)
    params = DiffusionParams(gen_length=8, steps=4, block_length=4, cfg_scale=1.5,
                             dllm_cache="prefix")
    long, short = random_prompts(2, engine.vocab_size - 2, seed=15, lo=12, hi=12)
    short = short[:5]  # its twin's canvas: 13 masks, the long twin's first 3 blocks
    results, _ = run(engine, [(long, params, 0), (short, params, 1)], gap=1)
    for i, prompt in enumerate((long, short)):
        want, _ = reference_tokens(hf, family, engine.mask_token_id, prompt, params, i)
        assert results[f"r{i}"]["tokens"] == want, f"request {i}"
    assert results["r1"]["cached"] == 0  # its own prompt differs from the long one's


def test_evicted_prompt_blocks_are_recomputed(family_setup):
    """After another request evicts the tail of a cached prompt (the free list reuses a
    finished request's tail blocks first), the same prompt takes the blocks still cached and
    computes only the rest: same tokens, fewer cached tokens, a `removed` event."""
    family, model_dir, hf = family_setup
    engine = make_engine(model_dir, num_kv_blocks=16, max_model_len=64)
    bm = engine.block_manager
    params = DiffusionParams(gen_length=8, steps=4, block_length=4, dllm_cache="prefix")
    prompt = random_prompts(1, engine.vocab_size - 2, seed=12, lo=13, hi=13)[0]
    want, _ = reference_tokens(hf, family, engine.mask_token_id, prompt, params, 0)
    hashes = hash_prompt_blocks(prompt, BLOCK)
    assert run(engine, [(prompt, params, 0)])[0]["r0"]["tokens"] == want
    bm.take_events()
    # 14 of the 16 blocks: the 13 uncached ones, then the prompt's last cached block.
    filler = random_prompts(1, engine.vocab_size - 2, seed=13, lo=8, hi=8)[0]
    filler_params = DiffusionParams(gen_length=48, steps=3, block_length=16)
    run(engine, [(filler, filler_params, 0)])
    assert [(e.kind, e.block_hashes) for e in bm.take_events()] == [("removed", hashes[2:])]
    results, _ = run(engine, [(prompt, params, 0)])
    assert results["r0"]["cached"] == 2 * BLOCK
    assert results["r0"]["tokens"] == want


def test_caches_off_never_share_blocks(family_setup):
    """dllm_cache none: every pass rewrites the canvas, so no block is ever registered or
    shared (no KV event), whatever cached requests ran before."""
    family, model_dir, _ = family_setup
    engine = make_engine(model_dir)
    bm = engine.block_manager
    prompt = random_prompts(1, engine.vocab_size - 2, seed=14, lo=12, hi=12)[0]
    params = DiffusionParams(gen_length=8, steps=4, block_length=4)
    run(engine, [(prompt, with_cache(params, "prefix"), 0)])
    stored = bm.cached_block_hashes()
    bm.take_events()
    results, _ = run(engine, [(prompt, params, 0), (prompt, params, 0)])
    assert results["r0"]["cached"] == results["r1"]["cached"] == 0
    assert bm.take_events() == [] and bm.cached_block_hashes() == stored


# ---------------------------------------------------------------- counts


def expected_forwarded(num_prompt: int, num_cached: int, p: DiffusionParams,
                       shift: int) -> int:
    """Tokens one request forwards over its passes, low_confidence (steps_per_block passes a
    block), computed from the rules: the prompt's uncached tokens once, refreshes, the
    block's other passes."""
    length, n = num_prompt + p.gen_length, p.block_length
    if p.dllm_cache == "none":
        return p.steps * length
    # The prompt pass; Dream's scoring row before the first refresh's queries.
    total = num_prompt - num_cached + shift
    for b in range(p.num_blocks):
        start = num_prompt + b * n
        rest = (length - start) if p.dllm_cache == "prefix" else n
        total += (length - num_prompt) + (p.steps_per_block - 1) * (rest + shift)
    return total


def test_agreement_with_caches_off(family_setup):
    """prefix and dual against caches off on the same requests: token agreement and the
    forward-pass and forwarded-token counts, printed; passes equal the schedule's, forwarded
    tokens follow the rules, and caches forward fewer."""
    family, model_dir, _ = family_setup
    shift = int(family.predicts_next_token)
    base = DiffusionParams(gen_length=32, steps=16, block_length=8)
    prompts = random_prompts(4, 120, seed=21, lo=5, hi=20)
    engine = make_engine(model_dir)
    tokens, forwarded = {}, {}
    for mode in DLLM_CACHES:
        p = with_cache(base, mode)
        results, steps = run(engine, [(prompt, p, i) for i, prompt in enumerate(prompts)])
        assert all(r["passes"] == p.steps for r in results.values())
        assert len(steps) == p.steps  # all joined at once: one step a pass
        tokens[mode] = [results[f"r{i}"]["tokens"] for i in range(len(prompts))]
        forwarded[mode] = sum(steps)
        assert forwarded[mode] == sum(
            expected_forwarded(len(q), results[f"r{i}"]["cached"], p, shift)
            for i, q in enumerate(prompts))
    total = sum(len(t) for t in tokens["none"])
    for mode in ("prefix", "dual"):
        agree = sum(a == b for x, y in zip(tokens[mode], tokens["none"], strict=True)
                    for a, b in zip(x, y, strict=True))
        assert 0 <= agree <= total
        print(f"{family.id} {mode}: {agree}/{total} tokens agree with caches off; "
              f"{forwarded[mode]} tokens forwarded vs {forwarded['none']} "
              f"({forwarded[mode] / forwarded['none']:.0%}), {base.steps} passes each")
    assert forwarded["dual"] < forwarded["prefix"] < forwarded["none"]


# ---------------------------------------------------------------- parameters


def test_bad_dllm_cache_names_the_field():
    for bad in ("full", "", None, "Prefix"):
        with pytest.raises(ValueError, match="dllm_cache"):
            DiffusionParams(dllm_cache=bad)
    assert DiffusionParams().dllm_cache == "none"


def test_dllm_cache_from_the_wire():
    from engine_service.common.proto_convert import diffusion_params_from_proto
    from nanoserve.v1 import nanoserve_pb2 as pb

    assert diffusion_params_from_proto(pb.DiffusionParams()).dllm_cache == "none"
    for mode in DLLM_CACHES:
        assert diffusion_params_from_proto(pb.DiffusionParams(dllm_cache=mode)) == \
            DiffusionParams(dllm_cache=mode)
    with pytest.raises(ValueError, match="dllm_cache"):
        diffusion_params_from_proto(pb.DiffusionParams(dllm_cache="both"))
