"""Helpers shared by the engine tests: prompts, the transformers reference, spies."""

from __future__ import annotations

import random

import torch

from engine_service import SamplingParams
from engine_service.block_manager import BlockManager


def random_prompts(n: int, vocab: int = 300, seed: int = 0, lo: int = 1,
                   hi: int = 40) -> list[list[int]]:
    """n prompts of random ids in [0, vocab); the shortest (lo) and longest (hi) lengths are
    always among them."""
    rng = random.Random(seed)
    lens = ([lo, hi] + [rng.randint(lo, hi) for _ in range(n - 2)])[:n]
    return [[rng.randrange(vocab) for _ in range(k)] for k in lens]


def shared_prefix_prompts(seed: int, shared_len: int = 40, n: int = 4,
                          vocab: int = 500) -> list[list[int]]:
    """n prompts sharing their first `shared_len` tokens, each with its own 1..20 more."""
    rng = random.Random(seed)
    shared = [rng.randrange(vocab) for _ in range(shared_len)]
    return [shared + [rng.randrange(vocab) for _ in range(rng.randint(1, 20))]
            for _ in range(n)]


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, **kw)


def hf_greedy(hf_model, prompt: list[int], max_tokens: int, eos_token_id=None) -> list[int]:
    """transformers' greedy continuation; with eos_token_id None it never stops early."""
    ids = torch.tensor([prompt], device=hf_model.device)
    with torch.no_grad():
        out = hf_model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                max_new_tokens=max_tokens, eos_token_id=eos_token_id,
                                pad_token_id=0)
    out = out[0, len(prompt):].tolist()
    if eos_token_id is None:
        assert len(out) == max_tokens, "transformers stopped early: eos was not turned off"
    return out


def spy_schedule(llm, pick) -> list:
    """Everything `pick(scheduler_output)` yields, for every step the engine schedules from
    now on."""
    seen: list = []
    original = llm.engine.scheduler.schedule

    def spy(*args):
        out = original(*args)
        seen.extend(pick(out))
        return out

    llm.engine.scheduler.schedule = spy
    return seen


def spy_preemptions(llm) -> list[str]:
    """The ids of every sequence the engine's scheduler preempts from now on."""
    return spy_schedule(llm, lambda out: (s.seq_id for s in out.preempted))


def spy_prefill_chunks(llm) -> list[int]:
    """The sizes of the prompt chunks that did not finish their prompt (no token sampled)."""
    return spy_schedule(llm, lambda out: (s.num_new_tokens for s in out.scheduled
                                          if not s.sample))


def check_block_manager(bm: BlockManager) -> None:
    """Raise AssertionError if a BlockManager invariant is broken (survives -O)."""
    for block in bm.blocks:
        in_free = block.block_id in bm.free_blocks
        if block.ref_count < 0 or (block.ref_count == 0) != in_free:
            raise AssertionError(f"block {block.block_id}: ref_count={block.ref_count}, "
                                 f"in free list={in_free}")
        if block.block_hash is not None and \
                bm.hash_to_block.get(block.block_hash) != block.block_id:
            raise AssertionError(f"block {block.block_id} has a hash the table lacks")
    for block_hash, block_id in bm.hash_to_block.items():
        if bm.blocks[block_id].block_hash != block_hash:
            raise AssertionError(f"hash table entry {block_hash} -> {block_id} is stale")
