"""Model runner: owns the model, the paged KV cache and the sampler; turns one scheduled
batch into flat tensors, runs the forward pass and samples on the device."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from engine_service.config import EngineConfig
from engine_service.cuda_graphs import CudaGraphRunner
from engine_service.scheduler import ScheduledSeq
from engine_service.spec_decode.draft_proposer import DraftProposer
from engine_service.tp_worker import agree_on_num_kv_blocks, start_tensor_parallel
from models.attention_metadata import BlockTableCache, make_attention_metadata
from models.backends import get_attention_backend
from models.config import ModelConfig
from models.host_copy import to_device
from models.kv_cache import allocate_kv_cache, kv_bytes_per_block
from models.layers.sampler import Sampler, SamplerOutput, SamplingTensors
from models.parallel import close_fast_all_reduce, init_fast_all_reduce
from models.registry import build_model

logger = logging.getLogger(__name__)

CPU_KV_CACHE_BYTES = 1 << 30  # default KV budget on CPU when --num-kv-blocks is not given
# Rows of a step -> their token bitmask, int32 [rows, ceil(vocab / 32)] on the host.
TokenMasks = Callable[[list[ScheduledSeq]], torch.Tensor]
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class StepResult:
    """What one forward pass produced, on the host. Rows follow the scheduled order; rows
    that did not sample (mid-prompt chunks) hold None."""

    token_ids: list[int | None]
    logprobs: list[tuple[float, list[int], list[float]] | None]
    # A speculative step: per row, the tokens it adds (the target's draws while they match
    # the proposals, then its first differing draw) and their logprobs.
    accepted: list[list[int]] | None = None
    accepted_logprobs: list[list[tuple[float, list[int], list[float]] | None]] | None = None


class LaunchedStep:
    """A step queued on the device. Its outputs are copied to pinned host memory on
    `copy_stream` (off the compute stream) and `result()` waits for that copy alone, so the
    host can launch the next step first."""

    def __init__(self, batch: list[ScheduledSeq], out: SamplerOutput | None,
                 start: torch.cuda.Event | None = None,
                 guard: Callable[[], AbstractContextManager] | None = None,
                 copy_stream: torch.cuda.Stream | None = None) -> None:
        self.batch = batch
        self.is_speculative = any(item.spec_token_ids for item in batch)  # rows verify
        self._guard = guard or contextlib.nullcontext  # a tensor-parallel step: TPWorkers.guard
        self.wait_seconds = 0.0  # how long result() blocked on the device
        self.device_seconds = 0.0  # from the inputs queued to the output copy done
        self._start = start
        self._host: dict[str, torch.Tensor] = {}
        self._done: torch.cuda.Event | None = None
        self._result: StepResult | None = None
        if out is None:
            return
        fields = {"sampled": out.sampled_token_ids}
        if out.logprobs is not None:  # some row asked for logprobs
            fields.update(logprobs=out.logprobs, top_ids=out.top_token_ids,
                          top_lp=out.top_logprobs)
        if not out.sampled_token_ids.is_cuda:
            self._host = fields
            return
        stream = copy_stream or torch.cuda.current_stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for name, t in fields.items():
                host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                self._host[name] = host.copy_(t, non_blocking=True)
                t.record_stream(stream)  # no reuse of t's memory before the copy is done
            self._done = torch.cuda.Event(enable_timing=start is not None)
            self._done.record()

    def result(self) -> StepResult:
        """The step's tokens on the host (waits for them once; later calls return them)."""
        if self._result is None:
            self._result = self._read()
        return self._result

    def _read(self) -> StepResult:
        if self._done is not None:
            t0 = time.perf_counter()
            with self._guard():
                self._done.synchronize()  # the one host synchronisation of the step
            self.wait_seconds = time.perf_counter() - t0
            if self._start is not None:
                self.device_seconds = self._start.elapsed_time(self._done) / 1e3
        batch = self.batch
        if not self._host:
            return StepResult([None] * len(batch), [None] * len(batch))
        sampled = self._host["sampled"].tolist()
        if self.is_speculative:
            return self._verify(sampled)
        if len(sampled) == len(batch) and "logprobs" not in self._host:
            return StepResult(sampled, [None] * len(batch))  # every row sampled
        rows = [item for item in batch if item.sample]
        lp = self._logprobs(rows) if "logprobs" in self._host else [None] * len(rows)
        it = iter(zip(sampled, lp, strict=True))
        pairs = [next(it) if item.sample else (None, None) for item in batch]
        return StepResult([t for t, _ in pairs], [p for _, p in pairs])

    def _verify(self, sampled: list[int]) -> StepResult:
        """Each verify row keeps the target's draws while they equal the proposals, then
        its first differing draw (or the draw after the last proposal). The draws are the
        ones decoding without speculation makes, from the same seeds and steps, so this
        is lossless: for a proposal x the target draws x with probability p(x), and a
        rejection leaves p with x taken out, renormalised."""
        rows = [item for item in self.batch if item.sample]
        lp = self._logprobs(rows) if "logprobs" in self._host else [None] * len(sampled)
        accepted: list[list[int]] = []
        accepted_lp: list[list] = []
        pos = 0
        for item in self.batch:
            if not item.sample:
                accepted.append([])
                accepted_lp.append([])
                continue
            spec = item.spec_token_ids
            n = 1
            while n <= len(spec) and sampled[pos + n - 1] == spec[n - 1]:
                n += 1
            accepted.append(sampled[pos:pos + n])
            accepted_lp.append(lp[pos:pos + n])
            pos += len(spec) + 1
        firsts = [tokens[0] if tokens else None for tokens in accepted]
        return StepResult(firsts, [p[0] if p else None for p in accepted_lp], accepted,
                          accepted_lp)

    def _logprobs(self, rows: list[ScheduledSeq]) -> list:
        """One entry per draw (a verify row has several), None where not asked for."""
        chosen = self._host["logprobs"].tolist()
        top_ids = self._host["top_ids"].tolist()
        top_lp = self._host["top_lp"].tolist()
        result = []
        r = 0
        for item in rows:
            n = item.seq.sampling_params.logprobs
            for _ in range(item.num_samples):
                result.append(None if n is None else (chosen[r], top_ids[r][:n],
                                                      top_lp[r][:n]))
                r += 1
        return result


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device must be 'cpu' or 'auto' here: CUDA is not available")
    return torch.device(name)


def resolve_dtype(name: str, hf_config: dict, device: torch.device) -> torch.dtype:
    if name != "auto":
        return _DTYPES[name]
    if device.type == "cpu":
        return torch.float32  # CPU bf16 matmuls are slow and the reference checks are fp32
    cfg = hf_config.get("torch_dtype") or hf_config.get("dtype") or "bfloat16"
    return _DTYPES.get(cfg, torch.bfloat16)


class ModelRunner:
    def __init__(self, config: EngineConfig, rank: int = 0):
        self.config = config
        self.rank = rank
        self.device = resolve_device(config.device)
        if self.device.type == "cuda":
            torch.cuda.set_device(rank)
            self.device = torch.device("cuda", rank)
        # Rank 0 starts the TP group before the model: the layers size their shards from it.
        self.tp = start_tensor_parallel(config, rank, self.device)
        try:
            self._build()
        except BaseException:
            self.shutdown()  # leave no worker ranks (or process group) behind
            raise
        if self.tp is not None:
            self.tp.ready()

    def _build(self) -> None:
        """The model shard, its weights, the KV cache and the CUDA graphs (every rank)."""
        config = self.config
        init_fast_all_reduce(self.device)  # collective; before any graph captures one
        self.dtype = resolve_dtype(config.dtype, config.hf_config, self.device)
        self.model_config = ModelConfig.from_dir(config.model)
        self.block_size = config.kv_block_size
        self.backend = get_attention_backend(config.attention_backend, self.device)

        self.model = build_model(self.model_config, config.model, self.backend, self.device,
                                 self.dtype, config.seed, config.load_format)
        # Speculative decoding's draft model: its KV cache shares the target's block ids.
        self.drafter = DraftProposer(self) if config.speculative_method == "draft" else None
        self.sampler = Sampler()
        self._copy_stream = (torch.cuda.Stream(self.device) if self.device.type == "cuda"
                             else None)  # sampled tokens to the host, off the compute stream
        self.vocab_size = self.model_config.vocab_size
        self.sampler.warm_up(self.vocab_size, self.dtype, self.device)
        # The last step's sampled tokens: the next step's pending input tokens.
        self._prev_sampled: torch.Tensor | None = None  # [num_rows] int64
        self._prev_sample_rows: dict[str | int, int] = {}  # seq_id -> row
        self._table_cache = BlockTableCache()  # decode rows' tables change once a block

        self.num_kv_blocks = agree_on_num_kv_blocks(self._decide_num_kv_blocks(), self.device)
        self.kv_cache = self._allocate_kv_cache(self.num_kv_blocks)
        if self.device.type == "cuda":
            self._warm_up()
        self.graph_runner = None
        # Decode graphs serve autoregressive models: a diffusion pass is a whole canvas.
        if self.device.type == "cuda" and not (config.enforce_eager
                                               or self.model_config.is_diffusion):
            self.graph_runner = CudaGraphRunner(self)
            if self.drafter is not None:
                self.drafter.use_graphs()  # its KV cache is allocated by now

    def shutdown(self) -> None:
        """Release what outlives the object (TP ranks, graphs)."""
        self.graph_runner = None
        if getattr(self, "drafter", None) is not None:
            self.drafter.graphs = None
        close_fast_all_reduce()  # the graphs that used its buffer are gone
        if self.tp is not None:
            self.tp.shutdown()
            self.tp = None

    def check_alive(self) -> None:
        """Raise RuntimeError if a tensor-parallel rank has died (the core asks while idle)."""
        if self.tp is not None:
            self.tp.check_alive()

    @property
    def kv_bytes_per_block(self) -> int:
        """KV bytes of one block id: the target's, plus the draft model's where one runs."""
        draft = self.drafter.kv_bytes_per_block if self.drafter is not None else 0
        return kv_bytes_per_block(self.model, self.block_size, self.dtype) + draft

    def _decide_num_kv_blocks(self) -> int:
        if self.config.num_kv_blocks is not None:
            return self.config.num_kv_blocks
        need = self.config.max_blocks_per_seq
        if self.device.type == "cpu":
            return max(need, CPU_KV_CACHE_BYTES // self.kv_bytes_per_block)
        free_bytes = self._profile_free_bytes()
        blocks = int(free_bytes // self.kv_bytes_per_block)
        if blocks < need:
            raise ValueError(
                f"gpu_memory_utilization={self.config.gpu_memory_utilization} leaves room for "
                f"{blocks} KV blocks, but one max_model_len sequence needs {need}; raise it or "
                f"lower max_model_len")
        return blocks

    @torch.inference_mode()
    def _profile_free_bytes(self) -> int:
        """Run the largest batch without a cache and see what the activations take."""
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        num_tokens = self.config.max_num_batched_tokens
        seq_len = min(self.config.max_model_len, num_tokens)
        lens = [seq_len] * (num_tokens // seq_len)
        if num_tokens % seq_len:
            lens.append(num_tokens % seq_len)
        input_ids = torch.zeros(num_tokens, dtype=torch.long, device=self.device)
        positions = torch.cat([torch.arange(n, device=self.device) for n in lens])
        # No cache exists yet: the no-cache attention path reads neither slots nor tables.
        meta = make_attention_metadata(
            lens, lens, [[0] * -(-n // self.block_size) for n in lens], self.block_size,
            self.device)
        hidden = self.model(input_ids, positions, meta)
        # float32, as the sampler's penalty and mask paths copy them.
        self.model.compute_logits(hidden[-self.config.max_num_seqs:]).float()
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        free, total = torch.cuda.mem_get_info(self.device)
        used_by_others = total - free - torch.cuda.memory_reserved(self.device)
        budget = total * self.config.gpu_memory_utilization - used_by_others - peak
        del hidden
        torch.cuda.empty_cache()
        return max(0, int(budget))

    # (query lens, context lens) of the warm-up batches: short and long, cached or not, one and
    # many rows, mixed; their token counts reach every config of the fused MoE's table.
    _WARM_UP_BATCHES = (([5], [5]), ([12], [600]), ([200], [200]), ([300], [1100]),
                        ([1024], [1024]), ([100] * 64, [100] * 64),
                        ([1] * 8 + [100], [700] * 8 + [100]))

    @torch.inference_mode()
    def _warm_up(self) -> None:
        """Compile now what the first requests would otherwise wait for (attention launch
        variants, torch.compile's dynamic shapes). Writes KV only into blocks no sequence
        owns yet."""
        attn = self.model.attention_layers()[0]
        self.backend.warm_up(attn.kv_cache, attn.num_heads, causal=attn.causal)
        for query_lens, seq_lens in self._WARM_UP_BATCHES:
            seq_lens = [min(n, self.config.max_model_len) for n in seq_lens]
            query_lens = [min(q, n) for q, n in zip(query_lens, seq_lens, strict=True)]
            blocks_per_seq = -(-max(seq_lens) // self.block_size)
            if blocks_per_seq * len(seq_lens) > self.num_kv_blocks or \
                    sum(query_lens) > self.config.max_num_batched_tokens:
                continue
            tables = [list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq))
                      for i in range(len(seq_lens))]
            meta = make_attention_metadata(query_lens, seq_lens, tables, self.block_size,
                                           self.device)
            positions = torch.cat([torch.arange(n - q, n, device=self.device)
                                   for q, n in zip(query_lens, seq_lens, strict=True)])
            input_ids = torch.zeros_like(positions)
            hidden = self.model(input_ids, positions, meta)
            self.model.compute_logits(hidden[meta.cu_seqlens_q[1:] - 1])
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _allocate_kv_cache(self, num_blocks: int) -> torch.Tensor:
        cache = allocate_kv_cache(self.model, num_blocks, self.block_size, self.dtype,
                                  self.device)
        if self.drafter is not None:
            self.drafter.allocate_kv_cache(num_blocks)
        logger.info("KV cache: %d blocks of %d tokens (%.1f MiB)", num_blocks, self.block_size,
                    num_blocks * self.kv_bytes_per_block / 2**20)
        return cache

    def prepare_inputs(self, batch: list[ScheduledSeq]):
        """Flatten a mixed batch: (input_ids [T], positions [T], attention metadata,
        logits_indices [num_rows]). A pending last input token (sampled by the previous step,
        not yet on the host) is taken from that step's sampled tokens on the device."""
        input_ids: list[int] = []
        positions: list[int] = []
        logits_indices: list[int] = []
        pending_dst: list[int] = []  # flat token index that waits for a device token
        pending_src: list[int] = []  # its row in the previous step's sampled tokens
        for item in batch:
            seq = item.seq
            spec = item.spec_token_ids
            start, end = item.start, item.start + item.num_new_tokens - len(spec)
            known = min(end, len(seq.token_ids))
            input_ids.extend(seq.token_ids[start:known])
            if known < end:
                pending_dst.append(len(input_ids))
                pending_src.append(self._pending_row(seq, known, end))
                input_ids.append(0)
            input_ids.extend(spec)
            positions.extend(range(start, end + len(spec)))
            if item.sample:  # a verify row samples at its last token and every proposal
                logits_indices.extend(range(len(input_ids) - 1 - len(spec), len(input_ids)))
        meta = make_attention_metadata(
            [item.num_new_tokens for item in batch],
            [item.start + item.num_new_tokens for item in batch],
            [item.seq.block_table for item in batch], self.block_size, self.device,
            table_cache=self._table_cache)
        dev = self.device
        ids = to_device(input_ids, torch.long, dev)  # [T]
        if pending_dst:
            assert self._prev_sampled is not None
            index = to_device(pending_dst + pending_src, torch.long, dev).view(2, -1)  # [2, P]
            ids[index[0]] = self._prev_sampled[index[1]]
        return (ids, to_device(positions, torch.long, dev), meta,
                to_device(logits_indices, torch.long, dev))

    def _pending_row(self, seq, known: int, end: int) -> int:
        """The row of the previous step's sampled tokens that holds `seq`'s input token
        `known`, the last of the step (tokens [known, end) are not on the host)."""
        row = self._prev_sample_rows.get(seq.seq_id)
        if end - known != 1 or row is None:
            raise RuntimeError(f"{seq.seq_id!r}: input token {known} is neither on the host "
                               f"nor sampled by the previous step")
        return row

    def can_replay(self, batch: list[ScheduledSeq]) -> bool:
        """A decode-only batch the CUDA graphs cover."""
        return (self.graph_runner is not None and len(batch) <= self.graph_runner.max_bs
                and all(item.num_new_tokens == 1 for item in batch))

    def can_replay_verify(self, batch: list[ScheduledSeq]) -> bool:
        """A speculative batch of decode rows (with or without proposals, none pending)
        that the verify graphs cover."""
        graphs = self.graph_runner
        return (graphs is not None
                and graphs.fits_verify(len(batch), [item.num_new_tokens for item in batch])
                and all(item.is_decode and item.start < len(item.seq.token_ids)
                        for item in batch))

    def _pack_tables(self, batch: list[ScheduledSeq]) -> np.ndarray:
        """The rows' block tables, [rows, widest] int32 (numpy) for a staged copy."""
        tables = [item.seq.block_table for item in batch]
        return self._table_cache.pack(tables, max(map(len, tables)), 0)

    def prepare_verify(self, batch: list[ScheduledSeq], graphs: CudaGraphRunner | None = None
                       ) -> int:
        """Stage rows of 1..q tokens, all on the host, into the verify inputs of `graphs`
        (default: the target's; one host->device copy); returns their token count. A verify
        row's tokens are its last token and its proposals, each of which samples."""
        graphs = graphs or self.graph_runner
        assert graphs is not None and graphs.verify is not None
        block_size = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        for item in batch:
            seq, start, spec = item.seq, item.start, item.spec_token_ids
            end = start + item.num_new_tokens
            input_ids.extend(seq.token_ids[start:end - len(spec)])
            input_ids.extend(spec)
            table = seq.block_table
            for pos in range(start, end):
                positions.append(pos)
                slots.append(table[pos // block_size] * block_size + pos % block_size)
        graphs.verify.stage(graphs.padded_verify_size(len(batch)), input_ids, positions, slots,
                            [item.num_new_tokens for item in batch], self._pack_tables(batch))
        return len(input_ids)

    def prepare_decode(self, batch: list[ScheduledSeq], graphs: CudaGraphRunner | None = None,
                       pending_rows: list[int] | None = None) -> torch.Tensor | None:
        """Stage a decode-only batch into the decode inputs of `graphs` (default: the
        target's; one host->device copy); returns logits_indices [num_rows], or None when
        every row samples. Row i's input token, where not on the host, is read from
        `graphs.sampled`: at pending_rows[i] if given, else where the last step sampled it."""
        graphs = graphs or self.graph_runner
        assert graphs is not None
        block_size = self.block_size
        input_ids: list[int] = []
        token_index: list[int] = []  # into sampled | input_ids (see DecodeInputs)
        positions: list[int] = []
        slots: list[int] = []
        for i, item in enumerate(batch):
            seq, pos = item.seq, item.start
            if pos < len(seq.token_ids):
                input_ids.append(seq.token_ids[pos])
                token_index.append(graphs.max_bs + i)
            else:
                input_ids.append(0)
                token_index.append(pending_rows[i] if pending_rows is not None else
                                   self._pending_row(seq, len(seq.token_ids), pos + 1))
            positions.append(pos)
            slots.append(seq.block_table[pos // block_size] * block_size + pos % block_size)
        graphs.inputs.stage(graphs.padded_size(len(batch)), input_ids, token_index, positions,
                            slots, self._pack_tables(batch))
        if all(item.sample for item in batch):
            return None
        return to_device([i for i, item in enumerate(batch) if item.sample], torch.long,
                         self.device)

    def prepare_sampling(self, rows: list[ScheduledSeq], eos_token_ids: list[int]
                         ) -> SamplingTensors:
        """One draw per sampled position: a verify row draws at its last token and at each
        proposal, as if the proposals before that position were its outputs."""
        params: list = []
        seeds: list[int] = []
        steps: list[int] = []
        suppress: list[tuple[int, int]] = []
        bias: list[tuple[int, int, float]] = []
        any_mask = False
        row = 0
        for item in rows:  # one pass: this runs for every row of every step
            seq = item.seq
            sp = seq.sampling_params
            constraint = seq.constraint
            if constraint is not None:
                any_mask = True
            first = item.output_index
            spec = item.spec_token_ids
            for step in range(first, first + len(spec) + 1) if spec else (first,):
                params.append(sp)
                seeds.append(seq.seed)
                steps.append(step)
                # A grammar decides when its stop token may come; min_tokens yields to it.
                if step < sp.min_tokens and (constraint is None or constraint.matcher is None):
                    banned = list(sp.stop_token_ids) + ([] if sp.ignore_eos else eos_token_ids)
                    suppress.extend((row, t) for t in banned if t < self.vocab_size)
                if sp.logit_bias:
                    bias.extend((row, t, b) for t, b in sp.logit_bias.items())
                row += 1
        prompts = outputs = None
        if any(p.uses_penalties for p in params):  # only penalty rows read their history
            prompts, outputs = [], []
            for item in rows:
                seq, spec = item.seq, item.spec_token_ids
                used = seq.sampling_params.uses_penalties
                for j in range(len(spec) + 1):  # a proposal's history holds those before it
                    prompts.append(seq.prompt_token_ids if used else [])
                    outputs.append(seq.output_token_ids + list(spec[:j]) if used else [])
        return SamplingTensors.build(params, seeds, steps, prompts, outputs, suppress,
                                     self.vocab_size, self.device, bias, any_mask)

    def run_model(self, batch: list[ScheduledSeq], start: torch.cuda.Event | None = None,
                  gather: bool = True) -> torch.Tensor | None:
        """Forward one batch on every TP rank; logits of its sampling rows [num_rows, vocab]
        (gather=False: this rank's vocab columns only), or None. `start` is recorded once the
        inputs are built."""
        if self.can_replay(batch):
            logits_indices = self.prepare_decode(batch)
            if start is not None:
                start.record()
            hidden = self.graph_runner.replay(len(batch))
        elif self.can_replay_verify(batch):
            num_tokens = self.prepare_verify(batch)
            if start is not None:
                start.record()
            return self.model.compute_logits(self.graph_runner.replay_verify(len(batch),
                                                                             num_tokens), gather)
        else:
            input_ids, positions, meta, logits_indices = self.prepare_inputs(batch)
            if start is not None:
                start.record()
            hidden = self.model(input_ids, positions, meta)
        if logits_indices is not None:
            if logits_indices.shape[0] == 0:
                return None
            hidden = hidden[logits_indices]
        return self.model.compute_logits(hidden, gather)  # [num_rows, vocab]

    @property
    def vocab_start(self) -> int:
        """The first vocab index of this rank's logits columns."""
        return self.model.lm_head.vocab_start

    def execute(self, batch: list[ScheduledSeq], eos_token_ids: list[int],
                token_masks: TokenMasks | None = None) -> LaunchedStep:
        """Run one step and wait for its tokens (returned with `.result()`)."""
        step = self.launch(batch, eos_token_ids, token_masks)
        step.result()
        return step

    @torch.inference_mode()
    def launch(self, batch: list[ScheduledSeq], eos_token_ids: list[int],
               token_masks: TokenMasks | None = None) -> LaunchedStep:
        """Queue one step's forward pass and sampling on the device; returns at once (CUDA).
        A tensor-parallel step is sent to the workers first; a dead rank -> clear error.
        `token_masks(rows)` gives the bitmask of rows with a constraint: called once the
        forward pass is queued, so the host fills it while the device runs."""
        rows = [item for item in batch if item.sample]
        sampling = self.prepare_sampling(rows, eos_token_ids) if rows else None
        if self.tp is None:
            return self._launch(batch, rows, sampling, False, token_masks)
        # Rank 0 alone knows every setting, so it decides, and tells the workers.
        sharded = sampling is not None and sampling.temperature_only
        with self.tp.step(batch, sharded):
            return self._launch(batch, rows, sampling, sharded, token_masks)

    def _launch(self, batch: list[ScheduledSeq], rows: list[ScheduledSeq],
                sampling: SamplingTensors | None, sharded: bool,
                token_masks: TokenMasks | None) -> LaunchedStep:
        start = torch.cuda.Event(enable_timing=True) if self.device.type == "cuda" else None
        logits = self.run_model(batch, start, gather=not sharded)
        guard = self.tp.guard if self.tp is not None else None
        if logits is None:
            self._remember_sampled(rows, None)
            return LaunchedStep(batch, None, guard=guard)
        assert sampling is not None
        if sampling.any_token_mask:
            assert token_masks is not None, "a row has a constraint but no mask source"
            sampling.token_bitmask = token_masks(rows).to(self.device, non_blocking=True)
        if sharded:
            out = SamplerOutput(self.sampler.sample_shard(logits, sampling, self.vocab_start))
        else:
            out = self.sampler(logits, sampling)
            if self.tp is not None:
                dist.broadcast(out.sampled_token_ids, src=0)  # the workers' pending inputs
        self._remember_sampled(rows, out.sampled_token_ids)
        return LaunchedStep(batch, out, start, guard, self._copy_stream)

    @torch.inference_mode()
    def replay(self, batch: list[ScheduledSeq], sharded_sampling: bool) -> None:
        """A TP worker's step: rank 0's forward pass on this shard, then the step's tokens
        (drawn over the vocab shards together, or broadcast by rank 0) kept for the next step."""
        rows = [item for item in batch if item.sample]
        # Before the forward, as on rank 0. A sharded step's draws need no eos (rank 0 checked).
        sampling = self.prepare_sampling(rows, []) if rows and sharded_sampling else None
        logits = self.run_model(batch, gather=not sharded_sampling)
        sampled = None
        if rows:
            num_draws = sum(item.num_samples for item in rows)
            if self.graph_runner is not None and num_draws == len(rows):
                sampled = self.graph_runner.sampled[:len(rows)]  # where the graphs read it
            else:
                sampled = torch.empty(num_draws, dtype=torch.long, device=self.device)
            if sampling is not None:
                self.sampler.sample_shard(logits, sampling, self.vocab_start, out=sampled)
            else:
                dist.broadcast(sampled, src=0)
        self._remember_sampled(rows, sampled)

    def _remember_sampled(self, rows: list[ScheduledSeq], sampled: torch.Tensor | None) -> None:
        """Keep a step's sampled tokens [num_rows] on the device for the next step's pending
        inputs (eager steps index this tensor, graphs the static copy). A verify step's
        tokens are never pending: the host decides which of them count first."""
        if sampled is not None and sampled.shape[0] != len(rows):
            sampled, rows = None, []
        self._prev_sampled = sampled
        self._prev_sample_rows = {item.seq.seq_id: r for r, item in enumerate(rows)}
        static = self.graph_runner.sampled if self.graph_runner is not None else None
        if sampled is not None and static is not None and \
                sampled.data_ptr() != static.data_ptr():
            static[:len(rows)].copy_(sampled)
