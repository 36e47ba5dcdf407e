"""CUDA graphs for pure-decode steps: one per batch size in `graph_batch_sizes`, sharing one
memory pool. A batch of n rows replays the smallest graph of >= n rows; padded rows store
nothing (slot -1) and their outputs are dropped. The graphs read their inputs from
`DecodeInputs`, one device buffer filled by one host->device copy per step; a pending input
token comes from its `sampled` region, where the runner keeps every step's sampled tokens.
One `CudaGraphRunner` serves the target model and, with a draft model, a second one the
draft's passes.
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


class StagedBuffer:
    """Named int regions of one device buffer, filled from two pinned host twins that
    alternate (an event each), so a step never overwrites bytes the device may still be
    copying. `layout`: (name, dtype, numel) in buffer order; the last region may be 2-D
    (`last_shape`)."""

    def __init__(self, layout: list[tuple[str, torch.dtype, int]], last_shape: tuple[int, int],
                 device: torch.device) -> None:
        self.layout, self.last_shape = layout, last_shape
        self.offsets: dict[str, int] = {}
        off = 0
        for name, dtype, numel in layout:
            self.offsets[name] = off
            off += numel * dtype.itemsize
        self.nbytes = off
        self.buffer = torch.zeros(self.nbytes, dtype=torch.uint8, device=device)
        self.dev = self._views(self.buffer)
        pin = device.type == "cuda"
        self._hosts = [torch.zeros(self.nbytes, dtype=torch.uint8, pin_memory=pin)
                       for _ in range(2)]
        self._host_views = [{k: v.numpy() for k, v in self._views(h).items()}
                            for h in self._hosts]
        # An event never recorded counts as done: the first two steps wait for nothing.
        self._copied = [torch.cuda.Event() for _ in range(2)] if pin else None
        self._next = 0

    def _views(self, buf: torch.Tensor) -> dict[str, torch.Tensor]:
        views = {}
        for name, dtype, numel in self.layout:
            off = self.offsets[name]
            views[name] = buf[off:off + numel * dtype.itemsize].view(dtype)
        name = self.layout[-1][0]
        views[name] = views[name].view(self.last_shape)
        return views

    def host(self) -> tuple[int, dict[str, np.ndarray]]:
        """The next host twin to fill (once the device has copied it out) and its views."""
        i, self._next = self._next, self._next ^ 1
        if self._copied is not None:
            self._copied[i].synchronize()  # the copy two steps back; long done in practice
        return i, self._host_views[i]

    def copy(self, i: int, start: int, end: int) -> None:
        """Queue the copy of host twin i's bytes [start, end) to the device."""
        self.buffer[start:end].copy_(self._hosts[i][start:end], non_blocking=True)
        if self._copied is not None:
            self._copied[i].record()


class DecodeInputs(StagedBuffer):
    """The decode graphs' static inputs. int64 [max_bs] regions `sampled` (device-written
    only), `input_ids`, `token_index`, `positions`, `slot_mapping`; int32 `seq_lens`
    [max_bs], `block_tables` [max_bs, max_blocks]. Input tokens are
    `sampled|input_ids`[token_index]. A step copies from `input_ids` on, never over
    `sampled`."""

    INT64 = ("sampled", "input_ids", "token_index", "positions", "slot_mapping")

    def __init__(self, max_bs: int, max_blocks: int, device: torch.device) -> None:
        self.max_bs, self.max_blocks = max_bs, max_blocks
        layout = [(name, torch.int64, max_bs) for name in self.INT64]
        layout += [("seq_lens", torch.int32, max_bs),
                   ("block_tables", torch.int32, max_bs * max_blocks)]
        super().__init__(layout, (max_bs, max_blocks), device)
        self.dev["slot_mapping"].fill_(-1)
        self.dev["seq_lens"].fill_(1)

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
        i, h = self.host()
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
        end = self.offsets["block_tables"] + 4 * self.max_blocks * n
        self.copy(i, self.offsets["input_ids"], end)


class VerifyInputs(StagedBuffer):
    """The verify graphs' static inputs: rows of 1..q query tokens (a decode row's last
    token and its proposals), packed. int64 [max_bs * q] `input_ids`, `positions`,
    `slot_mapping`; int32 `cu_seqlens_q` [max_bs + 1], `seq_lens` [max_bs], `block_tables`
    [max_bs, max_blocks]. Token slots past the rows' tokens belong to no row (slot -1)."""

    def __init__(self, max_bs: int, q: int, max_blocks: int, device: torch.device) -> None:
        self.max_bs, self.q, self.max_blocks = max_bs, q, max_blocks
        t = max_bs * q
        layout = [("input_ids", torch.int64, t), ("positions", torch.int64, t),
                  ("slot_mapping", torch.int64, t), ("cu_seqlens_q", torch.int32, max_bs + 1),
                  ("seq_lens", torch.int32, max_bs),
                  ("block_tables", torch.int32, max_bs * max_blocks)]
        super().__init__(layout, (max_bs, max_blocks), device)
        self.dev["slot_mapping"].fill_(-1)

    def stage(self, padded_to: int, input_ids: list[int], positions: list[int],
              slot_mapping: list[int], query_lens: list[int], block_tables: np.ndarray
              ) -> None:
        """Queue one copy of n rows' packed tokens, padded to the graph of `padded_to` rows
        (padding rows: one query token over a one-token context, storing nothing)."""
        n, width = block_tables.shape
        t, num_tokens = padded_to * self.q, len(input_ids)
        i, h = self.host()
        h["input_ids"][:num_tokens] = input_ids
        h["input_ids"][num_tokens:t] = 0
        h["positions"][:num_tokens] = positions
        h["positions"][num_tokens:t] = 0
        h["slot_mapping"][:num_tokens] = slot_mapping
        h["slot_mapping"][num_tokens:t] = -1
        cu = h["cu_seqlens_q"]
        cu[0] = 0
        np.cumsum(query_lens, out=cu[1:n + 1])
        cu[n + 1:padded_to + 1] = num_tokens + np.arange(1, padded_to - n + 1)
        ends = cu[1:n + 1]  # each row's context ends at its last query token
        h["seq_lens"][:n] = h["positions"][ends - 1] + 1
        h["seq_lens"][n:padded_to] = 1
        h["block_tables"][:n, :width] = block_tables
        end = self.offsets["block_tables"] + 4 * self.max_blocks * n
        self.copy(i, 0, end)


class CudaGraphRunner:
    """Decode graphs of `model` (default: the runner's target) over `DecodeInputs`, for
    batches of up to `max_batch_size` rows (default: max_num_seqs) and, with speculative
    decoding on the Triton backend, verify graphs over `VerifyInputs` (rows of up to 1 + K
    tokens, for the batch sizes that speculate). With `capture=False` the same static-buffer
    forwards run eagerly instead of from graphs (how CPU tests check the staging)."""

    def __init__(self, runner, capture: bool = True, model: torch.nn.Module | None = None,
                 max_batch_size: int | None = None) -> None:
        self.model = model if model is not None else runner.model
        cfg = runner.config
        self.batch_sizes = graph_batch_sizes(max_batch_size or cfg.max_num_seqs)
        self.max_bs = self.batch_sizes[-1]
        self.max_seq_len = cfg.max_model_len
        self.inputs = DecodeInputs(self.max_bs, cfg.max_blocks_per_seq, runner.device)
        self.cu_seqlens_q = torch.arange(self.max_bs + 1, dtype=torch.int32,
                                         device=runner.device)
        # Each graph's hidden states [bs, hidden], where its capture (and every replay) leaves them.
        self.outputs: dict[int, torch.Tensor] = {}
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.verify_sizes: list[int] = []
        self.verify: VerifyInputs | None = None
        # The Triton kernel reads every length on the device; a CPU test (no capture)
        # replays the same forward on the torch backend.
        if cfg.speculative_method is not None and (runner.backend.name == "triton"
                                                   or not capture):
            self.verify_sizes = graph_batch_sizes(
                min(cfg.max_num_seqs, cfg.speculative_disable_by_batch_size))
            self.verify = VerifyInputs(self.verify_sizes[-1], 1 + cfg.num_lookahead_tokens,
                                       cfg.max_blocks_per_seq, runner.device)
        self.verify_outputs: dict[int, torch.Tensor] = {}  # [bs * q, hidden] each
        self.verify_graphs: dict[int, torch.cuda.CUDAGraph] = {}
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

    def _forward_verify(self, bs: int) -> torch.Tensor:
        assert self.verify is not None
        v, t = self.verify.dev, bs * self.verify.q
        meta = AttentionMetadata(
            slot_mapping=v["slot_mapping"][:t], cu_seqlens_q=v["cu_seqlens_q"][:bs + 1],
            seq_lens=v["seq_lens"][:bs], block_tables=v["block_tables"][:bs],
            max_query_len=self.verify.q, max_seq_len=self.max_seq_len)
        return self.model(v["input_ids"][:t], v["positions"][:t], meta)  # [t, hidden]

    @torch.inference_mode()
    def _capture(self) -> None:
        pool = None
        # Largest first, so the pool fits all; verify graphs (bs * q tokens) before decode.
        for graphs, outputs, forward, sizes in (
                (self.verify_graphs, self.verify_outputs, self._forward_verify,
                 self.verify_sizes),
                (self.graphs, self.outputs, self._forward, self.batch_sizes)):
            for bs in reversed(sizes):
                forward(bs)  # warm-up outside the graph: Triton compiles and autotunes here
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    outputs[bs] = forward(bs)
                if pool is None:
                    pool = graph.pool()
                graphs[bs] = graph
        torch.cuda.synchronize()
        logger.info("captured CUDA graphs for decode batch sizes %s and verify batch sizes %s",
                    self.batch_sizes, self.verify_sizes)

    def fits_verify(self, rows: int, query_lens: list[int]) -> bool:
        """Whether verify graphs cover `rows` rows of these query lengths."""
        return (self.verify is not None and rows <= self.verify_sizes[-1]
                and max(query_lens) <= self.verify.q)

    def last_token_indices(self, n: int) -> torch.Tensor:
        """[n] int64: each staged verify row's last token among the replay's outputs."""
        assert self.verify is not None
        return self.verify.dev["cu_seqlens_q"][1:n + 1].long() - 1

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

    def padded_verify_size(self, n: int) -> int:
        return next(b for b in self.verify_sizes if b >= n)

    def replay_verify(self, n: int, num_tokens: int) -> torch.Tensor:
        """The forward of the staged verify rows: hidden states [num_tokens, hidden]."""
        bs = self.padded_verify_size(n)
        if not self.verify_graphs:
            return self._forward_verify(bs)[:num_tokens]
        self.verify_graphs[bs].replay()
        return self.verify_outputs[bs][:num_tokens]
