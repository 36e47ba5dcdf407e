"""Benchmark workloads, shared by the offline and serving benchmarks."""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass
class BenchRequest:
    prompt_token_ids: list[int]
    max_tokens: int


def nano_vllm_workload(num_seqs: int = 256, min_input_len: int = 100, max_input_len: int = 1024,
                       min_output_len: int = 100, max_output_len: int = 1024, seed: int = 0,
                       max_token_id: int = 10000) -> list[BenchRequest]:
    """The "nano-vllm bench" workload: random token ids in [0, max_token_id), prompt lengths
    and max_tokens uniform in their ranges; run with temperature 0.6 and ignore_eos."""
    rng = random.Random(seed)
    reqs = []
    for _ in range(num_seqs):
        n_in = rng.randint(min(min_input_len, max_input_len), max_input_len)
        n_out = rng.randint(min(min_output_len, max_output_len), max_output_len)
        reqs.append(BenchRequest([rng.randrange(max_token_id) for _ in range(n_in)], n_out))
    return reqs


def add_workload_arguments(parser) -> None:
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--min-input-len", type=int, default=100)
    parser.add_argument("--max-input-len", type=int, default=1024)
    parser.add_argument("--min-output-len", type=int, default=100)
    parser.add_argument("--max-output-len", type=int, default=1024)
    parser.add_argument("--temperature", type=float, default=0.6)
    parser.add_argument("--workload-seed", type=int, default=0)


def workload_from_args(args, vocab_size: int) -> list[BenchRequest]:
    return nano_vllm_workload(args.num_seqs, args.min_input_len, args.max_input_len,
                              args.min_output_len, args.max_output_len, args.workload_seed,
                              max_token_id=min(10000, vocab_size))
