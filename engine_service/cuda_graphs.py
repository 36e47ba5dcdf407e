"""CUDA graphs for pure-decode steps: one per batch size in `graph_batch_sizes`, sharing one
memory pool. A batch of n rows replays the smallest graph of >= n rows; padded rows store
nothing (slot -1) and their outputs are dropped. The graphs read their inputs from
`DecodeInputs`, one device buffer filled by one host->device copy per step; a pending input
token comes from its `sampled` region, where the runner keeps every step's sampled tokens.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from models.attention_metadata import AttentionMetadata

logger = logging.getLogger(__name__)


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    sizes = [1, 2, 4, 8] + list(range(16, 513, 16))
    return [s for s in sizes if s < max_num_seqs] + [min(max_num_seqs, 512)]


class DecodeInputs:
    """The graphs' static inputs as views of one device buffer, and two pinned host twins.

    int64 [max_bs] regions `sampled` (device-written only), `input_ids`, `token_index`,
    `positions`, `slot_mapping`; int32 `seq_lens` [max_bs], `block_tables` [max_bs,
    max_blocks]. Input tokens are `sampled|input_ids`[token_index]. A step copies from
    `input_ids` on, never over `sampled`; the host twins alternate (an event each), so a step
    never overwrites bytes the device may still be copying."""

    INT64 = ("sampled", "input_ids", "token_index", "positions", "slot_mapping")

    def __init__(self, max_bs: int, max_blocks: int, device: torch.device) -> None:
        self.max_bs, self.max_blocks = max_bs, max_blocks
        self.nbytes = (len(self.INT64) * 8 + 4 + 4 * max_blocks) * max_bs
        self.buffer = torch.zeros(self.nbytes, dtype=torch.uint8, device=device)
        self.dev = self._views(self.buffer)
        self.dev["slot_mapping"].fill_(-1)
        self.dev["seq_lens"].fill_(1)
        pin = device.type == "cuda"
        self._hosts = [torch.zeros(self.nbytes, dtype=torch.uint8, pin_memory=pin)
                       for _ in range(2)]
        self._host_views = [{k: v.numpy() for k, v in self._views(h).items()}
                            for h in self._hosts]
        # An event never recorded counts as done: the first two steps wait for nothing.
        self._copied = [torch.cuda.Event() for _ in range(2)] if pin else None
        self._next = 0
        self._first = 8 * max_bs  # host bytes start at input_ids
        self._tables = (len(self.INT64) * 8 + 4) * max_bs  # offset of block_tables

    def _views(self, buf: torch.Tensor) -> dict[str, torch.Tensor]:
        n, views, off = self.max_bs, {}, 0
        for name in self.INT64:
            views[name] = buf[off:off + 8 * n].view(torch.int64)  # [max_bs]
            off += 8 * n
        views["seq_lens"] = buf[off:off + 4 * n].view(torch.int32)  # [max_bs]
        off += 4 * n
        views["block_tables"] = buf[off:].view(torch.int32).view(n, self.max_blocks)
        return views

    @property
    def token_candidates(self) -> torch.Tensor:
        """[2 * max_bs] int64: `sampled | input_ids`, what `token_index` indexes."""
        return self.buffer[:16 * self.max_bs].view(torch.int64)

    def stage(self, padded_to: int, input_ids: list[int], token_index: list[int],
              positions: list[int], slot_mapping: list[int],
              block_tables: np.ndarray) -> None:
        """Queue one copy of a batch of n decode rows (each row's context ends at its query
        token: seq_len = position + 1), padded to the graph of `padded_to` rows: padding
        rows store nothing (slot -1) over a one-token context."""
        n, width = block_tables.shape
        i, self._next = self._next, self._next ^ 1
        if self._copied is not None:
            self._copied[i].synchronize()  # the copy two steps back; long done in practice
        h = self._host_views[i]
        h["input_ids"][:n] = input_ids
        h["token_index"][:n] = token_index
        h["token_index"][n:padded_to] = self.max_bs  # any valid index: the row is dropped
        h["positions"][:n] = positions
        h["positions"][n:padded_to] = 0
        h["slot_mapping"][:n] = slot_mapping
        h["slot_mapping"][n:padded_to] = -1
        h["seq_lens"][:padded_to] = h["positions"][:padded_to] + 1
        h["block_tables"][:n, :width] = block_tables
        # Padding rows keep the block ids of earlier steps (or zeros): real blocks, and a
        # one-token context reads only its first one.
        end = self._tables + 4 * self.max_blocks * n
        self.buffer[self._first:end].copy_(self._hosts[i][self._first:end], non_blocking=True)
        if self._copied is not None:
            self._copied[i].record()


class CudaGraphRunner:
    """Decode graphs over `DecodeInputs`. With `capture=False` the same static-buffer forward
    runs eagerly instead of from graphs (how CPU tests check the staging)."""

    def __init__(self, runner, capture: bool = True) -> None:
        self.model = runner.model
        cfg = runner.config
        self.batch_sizes = graph_batch_sizes(cfg.max_num_seqs)
        self.max_bs = self.batch_sizes[-1]
        self.max_seq_len = cfg.max_model_len
        self.inputs = DecodeInputs(self.max_bs, cfg.max_blocks_per_seq, runner.device)
        self.cu_seqlens_q = torch.arange(self.max_bs + 1, dtype=torch.int32,
                                         device=runner.device)
        # Each graph's hidden states [bs, hidden], where its capture (and every replay) leaves them.
        self.outputs: dict[int, torch.Tensor] = {}
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        if capture:
            self._capture()

    @property
    def sampled(self) -> torch.Tensor:
        """[max_bs] int64: the last step's sampled tokens, where pending inputs come from."""
        return self.inputs.dev["sampled"]

    def _forward(self, bs: int) -> torch.Tensor:
        v = self.inputs.dev
        meta = AttentionMetadata(
            slot_mapping=v["slot_mapping"][:bs], cu_seqlens_q=self.cu_seqlens_q[:bs + 1],
            seq_lens=v["seq_lens"][:bs], block_tables=v["block_tables"][:bs],
            max_query_len=1, max_seq_len=self.max_seq_len, seq_lens_cpu=None,
            cu_seqlens_q_cpu=None, decode_only=True)
        input_ids = self.inputs.token_candidates[v["token_index"][:bs]]  # [bs]
        return self.model(input_ids, v["positions"][:bs], meta)  # [bs, hidden]

    @torch.inference_mode()
    def _capture(self) -> None:
        pool = None
        for bs in reversed(self.batch_sizes):  # largest first, so the pool fits all
            self._forward(bs)  # warm-up outside the graph: Triton compiles and autotunes here
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[bs] = self._forward(bs)
            if pool is None:
                pool = graph.pool()
            self.graphs[bs] = graph
        torch.cuda.synchronize()
        logger.info("captured CUDA graphs for decode batch sizes %s", self.batch_sizes)

    def padded_size(self, n: int) -> int:
        """The graph batch size a batch of n rows replays (n <= max_bs)."""
        return next(b for b in self.batch_sizes if b >= n)

    def replay(self, n: int) -> torch.Tensor:
        """The forward of the n staged rows: hidden states [n, hidden]."""
        bs = self.padded_size(n)
        if not self.graphs:
            return self._forward(bs)[:n]
        self.graphs[bs].replay()
        return self.outputs[bs][:n]
