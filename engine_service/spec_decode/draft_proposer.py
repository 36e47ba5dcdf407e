"""Draft-model proposals: a smaller model with the target's vocabulary runs K decode steps
ahead of the target. Its paged KV cache is indexed by the target's block ids, so a sequence's
blocks (and the block manager's budget) hold both caches; the scheduler allocates the slots of
the proposed tokens before the draft writes them.

The draft draws with the request's own settings, seed and output positions, the draws the
target verifies with, so a draft that agrees with the target is accepted under sampling too.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from engine_service.cuda_graphs import CudaGraphRunner
from engine_service.scheduler import ScheduledSeq
from engine_service.sequence import Sequence
from engine_service.tp_worker import encode_draft
from models.attention_metadata import make_attention_metadata
from models.config import ModelConfig
from models.host_copy import to_device
from models.kv_cache import allocate_kv_cache, kv_bytes_per_block
from models.registry import build_model


class DraftProposer:
    def __init__(self, runner) -> None:
        config = runner.config
        assert config.speculative_model is not None
        self.runner = runner
        self.model_config = ModelConfig.from_dir(config.speculative_model)
        target_vocab = runner.model_config.vocab_size
        if self.model_config.vocab_size != target_vocab:
            raise ValueError(f"speculative_model must have the target's vocab_size "
                             f"({target_vocab}), got {self.model_config.vocab_size}")
        self.model = build_model(self.model_config, config.speculative_model, runner.backend,
                                 runner.device, runner.dtype, config.seed, config.load_format)
        # Tokens one propose() call may feed the draft to catch up on (new prompts, tokens
        # the target added): the activation budget the target was profiled with.
        self.max_catch_up_tokens = config.max_num_batched_tokens
        self.graphs: CudaGraphRunner | None = None  # see use_graphs

    def may_propose(self, seqs: list[Sequence]) -> bool:
        """A draft model proposes for every sequence."""
        return bool(seqs)

    @property
    def kv_bytes_per_block(self) -> int:
        return kv_bytes_per_block(self.model, self.runner.block_size, self.runner.dtype)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """The draft's cache, held by its attention layers."""
        allocate_kv_cache(self.model, num_blocks, self.runner.block_size, self.runner.dtype,
                          self.runner.device)

    def use_graphs(self, capture: bool = True) -> None:
        """Run the draft's passes from CUDA graphs (once its KV cache is allocated): decode
        graphs for the batch sizes that speculate and, on the Triton backend, verify-shaped
        ones (rows of up to 1 + K tokens) for the catch-up pass. capture=False: the same
        static-buffer forwards, run eagerly (how CPU tests check the staging)."""
        cfg = self.runner.config
        self.graphs = CudaGraphRunner(
            self.runner, capture, model=self.model,
            max_batch_size=min(cfg.max_num_seqs, cfg.speculative_disable_by_batch_size))

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], limits: list[int]) -> list[list[int]]:
        """Up to limits[i] tokens for seqs[i]: one pass over the tokens each draft cache
        lacks (sampling at the last), then one single-token pass per further proposal; the
        tokens stay on the device until the last pass."""
        rows, budget = [], self.max_catch_up_tokens
        for seq, k in zip(seqs, limits, strict=True):
            start = self._num_valid(seq)
            num_new = seq.num_tokens - start
            if k and num_new <= budget:  # else: no proposal this step, catch up later
                rows.append((seq, k, start))
                budget -= num_new
        proposals: dict[int, list[int]] = {}
        if rows:
            tp = self.runner.tp
            with tp.run(encode_draft(rows)) if tp is not None else contextlib.nullcontext():
                drafted = self.draft(rows)  # [max_k, len(rows)] on the host
            for r, (seq, k, _) in enumerate(rows):
                tokens = [drafted[j][r] for j in range(k)]
                # The cache now holds the tokens and the proposals it was fed (all but last).
                seq.draft_kv = (seq.num_preemptions, seq.num_tokens, tokens[:-1])
                proposals[id(seq)] = tokens
        return [proposals.get(id(seq), []) for seq in seqs]

    def _num_valid(self, seq: Sequence) -> int:
        """Leading tokens of seq whose draft KV is in its blocks: what the last propose()
        fed, up to the first proposal the target did not keep (none after a preemption)."""
        state = seq.draft_kv
        if state is None or state[0] != seq.num_preemptions:
            return 0
        _, covered, fed = state
        tokens = seq.token_ids
        n = 0
        while n < len(fed) and covered + n < len(tokens) - 1 and tokens[covered + n] == fed[n]:
            n += 1
        return min(covered + n, len(tokens) - 1)

    def draft(self, rows: list[tuple[Sequence, int, int]]) -> list[list[int]]:
        """The passes of one proposal for (seq, k, start) rows, on every tensor-parallel
        rank (workers get rank 0's rows by message): [max k][rows] drafted tokens. Rank 0
        draws them and the others receive each pass's by broadcast, their next inputs."""
        first = [ScheduledSeq(seq, len(seq.token_ids) - start, True, start)  # type: ignore
                 for seq, _, start in rows]
        sampled = self._sample(first, self._catch_up(first))
        steps = [sampled]  # [rows] each, on the device
        active = list(range(len(rows)))
        for j in range(1, max(k for _, k, _ in rows)):
            keep = [i for i, r in enumerate(active) if rows[r][1] > j]  # into `sampled`
            active = [active[i] for i in keep]
            items = [ScheduledSeq(rows[r][0], 1, True,  # type: ignore
                                  len(rows[r][0].token_ids) - 1 + j) for r in active]
            sampled = self._sample(items, self._next_pass(items, sampled, keep))
            steps.append(sampled if len(active) == len(rows) else
                         self._scatter(sampled, active, len(rows)))
        return torch.stack(steps).tolist() if self.runner.rank == 0 else []

    def _catch_up(self, first: list[ScheduledSeq]) -> torch.Tensor:
        """The pass over the tokens each row's draft cache lacks, all on the host: hidden
        states at each row's last token [rows, hidden]. From a verify graph when every row
        fits one (steady state: a token or two), else eagerly (whole prompts)."""
        graphs, runner = self.graphs, self.runner
        if graphs is not None and graphs.fits_verify(len(first),
                                                     [item.num_new_tokens for item in first]):
            num_tokens = runner.prepare_verify(first, graphs)
            hidden = graphs.replay_verify(len(first), num_tokens)  # [num_tokens, hidden]
            return hidden[graphs.last_token_indices(len(first))]
        input_ids, positions, meta, logits_indices = runner.prepare_inputs(first)
        return self.model(input_ids, positions, meta)[logits_indices]

    def _next_pass(self, items: list[ScheduledSeq], prev: torch.Tensor, keep: list[int]
                   ) -> torch.Tensor:
        """A single-token pass: row i's input is the last pass's draw prev[keep[i]] (prev:
        [last pass's rows] int64, on the device). Hidden states [rows, hidden]."""
        graphs, runner = self.graphs, self.runner
        if graphs is not None and prev.shape[0] <= graphs.max_bs:
            graphs.sampled[:prev.shape[0]].copy_(prev)  # where the decode graphs read it
            runner.prepare_decode(items, graphs, keep)
            return graphs.replay(len(items))
        pos = [item.start for item in items]
        meta = make_attention_metadata([1] * len(items), [p + 1 for p in pos],
                                       [item.seq.block_table for item in items],
                                       runner.block_size, runner.device)
        ids = prev[to_device(keep, torch.long, runner.device)]  # [rows]
        return self.model(ids, to_device(pos, torch.long, runner.device), meta)

    def _scatter(self, sampled: torch.Tensor, active: list[int], n: int) -> torch.Tensor:
        """[n] int64: `sampled` at rows `active`, 0 at the rows that proposed enough."""
        device = self.runner.device
        full = torch.zeros(n, dtype=torch.long, device=device)
        full[to_device(active, torch.long, device)] = sampled
        return full

    def _sample(self, items: list[ScheduledSeq], hidden: torch.Tensor) -> torch.Tensor:
        """The draft's draw at each row's output position with the row's own settings (rank
        0), sent to the other ranks."""
        runner = self.runner
        logits = self.model.compute_logits(hidden)  # collective under TP
        if runner.rank == 0:
            sampling = runner.prepare_sampling(items, [])
            sampling.max_num_logprobs = -1  # a proposal's logprobs are never reported
            sampled = runner.sampler(logits, sampling).sampled_token_ids
        else:
            sampled = torch.empty(len(items), dtype=torch.long, device=runner.device)
        if runner.config.tensor_parallel_size > 1:
            dist.broadcast(sampled, src=0)
        return sampled
