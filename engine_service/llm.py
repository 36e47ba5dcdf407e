"""Offline batch generation: `LLM(model_dir, **engine_config).generate(prompts, params)`."""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence as SequenceT
from dataclasses import dataclass, field

from tqdm.auto import tqdm

from engine_service.common.detokenizer import (
    IncrementalDetokenizer,
    apply_output,
    tokenizer_if_present,
)
from engine_service.common.sampling_params import SamplingParams, check_field
from engine_service.config import EngineConfig
from engine_service.engines import make_engine

Prompt = str | list[int]


@dataclass
class CompletionOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    num_cached_tokens: int = 0
    logprobs: list = field(default_factory=list)


class LLM:
    def __init__(self, model: str, **engine_config):
        self.config = EngineConfig(model=model, **engine_config)
        self.engine = make_engine(self.config)
        self.tokenizer = tokenizer_if_present(model)
        self._ids = itertools.count()

    def generate(self, prompts: Prompt | SequenceT[Prompt],
                 sampling_params: SamplingParams | SequenceT[SamplingParams] | None = None,
                 use_tqdm: bool = True,
                 priority: SequenceT[int] | None = None) -> list[CompletionOutput]:
        """One output per prompt. `priority`: one int per prompt, lower runs earlier (under
        scheduling_policy="priority"); None: all 0."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"sampling_params must be one SamplingParams or one per prompt "
                             f"({len(prompts)}), got {len(sampling_params)}")
        priority = [0] * len(prompts) if priority is None else list(priority)
        check_field(len(priority) == len(prompts) and all(isinstance(p, int) for p in priority),
                    "priority", f"one int per prompt ({len(prompts)})", priority)
        if self.tokenizer is None and any(isinstance(p, str) for p in prompts):
            raise ValueError("prompts must be token-id lists: this model directory has no "
                             "tokenizer")
        token_lists = [self.tokenizer.encode(p) if isinstance(p, str) else list(p)
                       for p in prompts]

        outputs: dict[str, CompletionOutput] = {}
        detoks: dict[str, IncrementalDetokenizer] = {}
        skip_special: dict[str, bool] = {}
        order: list[str] = []
        try:
            # A bad prompt raises before any step runs; the requests added before it are aborted.
            for ids, sp, prio in zip(token_lists, sampling_params, priority, strict=True):
                rid = f"llm-{next(self._ids)}"
                self.engine.add_request(rid, ids, sp, prio)
                order.append(rid)
                outputs[rid] = CompletionOutput(rid, ids)
                if self.tokenizer is not None and sp.stop:
                    # Stop strings are looked for as the text grows; without them the text
                    # is decoded once, when the request ends.
                    detoks[rid] = IncrementalDetokenizer(self.tokenizer,
                                                         sp.skip_special_tokens, sp.stop)
                skip_special[rid] = sp.skip_special_tokens
            self._run(outputs, detoks, skip_special, use_tqdm)
        finally:
            for rid in order:  # on an error (or Ctrl-C) leave nothing behind in the engine
                self.engine.abort(rid)
        return [outputs[rid] for rid in order]

    def _run(self, outputs: dict[str, CompletionOutput],
             detoks: dict[str, IncrementalDetokenizer], skip_special: dict[str, bool],
             use_tqdm: bool) -> None:
        bar = tqdm(total=len(outputs), desc="Generating", disable=not use_tqdm,
                   dynamic_ncols=True)
        # The bar shows prompt (prefill=) and decode (decode=) tokens per wall-clock second
        # since the start, so decode= tends to the run's output throughput. A step's own time
        # is only its launch under async scheduling: per-step rates would mean little.
        start, totals = time.perf_counter(), self.engine.total_stats
        base = (totals.num_prefill_tokens, totals.num_decode_tokens)
        pending = set(outputs)
        while pending:
            step_outputs = self.engine.step()
            # Runs for every row of every step: no generator per output.
            for ro in step_outputs:
                if ro.request_id not in pending:
                    continue
                out, detok = outputs[ro.request_id], detoks.get(ro.request_id)
                step = apply_output(detok, ro)
                out.token_ids += ro.new_token_ids[:step.num_tokens]
                for lp in ro.new_logprobs[:step.num_tokens]:
                    if lp is not None:
                        out.logprobs.append(lp)
                out.num_cached_tokens = ro.num_cached_tokens
                if step.stopped_by_text:
                    self.engine.abort(ro.request_id)
                if step.finished:
                    out.finish_reason, out.stop_reason = step.finish_reason, step.stop_reason
                    out.text = self._text(out, detok, skip_special[ro.request_id])
                    pending.discard(ro.request_id)
                    bar.update(1)
            if use_tqdm:
                elapsed = max(time.perf_counter() - start, 1e-9)
                bar.set_postfix(
                    prefill=f"{(totals.num_prefill_tokens - base[0]) / elapsed:.0f}tok/s",
                    decode=f"{(totals.num_decode_tokens - base[1]) / elapsed:.0f}tok/s",
                    refresh=False)
        bar.close()

    def _text(self, out: CompletionOutput, detok: IncrementalDetokenizer | None,
              skip_special_tokens: bool) -> str:
        if detok is not None:
            return detok.output_text
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(out.token_ids, skip_special_tokens=skip_special_tokens)
