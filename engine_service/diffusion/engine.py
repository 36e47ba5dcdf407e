"""DiffusionEngine: the step loop of a masked-diffusion model (LLaDA, Dream), with the same
add_request / abort / step interface as LLMEngine.

A request is a canvas, its prompt followed by `gen_length` mask tokens, decoded in blocks left
to right. Every step is one forward pass over every running request (and, with
classifier-free guidance, a twin whose prompt is masked), bidirectional, its KV written to the
request's paged blocks: the whole canvas, or with a dLLM cache ("prefix", "dual") only the
positions that pass recomputes (engine_service/diffusion/dllm_cache.py). A pass predicts each
position of a request's current block and unmasks some (engine_service/diffusion/
unmasking.py); a block whose last mask is gone is final and goes out as that request's new
tokens. Requests join and leave the batch at any step. A request takes the blocks of its
whole canvas when admitted, so it never needs more and is never preempted. Under head-sparse
attention (`retention_ratio`, dual cache) a request holds, for its current block, the key
positions each layer's KV heads keep, chosen inside the forward of the block's pass
`delay_step`.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Sequence as SequenceT
from dataclasses import dataclass, field

import torch

from engine_service.block_manager import BlockManager
from engine_service.common.sampling_params import (
    DiffusionParams,
    SamplingParams,
    check_diffusion_request,
    check_field,
    validate_prompt,
)
from engine_service.config import EngineConfig
from engine_service.diffusion.dllm_cache import allocate_canvas, cache_prompts, pack, plan_step
from engine_service.diffusion.unmasking import choose, draw_keys, num_transfer_tokens, predict
from engine_service.engine import EngineServing, LoadSnapshot, RequestOutput, StepStats
from engine_service.sequence import Sequence, SequenceStatus
from models.attention_metadata import BlockTableCache
from models.host_copy import to_device

logger = logging.getLogger(__name__)


@dataclass
class DiffusionRequest:
    """One request's decoding state. `seq.token_ids` is the canvas: prompt, then the
    generated positions (mask_token_id until unmasked); `uncond` is its classifier-free
    guidance twin (prompt masked), with blocks of its own."""

    seq: Sequence
    params: DiffusionParams
    uncond: Sequence | None = None
    block: int = 0  # the block being decoded
    schedule: tuple[int, ...] = ()  # unmasks per pass of this block (not under a threshold)
    pass_in_block: int = 0
    num_passes: int = 0  # forward passes taken
    # Head-sparse attention: per sequence (the twin's after), this block's kept key positions
    # [num_layers, Hkv, n_keep] int64 from its choosing pass on; empty before.
    selections: list[torch.Tensor] = field(default_factory=list)

    @property
    def block_start(self) -> int:
        return self.seq.num_prompt_tokens + self.block * self.params.block_length

    @property
    def seqs(self) -> list[Sequence]:
        return [self.seq] if self.uncond is None else [self.seq, self.uncond]


class DiffusionEngine(EngineServing):
    def __init__(self, config: EngineConfig):
        from engine_service.model_runner import ModelRunner

        self.config = config
        self.model_runner = ModelRunner(config)
        mc = self.model_runner.model_config
        if not mc.is_diffusion:
            raise ValueError(f"{mc.architecture} is not a diffusion model")
        assert mc.mask_token_id is not None
        self.mask_token_id = mc.mask_token_id
        self.vocab_size = mc.vocab_size
        self.eos_token_ids = list(mc.eos_token_id)
        # Dream's logits at i predict the token at i + 1; LLaDA's the token at i.
        self.shift = int(self.model_runner.model.predicts_next_token)
        self.block_manager = BlockManager(self.model_runner.num_kv_blocks, config.kv_block_size)
        self.waiting: deque[DiffusionRequest] = deque()
        self.running: list[DiffusionRequest] = []
        self.speculator = None  # the core process asks every engine for one
        self.total_stats = StepStats(num_steps=0)  # forward tokens, tokens out; LLM's bar
        self._table_cache = BlockTableCache()
        layers = self.model_runner.model.attention_layers()
        self._selection_shape = (len(layers), layers[0].num_kv_heads)  # per kept key

    # ------------------------------------------------------------------ requests

    def add_request(self, request_id: str, prompt_token_ids: SequenceT[int],
                    sampling_params: SamplingParams, priority: int = 0) -> Sequence:
        check_diffusion_request(sampling_params, diffusion_engine=True)
        params = sampling_params.diffusion or DiffusionParams()
        validate_prompt(prompt_token_ids, self.config.max_model_len - params.gen_length + 1,
                        self.vocab_size)
        rows = 2 if params.cfg_scale > 0 else 1
        check_field(self._pass_tokens(params, len(prompt_token_ids))
                    <= self.config.max_num_batched_tokens, "gen_length",
                    f"at most max_num_batched_tokens={self.config.max_num_batched_tokens} "
                    f"tokens a pass with the prompt"
                    f"{' (twice, with cfg_scale)' if rows == 2 else ''}", params.gen_length)
        if self.get(request_id) is not None:
            raise ValueError(f"request_id must be unique among requests in flight, "
                             f"got duplicate {request_id!r}")
        canvas = list(prompt_token_ids) + [self.mask_token_id] * params.gen_length
        seq = Sequence(request_id, canvas, sampling_params, priority=priority)
        seq.num_prompt_tokens = len(prompt_token_ids)
        uncond = None
        if params.cfg_scale > 0:
            masked = [self.mask_token_id] * len(prompt_token_ids) + canvas[len(prompt_token_ids):]
            uncond = Sequence(f"{request_id}/uncond", masked, sampling_params)
            uncond.num_prompt_tokens = seq.num_prompt_tokens
        self.waiting.append(DiffusionRequest(seq, params, uncond))
        return seq

    def get(self, request_id: str) -> DiffusionRequest | None:
        for req in (*self.running, *self.waiting):
            if req.seq.seq_id == request_id:
                return req
        return None

    def abort(self, request_id: str) -> bool:
        req = self.get(request_id)
        if req is None:
            return False
        if req in self.running:
            self.running.remove(req)
            self._free(req)
        else:
            self.waiting.remove(req)
        return True

    def has_unfinished(self) -> bool:
        return bool(self.running or self.waiting)

    def shutdown(self) -> None:
        self.model_runner.shutdown()

    def _free(self, req: DiffusionRequest) -> None:
        for seq in req.seqs:
            self.block_manager.free(seq)

    # ------------------------------------------------------------------ the step

    def _admit(self) -> None:
        """Waiting requests in arrival order, while the batch has room (sequences, tokens a
        pass, KV blocks for the whole canvas)."""
        budget = self.config.max_num_batched_tokens - sum(
            self._pass_tokens(req.params, req.seq.num_prompt_tokens) for req in self.running)
        bm = self.block_manager
        while self.waiting and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            need = self._pass_tokens(req.params, req.seq.num_prompt_tokens)
            blocks = sum(-(-s.num_tokens // bm.block_size) for s in req.seqs)
            if need > budget or blocks > bm.num_free_blocks:
                break
            self.waiting.popleft()
            for seq in req.seqs:
                allocate_canvas(bm, seq, req.params.dllm_cache != "none")
                seq.status = SequenceStatus.RUNNING  # the core process's admission signal
            budget -= need
            self._start_block(req)
            self.running.append(req)

    def _pass_tokens(self, params: DiffusionParams, num_prompt_tokens: int) -> int:
        """Tokens a request forwards in one step at most: its canvas (and its twin's), plus
        under a dLLM cache Dream's scoring row before the first refresh's queries."""
        rows = 2 if params.cfg_scale > 0 else 1
        extra = self.shift if params.dllm_cache != "none" else 0
        return rows * (num_prompt_tokens + params.gen_length + extra)

    def _start_block(self, req: DiffusionRequest) -> None:
        p = req.params
        start = req.block_start
        masked = req.seq.token_ids[start:start + p.block_length].count(self.mask_token_id)
        req.schedule = tuple(num_transfer_tokens(masked, p.steps_per_block))
        req.pass_in_block = 0
        req.selections = []  # the last block's kept keys go

    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        self._admit()
        if not self.running:
            return []
        runner = self.model_runner
        self._new_selections()
        spans, rows = plan_step(self.running, self.shift, self.block_manager.block_size)
        input_ids, positions, meta = pack(spans, self.block_manager.block_size, runner.device,
                                          self._table_cache)
        hidden = runner.model(input_ids, positions, meta)  # [T, hidden]
        rows_t = to_device(rows, torch.long, runner.device)  # [sum(twins * block_length)]
        logits = runner.model.compute_logits(hidden[rows_t]).float()
        cache_prompts(spans, self.block_manager)
        predicted, confidence = self._predict(logits)
        outputs = []
        offset = 0
        self.total_stats.add(StepStats(num_prefill_tokens=len(input_ids)))
        for req in list(self.running):
            n = req.params.block_length
            out = self._unmask(req, predicted[offset:offset + n], confidence[offset:offset + n])
            offset += n
            if out is not None:
                outputs.append(out)
                self.total_stats.num_decode_tokens += len(out.new_token_ids)
        return outputs

    def _new_selections(self) -> None:
        """Room for the kept keys of the requests at their block's choosing pass, which this
        step's forward fills: of the canvas's positions outside the block, the retention
        ratio's share (at least one), the same count for every layer and KV head."""
        for req in self.running:
            p = req.params
            if p.retention_ratio is None or req.pass_in_block != p.delay_step:
                continue
            candidates = req.seq.num_tokens - p.block_length
            keep = min(max(1, int(candidates * p.retention_ratio)), candidates)
            req.selections = [torch.empty(*self._selection_shape, keep, dtype=torch.long,
                                          device=self.model_runner.device)
                              for _ in req.seqs]

    def _predict(self, logits: torch.Tensor) -> tuple[list[int], list[float]]:
        """Guidance, then one prediction and confidence per block position (host lists)."""
        temps, random, seeds, keys, parts = [], [], [], [], []
        offset = 0
        for req in self.running:
            p, n = req.params, req.params.block_length
            cond = logits[offset:offset + n]
            offset += n
            if req.uncond is not None:
                uncond = logits[offset:offset + n]
                offset += n
                cond = uncond + (p.cfg_scale + 1) * (cond - uncond)
            parts.append(cond)
            temps += [p.temperature] * n
            random += [p.remasking == "random"] * n
            seeds += [req.seq.seed] * n
            keys += draw_keys(req.num_passes, range(req.block * n, (req.block + 1) * n))
        dev = logits.device
        cond = torch.cat(parts)  # [N, V]
        # Never predict the mask itself: a block must end after its passes.
        cond[:, self.mask_token_id] = -torch.inf
        predicted, confidence = predict(
            cond, to_device(temps, torch.float32, dev),
            to_device(random, torch.bool, dev), to_device(seeds, torch.long, dev),
            to_device(keys, torch.long, dev), any(t > 0 for t in temps))
        return predicted.tolist(), confidence.tolist()

    def _unmask(self, req: DiffusionRequest, predicted: list[int], confidence: list[float]
                ) -> RequestOutput | None:
        """Apply one pass to a request's block; its output once the block is final."""
        p, seq, start = req.params, req.seq, req.block_start
        block = seq.token_ids[start:start + p.block_length]
        masked = [t == self.mask_token_id for t in block]
        count = None if p.confidence_threshold is not None else req.schedule[req.pass_in_block]
        for i in choose(confidence, masked, count, p.confidence_threshold):
            seq.token_ids[start + i] = predicted[i]
            if req.uncond is not None:
                req.uncond.token_ids[start + i] = predicted[i]
        req.num_passes += 1
        req.pass_in_block += 1
        block = seq.token_ids[start:start + p.block_length]
        if self.mask_token_id in block:
            return None
        return self._finish_block(req, block)

    def _finish_block(self, req: DiffusionRequest, block: list[int]) -> RequestOutput:
        """A final block: its tokens up to an eos (which ends the request: later blocks
        would only follow it), or all of them."""
        seq, p = req.seq, req.params
        params = seq.sampling_params
        stop = None
        if not params.ignore_eos:
            stops = set(self.eos_token_ids) | set(params.stop_token_ids)
            stop = next((i for i, t in enumerate(block) if t in stops), None)
        tokens = block if stop is None else block[:stop + 1]
        req.block += 1
        done = stop is not None or req.block == p.num_blocks
        reason = "stop" if stop is not None else "length"
        stop_reason = tokens[-1] if stop is not None and tokens[-1] in params.stop_token_ids \
            else None
        num_output = req.block_start - seq.num_prompt_tokens - len(block) + len(tokens)
        if done:
            self.running.remove(req)
            self._free(req)
        else:
            self._start_block(req)
        return RequestOutput(seq.seq_id, tokens, [None] * len(tokens), done,
                             reason if done else None, stop_reason, seq.num_prompt_tokens,
                             seq.num_cached_tokens, num_output, req.num_passes)

    # ------------------------------------------------------------------ serving interface

    def load_snapshot(self) -> LoadSnapshot:
        """Requests (a guided one and its twin count once), KV blocks, and the tokens still
        to compute: a waiting request's whole canvas, a running one's positions not final."""
        left = sum(r.params.gen_length - r.block * r.params.block_length for r in self.running)
        left += sum(r.seq.num_prompt_tokens + r.params.gen_length for r in self.waiting)
        bm = self.block_manager
        return LoadSnapshot(len(self.running), len(self.waiting), bm.num_used_blocks,
                            bm.num_blocks, left)
