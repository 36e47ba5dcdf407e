"""The engine on a GPU: float32 tokens identical to transformers on the tiny model, CUDA
graphs identical to eager, and every family in bf16 teacher-forced against transformers on
the same random weights."""

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
def test_float32_batch1_greedy_matches_transformers(tiny_model_dir, hf_model, enforce_eager):
    """One request at a time: every decode step is batch 1 (the most-split attention
    launches)."""
    vocab = json.loads((tiny_model_dir / "config.json").read_text())["vocab_size"]
    llm = LLM(str(tiny_model_dir), device="cuda", dtype="float32", num_kv_blocks=512,
              max_model_len=512, attention_backend="triton", enforce_eager=enforce_eager)
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


# One shape per family for the bf16 check: the benchmark presets where transformers can
# build them quickly, smaller stand-ins for Mistral, Qwen2 and the MoE (Qwen3-30B-A3B's
# 30B random parameters would take minutes to initialise on the host).
_SMALL = dict(hidden_size=1024, num_hidden_layers=8, num_attention_heads=16,
              num_key_value_heads=4, intermediate_size=3072, rms_norm_eps=1e-6,
              max_position_embeddings=4096, hidden_act="silu", torch_dtype="bfloat16")
FAMILY_CONFIGS = {
    "qwen3": "qwen3-0.6b",
    "llama": "llama-3.2-1b",
    "mistral": dict(_SMALL, architectures=["MistralForCausalLM"], model_type="mistral",
                    vocab_size=32768, head_dim=128, rope_theta=1e6, sliding_window=None,
                    tie_word_embeddings=False),
    "qwen2": dict(_SMALL, architectures=["Qwen2ForCausalLM"], model_type="qwen2",
                  vocab_size=151936, rope_theta=1e6, use_sliding_window=False,
                  tie_word_embeddings=True),
    "qwen3_moe": dict(_SMALL, architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe",
                      vocab_size=151936, head_dim=128, rope_theta=1e6, num_experts=64,
                      num_experts_per_tok=8, moe_intermediate_size=256, norm_topk_prob=True,
                      decoder_sparse_step=1, mlp_only_layers=[0], tie_word_embeddings=False),
}


@pytest.fixture(scope="module", params=list(FAMILY_CONFIGS))
def family_dir(request, tmp_path_factory):
    """A family's shape with transformers' own random init (std 0.02), saved in bf16."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from benchmarks.model_configs import PRESETS

    cfg = FAMILY_CONFIGS[request.param]
    cfg = PRESETS[cfg] if isinstance(cfg, str) else cfg
    out = tmp_path_factory.mktemp(request.param)
    (out / "config.json").write_text(json.dumps(cfg))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(out))
    model.to(torch.bfloat16).save_pretrained(out)
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


def test_bf16_teacher_forced_argmax_agreement(family_dir):
    prompts = _prompts(32, 10000, seed=11, lo=64, hi=256)
    ref16, ref32 = _hf_logits(family_dir, prompts)
    llm = LLM(str(family_dir), device="cuda", dtype="bfloat16", num_kv_blocks=2048,
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
