"""The offline LLM against transformers on the same tiny random Qwen3, token for token."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine_service import LLM, SamplingParams
from engine_service.cuda_graphs import CudaGraphRunner, DecodeInputs
from tests.helpers import greedy as ignore_eos_greedy
from tests.helpers import hf_greedy, random_prompts, shared_prefix_prompts, spy_preemptions

MAX_TOKENS = 12


def make_prompts(n: int, vocab: int, seed: int, min_len: int = 1, max_len: int = 70):
    return random_prompts(n, vocab, seed, min_len, max_len)


@pytest.fixture(scope="module")
def vocab(tiny_model_dir):
    import json

    return json.loads((tiny_model_dir / "config.json").read_text())["vocab_size"]


@pytest.fixture(scope="module")
def reference(hf_model, vocab):
    """HF greedy continuations, cached per prompt."""
    cache: dict[tuple[int, ...], list[int]] = {}

    def get(prompt: list[int], n: int = MAX_TOKENS) -> list[int]:
        key = (*prompt, -n)
        if key not in cache:
            cache[key] = hf_greedy(hf_model, prompt, n)
        return cache[key]

    return get


def greedy(n: int = MAX_TOKENS, **kw) -> SamplingParams:
    return ignore_eos_greedy(n, **kw)


def make_llm(model_dir, **kw) -> LLM:
    args = dict(device="cpu", dtype="float32", num_kv_blocks=256, kv_block_size=16,
                max_model_len=256)
    args.update(kw)
    return LLM(str(model_dir), **args)


def check_against_hf(llm: LLM, prompts, reference) -> list:
    outs = llm.generate(prompts, greedy(), use_tqdm=False)
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.token_ids == reference(prompt), f"prompt of {len(prompt)} tokens diverged"
        assert out.finish_reason == "length"
    return outs


@pytest.mark.parametrize("block_size", [4, 16])
def test_greedy_matches_transformers(tiny_model_dir, reference, vocab, block_size):
    prompts = make_prompts(9, vocab, seed=block_size)
    llm = make_llm(tiny_model_dir, kv_block_size=block_size, num_kv_blocks=2048 // block_size)
    check_against_hf(llm, prompts, reference)


def test_prefix_cache_hits_give_identical_output(tiny_model_dir, reference, vocab):
    prompts = shared_prefix_prompts(seed=1, n=8, vocab=vocab)
    llm = make_llm(tiny_model_dir, kv_block_size=4, num_kv_blocks=512)
    first = check_against_hf(llm, prompts, reference)
    second = check_against_hf(llm, prompts, reference)
    assert all(o.num_cached_tokens >= 40 for o in second), [o.num_cached_tokens for o in second]
    assert [o.token_ids for o in first] == [o.token_ids for o in second]


def test_preemption_under_tiny_kv_budget(tiny_model_dir, reference, vocab):
    prompts = make_prompts(8, vocab, seed=7, min_len=20, max_len=40)
    # 24 blocks of 4 tokens: two sequences of ~52 tokens do not fit together.
    llm = make_llm(tiny_model_dir, kv_block_size=4, num_kv_blocks=24, max_model_len=96)
    preempted = spy_preemptions(llm)
    check_against_hf(llm, prompts, reference)
    assert preempted, "the KV budget was meant to force preemption"


def test_chunked_prefill(tiny_model_dir, reference, vocab):
    prompts = make_prompts(8, vocab, seed=3, min_len=30, max_len=70)
    llm = make_llm(tiny_model_dir, max_num_batched_tokens=16, kv_block_size=4,
                   num_kv_blocks=512)
    check_against_hf(llm, prompts, reference)


def test_eos_stops_like_transformers(tiny_model_dir, hf_model, vocab, tmp_path):
    """A random model rarely picks its real eos, so make a token it does pick the eos:
    the same weights with eos_token_id set to the 4th greedy token of the first prompt."""
    import json
    import shutil

    prompts = make_prompts(8, vocab, seed=11)
    eos = hf_greedy(hf_model, prompts[0], MAX_TOKENS)[3]
    model_dir = tmp_path / "eos-model"
    shutil.copytree(tiny_model_dir, model_dir)
    for name in ("config.json", "generation_config.json"):
        cfg = json.loads((model_dir / name).read_text())
        cfg["eos_token_id"] = eos
        (model_dir / name).write_text(json.dumps(cfg))
    llm = make_llm(model_dir)
    assert llm.engine.eos_token_ids == [eos]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS),
                        use_tqdm=False)
    for prompt, out in zip(prompts, outs, strict=True):
        ref = hf_greedy(hf_model, prompt, MAX_TOKENS, eos_token_id=eos)
        assert out.token_ids == ref
        assert out.finish_reason == ("stop" if ref[-1] == eos else "length")
    assert outs[0].finish_reason == "stop" and len(outs[0].token_ids) <= 4


def test_seeded_sampling_reproducible_and_top_k1_is_greedy(tiny_model_dir, vocab):
    llm = make_llm(tiny_model_dir)
    prompts = make_prompts(4, vocab, seed=5)
    sampled = SamplingParams(temperature=1.0, seed=123, max_tokens=10, ignore_eos=True)
    a = llm.generate(prompts, sampled, use_tqdm=False)
    b = llm.generate(prompts[::-1], sampled, use_tqdm=False)[::-1]  # other batch order
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    other = llm.generate(prompts, SamplingParams(temperature=1.0, seed=124, max_tokens=10,
                                                 ignore_eos=True), use_tqdm=False)
    assert [o.token_ids for o in a] != [o.token_ids for o in other]
    k1 = llm.generate(prompts, SamplingParams(temperature=0.8, top_k=1, seed=9, max_tokens=10,
                                              ignore_eos=True), use_tqdm=False)
    g = llm.generate(prompts, greedy(10), use_tqdm=False)
    assert [o.token_ids for o in k1] == [o.token_ids for o in g]


def test_text_prompts_stop_strings_and_logprobs(tiny_model_dir):
    llm = make_llm(tiny_model_dir)
    full = llm.generate("Hello world", greedy(16), use_tqdm=False)[0]
    assert full.text == llm.tokenizer.decode(full.token_ids)
    assert len(full.text) > 4
    stop = full.text[2:4]
    cut = llm.generate("Hello world", greedy(16, stop=[stop]), use_tqdm=False)[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    assert cut.text == full.text[:full.text.index(stop)]
    lp = llm.generate("Hello world", greedy(4, logprobs=3), use_tqdm=False)[0]
    assert len(lp.logprobs) == 4
    for token, (chosen, top_ids, top_lps) in zip(lp.token_ids, lp.logprobs, strict=True):
        assert top_ids[0] == token and abs(top_lps[0] - chosen) < 1e-5  # greedy = top-1
        assert len(top_ids) == 3 and top_lps == sorted(top_lps, reverse=True)


@pytest.mark.parametrize(("prompt", "params", "field"), [
    ([], None, "prompt"),
    ([1] * 5000, None, "prompt"),
    ([10**7], None, "prompt_token_ids"),
    ([-1], None, "prompt_token_ids"),
    ([1, 2], dict(temperature=-0.5), "temperature"),
    ([1, 2], dict(top_p=0.0), "top_p"),
    ([1, 2], dict(top_p=1.5), "top_p"),
    ([1, 2], dict(max_tokens=0), "max_tokens"),
    ([1, 2], dict(stop=["x"] * 17), "stop"),
])
def test_bad_input_names_field_and_leaves_no_state(tiny_model_dir, vocab, prompt, params,
                                                   field):
    llm = make_llm(tiny_model_dir, max_model_len=256)
    with pytest.raises(ValueError, match=field):
        sp = SamplingParams(**(params or {}))
        llm.generate([[1, 2, 3], prompt], sp, use_tqdm=False)
    assert not llm.engine.has_unfinished()
    ok = llm.generate([[1, 2, 3]], greedy(3), use_tqdm=False)[0]
    assert len(ok.token_ids) == 3


@pytest.mark.parametrize(("kwargs", "field"), [
    (dict(kv_block_size=0), "kv_block_size"),
    (dict(max_model_len=10**6), "max_model_len"),
    (dict(num_kv_blocks=1, kv_block_size=4), "num_kv_blocks"),
    (dict(attention_backend="flash-attn", kv_block_size=16), "kv_block_size"),
    (dict(device="tpu"), "device"),
])
def test_impossible_config_rejected(tiny_model_dir, kwargs, field):
    with pytest.raises(ValueError, match=field):
        make_llm(tiny_model_dir, **kwargs)


def test_async_scheduling_overlaps_and_matches_the_synchronous_loop(tiny_model_dir, vocab):
    """The next step is launched before the previous step's tokens are read, and that changes
    no token: greedy, seeded sampling, logprobs, stop tokens, min_tokens and (forcing a
    drain) penalties, under chunked prefill and preemption."""
    from engine_service.model_runner import LaunchedStep

    prompts = make_prompts(10, vocab, seed=21, min_len=5, max_len=50)
    params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=0.9, seed=7, max_tokens=15, ignore_eos=True),
              SamplingParams(temperature=0.7, top_p=0.8, seed=1, max_tokens=9, logprobs=2,
                             ignore_eos=True),
              SamplingParams(temperature=1.0, seed=3, max_tokens=20, min_tokens=4,
                             stop_token_ids=list(range(0, vocab, 7))),
              SamplingParams(temperature=0.8, seed=5, max_tokens=4, ignore_eos=True,
                             repetition_penalty=1.3, frequency_penalty=0.5)] * 2
    kw = dict(kv_block_size=4, num_kv_blocks=40, max_num_batched_tokens=32, max_model_len=96)
    sync = make_llm(tiny_model_dir, async_scheduling=False, **kw)
    want = sync.generate(prompts, params, use_tqdm=False)

    llm = make_llm(tiny_model_dir, **kw)
    launched: list[LaunchedStep] = []
    overlapped: list[bool] = []  # per result read: was a later step launched already?
    launch, result = llm.engine.model_runner.launch, LaunchedStep.result

    def spy_launch(batch, eos, token_masks=None):
        launched.append(launch(batch, eos, token_masks))
        return launched[-1]

    def spy_result(self):
        overlapped.append(launched[-1] is not self)
        return result(self)

    llm.engine.model_runner.launch = spy_launch
    preempted = spy_preemptions(llm)
    try:
        LaunchedStep.result = spy_result
        got = llm.generate(prompts, params, use_tqdm=False)
    finally:
        LaunchedStep.result = result
    for w, g in zip(want, got, strict=True):
        assert (g.token_ids, g.finish_reason, g.stop_reason) == \
            (w.token_ids, w.finish_reason, w.stop_reason)
        # Batches differ between the loops, so float sums may round differently.
        assert [lp[1] for lp in g.logprobs] == [lp[1] for lp in w.logprobs]
        flat = [[lp[0], *lp[2]] for lp in g.logprobs]
        assert flat == [pytest.approx([lp[0], *lp[2]], abs=1e-4) for lp in w.logprobs]
    assert any(o.finish_reason == "stop" for o in got), "a stop token was meant to fire"
    assert preempted, "the KV budget was meant to force preemption"
    # launch N+1 came before result N, except while a penalty row needed a drain
    assert len(launched) - 1 <= len(overlapped) <= len(launched)  # the last may be all waste
    assert sum(overlapped) > len(overlapped) // 2, overlapped


def test_warm_up_scratch_writes_do_not_leak_into_outputs(tiny_model_dir, reference, vocab):
    """The GPU start-up warm-up writes KV into blocks nobody owns yet; requests served
    afterwards (which get those blocks) must be unaffected."""
    llm = make_llm(tiny_model_dir, kv_block_size=4, num_kv_blocks=600, max_model_len=256)
    llm.engine.model_runner._warm_up()
    assert llm.engine.model_runner.kv_cache[:, :, :8].abs().sum() > 0, "warm-up wrote nothing"
    check_against_hf(llm, make_prompts(6, vocab, seed=31), reference)


def test_start_up_objects_are_frozen_out_of_the_collector(tiny_model_dir):
    """After start-up the engine's long-lived objects sit in the permanent generation, so
    a full collection in the middle of generation does not walk them."""
    import gc

    gc.unfreeze()  # whatever an earlier engine in this process froze
    assert gc.get_freeze_count() == 0
    llm = make_llm(tiny_model_dir)
    try:
        assert gc.get_freeze_count() > 1000
    finally:
        llm.engine.shutdown()


# ---------------------------------------------------------------- decode staged for graphs


def _stage_decodes(llm: LLM) -> list[int]:
    """Run decode-only steps through the CUDA-graph path's staged inputs and static-buffer
    forward, replayed eagerly (CPU); returns the batch sizes it replayed."""
    runner = llm.engine.model_runner
    runner.graph_runner = CudaGraphRunner(runner, capture=False)
    replayed: list[int] = []
    original = runner.graph_runner.replay

    def spy(n: int):
        replayed.append(n)
        return original(n)

    runner.graph_runner.replay = spy
    return replayed


@pytest.mark.parametrize("block_size", [4, 16])
def test_decode_from_staged_graph_inputs_matches_transformers(tiny_model_dir, reference, vocab,
                                                              block_size):
    """Every decode step reads one staged buffer: tokens pending on the device, slots,
    padding to the graph's batch size (3 rows replay the 4-row graph), new blocks."""
    prompts = make_prompts(7, vocab, seed=20 + block_size)
    llm = make_llm(tiny_model_dir, kv_block_size=block_size, num_kv_blocks=1024 // block_size,
                   max_num_seqs=3)
    replayed = _stage_decodes(llm)
    check_against_hf(llm, prompts, reference)
    assert 3 in replayed and 1 in replayed, replayed


def test_staged_decode_under_preemption_and_chunks(tiny_model_dir, reference, vocab):
    prompts = make_prompts(8, vocab, seed=7, min_len=20, max_len=40)
    llm = make_llm(tiny_model_dir, kv_block_size=4, num_kv_blocks=24, max_model_len=96,
                   max_num_batched_tokens=16)
    preempted = spy_preemptions(llm)
    replayed = _stage_decodes(llm)
    check_against_hf(llm, prompts, reference)
    assert preempted and replayed


def test_decode_inputs_stage_layout():
    """One copy fills the host-written regions and pads the rest of the graph batch; the
    device-written `sampled` region is left as it was."""
    inputs = DecodeInputs(max_bs=8, max_blocks=5, device=torch.device("cpu"))
    v = inputs.dev
    v["sampled"].copy_(torch.arange(100, 108))
    v["block_tables"].fill_(7)
    tables = np.array([[3, 4], [5, 6], [9, 0]], dtype=np.int32)
    inputs.stage(4, [11, 0, 13], [8, 1, 10], [5, 6, 7], [21, 22, -1], tables)
    assert v["sampled"].tolist() == list(range(100, 108))
    assert v["input_ids"][:3].tolist() == [11, 0, 13]
    assert v["token_index"][:4].tolist() == [8, 1, 10, 8]
    assert v["positions"][:4].tolist() == [5, 6, 7, 0]
    assert v["slot_mapping"][:4].tolist() == [21, 22, -1, -1]
    assert v["seq_lens"][:4].tolist() == [6, 7, 8, 1]
    assert v["block_tables"][:3, :2].tolist() == tables.tolist()
    assert v["block_tables"][3:].unique().tolist() == [7]  # padding rows: old ids, not copied
    assert inputs.token_candidates[v["token_index"][:3]].tolist() == [11, 101, 13]
