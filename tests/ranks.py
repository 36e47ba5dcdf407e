"""Run a function in several spawned processes that share one default process group."""

from __future__ import annotations

import socket
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from models.parallel import close_fast_all_reduce, disable_nvlink_multicast


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(fn: Callable[..., Any], world_size: int, *args: Any, backend: str = "nccl") -> Any:
    """Run `fn(rank, world_size, *args)` in `world_size` spawned processes that joined one
    default process group (NCCL with rank i on GPU i, or gloo); returns rank 0's result.
    Raises when any rank fails (the others are then killed)."""
    disable_nvlink_multicast()  # the ranks inherit it, before NCCL starts
    results = mp.get_context("spawn").SimpleQueue()
    mp.spawn(_rank_main, args=(fn, world_size, _free_port(), backend, results, args),
             nprocs=world_size, join=True)
    return None if results.empty() else results.get()


def _rank_main(rank: int, fn: Callable[..., Any], world_size: int, port: int, backend: str,
               results: Any, args: tuple) -> None:
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size)
    result = fn(rank, world_size, *args)
    # Only on success: after a failure a peer may sit in a collective that a destroy would
    # wait for; the process exits instead and spawn kills the others.
    close_fast_all_reduce()
    dist.destroy_process_group()
    if rank == 0:
        results.put(result)
