"""CUDA graphs for pure-decode steps.

A decode step launches a few hundred small kernels; replaying them as one graph removes
the launch overhead that otherwise dominates small batches. One graph per batch size in
`graph_batch_sizes`, all sharing one memory pool, fed through static input buffers. A batch
of n rows replays the smallest graph of >= n rows; padded rows store nothing (slot -1)
and their outputs are dropped.
"""

from __future__ import annotations

import logging

import torch

from models.attention_metadata import AttentionMetadata

logger = logging.getLogger(__name__)


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    sizes = [1, 2, 4, 8] + list(range(16, 513, 16))
    return [s for s in sizes if s < max_num_seqs] + [min(max_num_seqs, 512)]


class CudaGraphRunner:
    def __init__(self, runner) -> None:
        self.model = runner.model
        cfg = runner.config
        dev = runner.device
        self.batch_sizes = graph_batch_sizes(cfg.max_num_seqs)
        self.max_bs = self.batch_sizes[-1]
        self.max_seq_len = cfg.max_model_len
        max_blocks = cfg.max_blocks_per_seq
        hidden = runner.model_config.hidden_size
        # Static buffers every graph reads from / writes to.
        self.input_ids = torch.zeros(self.max_bs, dtype=torch.long, device=dev)
        self.positions = torch.zeros(self.max_bs, dtype=torch.long, device=dev)
        self.slot_mapping = torch.full((self.max_bs,), -1, dtype=torch.long, device=dev)
        self.seq_lens = torch.ones(self.max_bs, dtype=torch.int32, device=dev)
        self.cu_seqlens_q = torch.arange(self.max_bs + 1, dtype=torch.int32, device=dev)
        self.block_tables = torch.zeros(self.max_bs, max_blocks, dtype=torch.int32, device=dev)
        self.output = torch.zeros(self.max_bs, hidden, dtype=runner.dtype, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._capture()

    def _meta(self, bs: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:bs], cu_seqlens_q=self.cu_seqlens_q[:bs + 1],
            seq_lens=self.seq_lens[:bs], block_tables=self.block_tables[:bs],
            max_query_len=1, max_seq_len=self.max_seq_len, seq_lens_cpu=None,
            cu_seqlens_q_cpu=None, decode_only=True)

    @torch.inference_mode()
    def _capture(self) -> None:
        pool = None
        for bs in reversed(self.batch_sizes):  # largest first, so the pool fits all
            meta = self._meta(bs)
            # Warm-up outside the graph: Triton compiles and autotunes here.
            self.output[:bs] = self.model(self.input_ids[:bs], self.positions[:bs], meta)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.output[:bs] = self.model(self.input_ids[:bs], self.positions[:bs], meta)
            if pool is None:
                pool = graph.pool()
            self.graphs[bs] = graph
        torch.cuda.synchronize()
        logger.info("captured CUDA graphs for decode batch sizes %s", self.batch_sizes)

    def can_run(self, meta: AttentionMetadata) -> bool:
        return meta.decode_only and meta.slot_mapping.shape[0] <= self.max_bs

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor,
            meta: AttentionMetadata) -> torch.Tensor:
        n = input_ids.shape[0]
        bs = next(b for b in self.batch_sizes if b >= n)
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(meta.slot_mapping)
        self.slot_mapping[n:bs].fill_(-1)
        self.seq_lens[:n].copy_(meta.seq_lens)
        self.seq_lens[n:bs].fill_(1)
        width = meta.block_tables.shape[1]
        self.block_tables[:n, :width].copy_(meta.block_tables)
        self.graphs[bs].replay()
        return self.output[:n]
