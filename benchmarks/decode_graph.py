"""Device time of one decode step, without the host: replay the engine's captured decode CUDA
graph back to back and time it with CUDA events.

`python -m benchmarks.decode_graph [--model qwen3-0.6b] [--batch 1,8] [--context 768]
[--replays 200]` (one rank; CUDA only). Each batch row attends over `--context` tokens of
the cache (contents are whatever the cache holds: the time does not depend on them). The
graph covers the layers and the final norm; the LM head and sampling run outside it. Run it
twice with NANOSERVE_PDL=0 and =1 for the A/B of programmatic dependent launch: the graphs
are captured at start-up with the setting of the time.
"""

from __future__ import annotations

import argparse
import os
import statistics

import torch


def _time_replays(graph: torch.cuda.CUDAGraph, replays: int) -> tuple[float, float]:
    """(median us of single replays, us per replay over `replays` back-to-back ones)."""
    singles = []
    for _ in range(20):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        singles.append(start.elapsed_time(end) * 1e3)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return statistics.median(singles), start.elapsed_time(end) * 1e3 / replays


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="qwen3-0.6b")
    p.add_argument("--batch", default="1")
    p.add_argument("--context", type=int, default=768)
    p.add_argument("--replays", type=int, default=200)
    args = p.parse_args()
    from benchmarks.model_configs import resolve_model
    from engine_service import LLM
    from engine_service.sampling_params import SamplingParams
    from engine_service.scheduler import ScheduledSeq
    from engine_service.tp_worker import MirrorSeq

    model_dir, preset = resolve_model(args.model)
    batches = [int(b) for b in args.batch.split(",")]
    # Graphs only up to the largest batch asked for: a shorter start-up.
    llm = LLM(model_dir, load_format="dummy" if preset else "auto",
              max_model_len=max(2048, args.context + 1), max_num_seqs=max(batches))
    runner = llm.engine.model_runner
    graphs = runner.graph_runner
    assert graphs is not None, "CUDA graphs are off (--enforce-eager?)"
    block_size = runner.block_size
    blocks_per_seq = -(-args.context // block_size)
    pdl = os.environ.get("NANOSERVE_PDL", "1")
    for batch in batches:
        assert batch * blocks_per_seq <= runner.num_kv_blocks, "context too long for the cache"
        tables = [list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq))
                  for i in range(batch)]
        # Decode rows at the last position of each context, staged as the engine stages them.
        rows = [ScheduledSeq(MirrorSeq(i, [0] * args.context, args.context - 1, table,
                                       args.context - 1, SamplingParams(), 0),
                             1, True, args.context - 1) for i, table in enumerate(tables)]
        runner.prepare_decode(rows)
        graphs.replay(batch)
        graph = graphs.graphs[graphs.padded_size(batch)]
        single, streamed = _time_replays(graph, args.replays)
        print(f"decode graph: batch {batch}, context {args.context}, NANOSERVE_PDL={pdl}: "
              f"{single:.1f} us a replay (median of 20), {streamed:.1f} us a replay over "
              f"{args.replays} back to back")
    llm.engine.shutdown()


if __name__ == "__main__":
    main()
