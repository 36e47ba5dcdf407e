"""Tensor parallelism on GPUs (NCCL, CUDA graphs on every rank): TP=2 and TP=4 give the same
greedy and seeded-sampled tokens as TP=1, in float32, on the tiny model (4 heads, 2 KV heads:
TP=2 splits the KV heads, TP=4 replicates them) and on a tiny Qwen3-MoE (8 experts sharded
over the ranks).

The TP engines size their KV cache from the free GPU memory, so run this file alone, not
beside other GPU tests under pytest-xdist (benchmarks.gpu_suite does): under `-n 8` the
other workers can leave no room for KV blocks."""

from __future__ import annotations

import gc
import random

import pytest
import torch

from engine_service import LLM, SamplingParams
from tests.test_families import MOE, save_checkpoint

pytestmark = pytest.mark.timeout(600)
COMMON = dict(device="cuda", dtype="float32", kv_block_size=16, max_model_len=256,
              max_num_seqs=16)


def _prompts() -> list[list[int]]:
    rng = random.Random(0)
    shared = [rng.randrange(384) for _ in range(40)]
    prompts = [shared + [rng.randrange(384) for _ in range(rng.randint(1, 20))]
               for _ in range(4)]
    return prompts + [[rng.randrange(384) for _ in range(n)] for n in (1, 9, 33, 120)]


def _memory_share(world_size: int, gib: int) -> float:
    """gpu_memory_utilization that leaves the engine about `gib` GiB a GPU: the share counts
    what other processes hold (pytest-xdist workers share GPU 0), so it is that much over it."""
    in_use = max(total - free for free, total in
                 (torch.cuda.mem_get_info(i) for i in range(world_size)))
    total = torch.cuda.get_device_properties(0).total_memory
    return min(0.9, (in_use + gib * 2**30) / total)


def _passes(llm: LLM, prompts) -> list[list]:
    """Greedy twice (the second hits the prefix cache), then seeded temperature draws: all
    rows temperature-only (at TP > 1 every rank draws over its vocab shard and tp_argmax
    combines them), then with one row asking for logprobs (the logits are
    gathered and rank 0 samples)."""
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    seeded = [SamplingParams(temperature=0.9, max_tokens=16, ignore_eos=True, seed=i)
              for i in range(len(prompts))]
    with_logprobs = seeded[:-1] + [SamplingParams(temperature=0.9, max_tokens=16,
                                                  ignore_eos=True, seed=99, logprobs=1)]
    return [llm.generate(prompts, sp, use_tqdm=False)
            for sp in (greedy, greedy, seeded, with_logprobs)]


@pytest.fixture(scope="module")
def tiny_moe_dir(tmp_path_factory):
    return save_checkpoint(tmp_path_factory.mktemp("moe"), "Qwen3MoeForCausalLM",
                           dict(MOE, norm_topk_prob=True))


@pytest.mark.parametrize("family", ["dense", "moe"])
@pytest.mark.parametrize("world_size", [2, 4])
def test_tp_tokens_equal_tp1(tiny_model_dir, tiny_moe_dir, world_size, family):
    if torch.cuda.device_count() < world_size:
        pytest.skip(f"needs {world_size} GPUs, found {torch.cuda.device_count()}")
    model = str(tiny_model_dir if family == "dense" else tiny_moe_dir)
    prompts = _prompts()
    # TP=1 first and gone before the TP group exists (it is process-wide).
    ref_llm = LLM(model, num_kv_blocks=256, **COMMON)
    ref = _passes(ref_llm, prompts)
    del ref_llm
    gc.collect()
    torch.cuda.empty_cache()

    # No --num-kv-blocks: every rank profiles, and they agree on the smallest count. A budget
    # of ~3 GiB (less the CUDA and NCCL context) keeps the block count of this tiny model
    # (4 KiB per block and rank) in the hundreds of thousands.
    tp = LLM(model, tensor_parallel_size=world_size,
             gpu_memory_utilization=_memory_share(world_size, 3), **COMMON)
    try:
        assert tp.engine.model_runner.graph_runner is not None  # decode runs from graphs
        got = _passes(tp, prompts)
    finally:
        tp.engine.shutdown()
    for r_pass, g_pass in zip(ref, got, strict=True):
        assert [o.token_ids for o in g_pass] == [o.token_ids for o in r_pass]
    assert all(o.num_cached_tokens >= 32 for o in got[1][:4]), "second pass missed the cache"
