"""The engine on a GPU: float32 tokens identical to transformers on the tiny model, CUDA
graphs identical to eager, and the Qwen3-0.6B shape in bf16 teacher-forced against
transformers on the same random weights."""

from __future__ import annotations

import json

import pytest
import torch

from engine_service import LLM, SamplingParams
from engine_service.scheduler import ScheduledSeq
from engine_service.sequence import Sequence
from tests.helpers import hf_greedy, random_prompts

MAX_TOKENS = 16


def _prompts(n: int, vocab: int, seed: int, lo: int = 1, hi: int = 90) -> list[list[int]]:
    return random_prompts(n, vocab, seed, lo, hi)


@pytest.mark.parametrize("block_size", [16, 256])
@pytest.mark.parametrize("enforce_eager", [True, False])
def test_float32_greedy_matches_transformers(tiny_model_dir, hf_model, block_size, enforce_eager):
    vocab = json.loads((tiny_model_dir / "config.json").read_text())["vocab_size"]
    llm = LLM(str(tiny_model_dir), device="cuda", dtype="float32", kv_block_size=block_size,
              num_kv_blocks=4096 // block_size + 64, max_model_len=512,
              attention_backend="triton", enforce_eager=enforce_eager)
    # Up to block_size + 90 tokens, so every block size has prompts with a full block; the
    # second pass hits the prefix cache wherever a prompt has one.
    prompts = _prompts(12, vocab, seed=block_size, hi=block_size + 90)
    for second in (False, True):
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                                                    ignore_eos=True), use_tqdm=False)
        for p, o in zip(prompts, outs, strict=True):
            assert o.token_ids == hf_greedy(hf_model, p, MAX_TOKENS)
            if second and len(p) > block_size:
                assert o.num_cached_tokens >= block_size


@pytest.mark.parametrize("enforce_eager", [True, False])
def test_float32_batch1_greedy_matches_transformers(tiny_model_dir, hf_model, enforce_eager,
                                                    monkeypatch):
    """One request at a time: every decode step is batch 1, where the norms and SiLU-and-mul
    run inside the GEMVs (models/kernels/fused_gemv.py). The tiny model's shapes are not in
    the measured table, so the test puts them there (default configs)."""
    from models.kernels import fused_gemv

    cfg = json.loads((tiny_model_dir / "config.json").read_text())
    vocab, hidden = cfg["vocab_size"], cfg["hidden_size"]
    qkv_rows = (cfg["num_attention_heads"] + 2 * cfg["num_key_value_heads"]) * cfg["head_dim"]
    for rows, silu_mul in ((qkv_rows, False), (2 * cfg["intermediate_size"], True)):
        monkeypatch.setitem(fused_gemv.TUNED, (rows, hidden, 4, silu_mul),
                            fused_gemv.default_fused_config(rows, hidden, torch.float32,
                                                            silu_mul))
    llm = LLM(str(tiny_model_dir), device="cuda", dtype="float32", num_kv_blocks=512,
              max_model_len=512, attention_backend="triton", enforce_eager=enforce_eager)
    layer = llm.engine.model_runner.model.model.layers[0]
    probe = torch.zeros(1, layer.input_layernorm.weight.shape[0], device="cuda")
    assert layer._norms_into_gemvs(probe), "the batch-1 fused path is not taken"
    for prompt in _prompts(4, vocab, seed=21):
        out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                                                    ignore_eos=True), use_tqdm=False)[0]
        assert out.token_ids == hf_greedy(hf_model, prompt, MAX_TOKENS)
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks


def test_cuda_graphs_equal_eager(tiny_model_dir):
    vocab = json.loads((tiny_model_dir / "config.json").read_text())["vocab_size"]
    prompts = _prompts(37, vocab, seed=3)  # 37 rows: replays a padded graph
    results = []
    for eager in (True, False):
        llm = LLM(str(tiny_model_dir), device="cuda", dtype="float32", num_kv_blocks=2048,
                  max_model_len=512, enforce_eager=eager)
        assert (llm.engine.model_runner.graph_runner is None) == eager
        sp = SamplingParams(temperature=0.8, seed=7, max_tokens=24, ignore_eos=True)
        results.append([o.token_ids for o in llm.generate(prompts, sp, use_tqdm=False)])
        del llm
    assert results[0] == results[1]


def test_async_scheduling_equals_synchronous_on_the_device(tiny_model_dir):
    """Step N+1 reads step N's tokens on the device, launched before the host saw them:
    the same tokens as the synchronous loop, with graphs, sampling and a small cache."""
    vocab = json.loads((tiny_model_dir / "config.json").read_text())["vocab_size"]
    prompts = _prompts(40, vocab, seed=5)
    params = [SamplingParams(temperature=0.8 if i % 3 else 0, seed=i, max_tokens=8 + i % 17,
                             ignore_eos=True, logprobs=1 if i % 5 == 0 else None)
              for i in range(len(prompts))]
    results = []
    for async_scheduling in (False, True):
        llm = LLM(str(tiny_model_dir), device="cuda", dtype="float32", kv_block_size=16,
                  num_kv_blocks=48, max_model_len=512, max_num_batched_tokens=256,
                  async_scheduling=async_scheduling)
        outs = llm.generate(prompts, params, use_tqdm=False)
        results.append([o.token_ids for o in outs])
        assert [len(o.token_ids) for o in outs] == [p.max_tokens for p in params]
        del llm
    assert results[0] == results[1]


@pytest.fixture(scope="module")
def qwen3_06b_dir(tmp_path_factory):
    """Qwen3-0.6B shape with transformers' own random init (std 0.02), saved in bf16."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from benchmarks.model_configs import PRESETS

    out = tmp_path_factory.mktemp("qwen3-0.6b")
    cfg = {k: v for k, v in PRESETS["qwen3-0.6b"].items()
           if k not in ("architectures", "model_type")}
    torch.manual_seed(0)
    Qwen3ForCausalLM(Qwen3Config(**cfg)).to(torch.bfloat16).save_pretrained(out)
    return out


def _hf_logits(model_dir, prompts: list[list[int]]) -> tuple[list, list]:
    """transformers' logits per prompt position in bf16 and, same weights, in float32."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).cuda().eval()
    with torch.no_grad():
        ref16 = [hf(torch.tensor([p], device="cuda")).logits[0].float() for p in prompts]
        hf.float()
        ref32 = [hf(torch.tensor([p], device="cuda")).logits[0].float() for p in prompts]
    return ref16, ref32


def _argmax_agreement(what: str, mine: torch.Tensor, ref16: list, ref32: list
                      ) -> tuple[float, float, float]:
    """(rate, floor, decided). Raw agreement is bounded by bf16 itself on random weights
    (near-tied logits flip under any bf16 rounding: transformers' bf16 run disagrees with its
    own float32 run as often), so besides `rate` (agreement with transformers-bf16) this gives
    `floor` (transformers-bf16 vs transformers-fp32) and `decided`: agreement at the positions
    bf16 can decide, where the float32 top-1/top-2 margin exceeds 2x the bf16-vs-fp32 logit
    error there."""
    a16 = torch.cat([r.argmax(-1) for r in ref16])
    a32 = torch.cat([r.argmax(-1) for r in ref32])
    top2 = torch.cat([r.topk(2, dim=-1).values for r in ref32])
    margin = top2[:, 0] - top2[:, 1]
    noise = torch.cat([(x - y).pow(2).mean(-1).sqrt() for x, y in zip(ref16, ref32,
                                                                     strict=True)])
    decidable = margin > 2 * noise
    rate = (mine == a16).float().mean().item()
    floor = (a16 == a32).float().mean().item()
    decided = (mine[decidable] == a16[decidable]).float().mean().item()
    print(f"{what} argmax agreement: {rate:.4f} over {mine.numel()} positions; "
          f"transformers bf16 vs its own float32: {floor:.4f}; at the "
          f"{decidable.float().mean().item():.0%} decidable positions: {decided:.4f}")
    return rate, floor, decided


def test_qwen3_06b_bf16_teacher_forced_argmax_agreement(qwen3_06b_dir):
    prompts = _prompts(32, 10000, seed=11, lo=64, hi=256)
    ref16, ref32 = _hf_logits(qwen3_06b_dir, prompts)
    llm = LLM(str(qwen3_06b_dir), device="cuda", dtype="bfloat16", num_kv_blocks=2048,
              max_model_len=1024, enforce_eager=True)
    runner, bm = llm.engine.model_runner, llm.engine.block_manager
    ours = []
    for i, p in enumerate(prompts):
        seq = Sequence(f"tf-{i}", p, SamplingParams())
        bm.allocate(seq, len(p))
        try:
            with torch.inference_mode():
                ids, pos, meta, _ = runner.prepare_inputs([ScheduledSeq(seq, len(p), True, 0)])
                hidden = runner.model(ids, pos, meta)
                ours.append(runner.model.compute_logits(hidden).argmax(-1))
        finally:
            bm.free(seq)
    rate, floor, decided = _argmax_agreement("bf16 teacher-forced", torch.cat(ours), ref16,
                                             ref32)
    assert rate >= floor - 0.01  # as often as transformers-bf16 agrees with its fp32 self
    assert decided >= 0.98


def _batch1_decode_argmax(llm: LLM, prompts: list[list[int]]) -> torch.Tensor:
    """Teacher-forced batch-1 decode: each prompt's first half as one prefill, then one
    position a step; the argmax at every decoded position."""
    runner, bm = llm.engine.model_runner, llm.engine.block_manager
    ours = []
    for i, p in enumerate(prompts):
        half = len(p) // 2
        seq = Sequence(f"tf1-{i}", p, SamplingParams())
        bm.allocate(seq, len(p))
        try:
            with torch.inference_mode():
                ids, pos, meta, _ = runner.prepare_inputs([ScheduledSeq(seq, half, True, 0)])
                runner.model(ids, pos, meta)  # fills the cache for positions < half
                for start in range(half, len(p)):
                    ids, pos, meta, _ = runner.prepare_inputs(
                        [ScheduledSeq(seq, 1, True, start)])
                    hidden = runner.model(ids, pos, meta)  # [1, hidden]: batch-1 decode
                    ours.append(runner.model.compute_logits(hidden).argmax(-1))
        finally:
            bm.free(seq)
    return torch.cat(ours)


def test_qwen3_06b_bf16_batch1_decode_argmax_agreement(qwen3_06b_dir, monkeypatch):
    """The batch-1 decode path with the norms and SiLU-and-mul inside the GEMVs agrees with
    transformers at >= 98% of decidable positions, and at least as often (within a point) as
    the unfused decode path does on the same positions (its shapes taken out of the table).
    Step-by-step bf16 decode drifts a little more than one prefill, so the prefill test's
    floor is not the bar here: the unfused path measured 0.9622 against a floor of 0.9726."""
    from models.kernels import fused_gemv

    prompts = _prompts(16, 10000, seed=12, lo=96, hi=160)
    ref16, ref32 = _hf_logits(qwen3_06b_dir, prompts)
    refs16 = [r[len(p) // 2:] for r, p in zip(ref16, prompts, strict=True)]
    refs32 = [r[len(p) // 2:] for r, p in zip(ref32, prompts, strict=True)]
    llm = LLM(str(qwen3_06b_dir), device="cuda", dtype="bfloat16", num_kv_blocks=2048,
              max_model_len=1024, enforce_eager=True)
    layer = llm.engine.model_runner.model.model.layers[0]
    probe = torch.zeros(1, layer.input_layernorm.weight.shape[0], dtype=torch.bfloat16,
                        device="cuda")
    assert layer._norms_into_gemvs(probe), "the batch-1 fused path is not taken"
    fused_rate, _, fused_decided = _argmax_agreement(
        "bf16 batch-1 decode (fused)", _batch1_decode_argmax(llm, prompts), refs16, refs32)
    for key in [k for k in fused_gemv.TUNED if k[1] == 1024]:  # the 0.6B shapes
        monkeypatch.delitem(fused_gemv.TUNED, key)
    assert not layer._norms_into_gemvs(probe)
    unfused_rate, _, _ = _argmax_agreement(
        "bf16 batch-1 decode (unfused)", _batch1_decode_argmax(llm, prompts), refs16, refs32)
    assert fused_decided >= 0.98
    assert fused_rate >= unfused_rate - 0.01
