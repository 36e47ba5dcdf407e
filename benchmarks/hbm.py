"""HBM bandwidth: a large device-to-device copy (the ceiling) against what one decode step
moves (every weight once, plus the KV cache of the batch) over its measured time."""

from __future__ import annotations

import argparse

import torch


def copy_bandwidth(gib: float = 4.0) -> float:
    n = int(gib * 2**30) // 2
    src = torch.randn(n, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    times = []
    for _ in range(20):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    times.sort()
    return 2 * src.numel() * src.element_size() / times[len(times) // 2]  # read + write


def decode_step_bandwidth(model_dir: str, batch: int, context: int) -> tuple[float, float, int]:
    """Median time of one CUDA-graph decode step and the bytes it must move."""
    from engine_service.block_manager import BlockManager
    from engine_service.config import EngineConfig
    from engine_service.model_runner import ModelRunner
    from engine_service.sampling_params import SamplingParams
    from engine_service.scheduler import ScheduledSeq
    from engine_service.sequence import Sequence

    cfg = EngineConfig(model=model_dir, load_format="dummy", max_model_len=context + 64,
                       max_num_seqs=max(batch, 1), num_kv_blocks=batch * (context // 16 + 8))
    runner = ModelRunner(cfg)
    bm = BlockManager(runner.num_kv_blocks, cfg.kv_block_size)
    seqs = []
    for i in range(batch):
        seq = Sequence(f"s{i}", [(i * 7 + j) % 10000 for j in range(context)], SamplingParams())
        bm.allocate(seq, context)
        seq.num_computed_tokens = context - 1
        seqs.append(seq)
    sched = [ScheduledSeq(s, 1, True, context - 1) for s in seqs]
    for _ in range(3):
        runner.execute(sched, [])
    times = []
    for _ in range(30):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.inference_mode():
            runner.run_model(sched, start)  # staged, then start, graph replay and logits
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    times.sort()
    weights = sum(p.numel() * p.element_size() for p in runner.model.parameters())
    kv = batch * context * runner.kv_bytes_per_block // cfg.kv_block_size
    return times[len(times) // 2], weights + kv, weights


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    args = p.parse_args()
    bw = copy_bandwidth()
    print(f"ROW HBM copy bandwidth | {bw / 1e12:.2f} TB/s | read+write, 4 GiB bf16")
    for batch, context in ((1, 1024), (64, 1024), (256, 1024)):
        t, nbytes, weights = decode_step_bandwidth(args.model, batch, context)
        print(f"ROW decode step B={batch} ctx={context} | {t * 1e3:.3f} ms, "
              f"{nbytes / t / 1e12:.2f} TB/s ({nbytes / t / bw:.0%} of copy) | "
              f"{nbytes / 2**20:.0f} MiB moved (weights {weights / 2**20:.0f} MiB)")


if __name__ == "__main__":
    main()
