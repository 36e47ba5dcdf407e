"""A tensor-parallel worker process (ranks 1..N-1), started by engine_service/tp_worker.py's
TPWorkers: joins the process group, builds its ModelRunner shard and replays every step
rank 0 sends over its control pipe."""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import signal
import sys
import threading
import time
import traceback
from multiprocessing.connection import Connection

import torch
import torch.distributed as dist

from engine_service.config import EngineConfig, cpu_threads
from engine_service.model_runner import ModelRunner, resolve_device
from engine_service.tp_worker import (
    DRAFT,
    UP,
    WATCH_INTERVAL_S,
    MirrorSeq,
    decode_draft,
    decode_step,
    finish_step,
    join_process_group,
    message_values,
)

logger = logging.getLogger(__name__)


def run_worker(config: EngineConfig, rank: int, init_method: str, control: Connection) -> int:
    """A worker rank: join the group, build this rank's shard, replay rank 0's steps."""
    device = resolve_device(config.device)
    if device.type == "cuda":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    else:  # the ranks share the host's cores
        torch.set_num_threads(cpu_threads(config.tensor_parallel_size))
    runner = None
    try:
        control.send_bytes(UP)
        join_process_group(device, init_method, rank, config.tensor_parallel_size)
        runner = ModelRunner(config, rank)
        logger.info("rank %d ready", rank)
        _replay_steps(runner, control)
        return 0
    except (EOFError, BrokenPipeError):
        return 0  # rank 0 went away: nothing left to do
    except Exception:
        text = traceback.format_exc()
        logger.error("tensor-parallel rank %d failed:\n%s", rank, text)
        with contextlib.suppress(OSError):
            control.send_bytes(text.encode())
        return 1
    finally:
        if runner is not None:
            runner.shutdown()
        if dist.is_initialized():
            with contextlib.suppress(Exception):
                dist.destroy_process_group()


@torch.inference_mode()
def _replay_steps(runner: ModelRunner, control: Connection) -> None:
    mirror: list[MirrorSeq] = []
    ids = itertools.count()
    while True:
        message = control.recv_bytes()
        if not message:
            return
        if message_values(message[:4])[0] & DRAFT:
            assert runner.drafter is not None
            runner.drafter.draft(decode_draft(message_values(message)))
            continue
        batch, sharded_sampling = decode_step(message, mirror, ids)
        runner.replay(batch, sharded_sampling)  # queued on the device; never waited for
        mirror = finish_step(batch)


def _exit_when_orphaned(parent_pid: int) -> None:
    """Rank 0 can die without closing anything (SIGKILL), and this worker may then sit in a
    collective no pipe EOF can reach: poll the parent and leave when it changes."""

    def watch() -> None:
        while True:
            if os.getppid() != parent_pid:
                os._exit(1)
            time.sleep(WATCH_INTERVAL_S)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def main() -> None:
    """`python -m engine_service.tp_worker_main PARENT_PID FD` (started by TPWorkers)."""
    parent_pid, fd = int(sys.argv[1]), int(sys.argv[2])
    _exit_when_orphaned(parent_pid)
    # Ctrl-C reaches the whole process group; rank 0 decides when the workers stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    control = Connection(fd)
    config, rank, init_method = control.recv()
    logging.basicConfig(level=os.environ.get("NANOSERVE_LOG_LEVEL", "INFO"),
                        format=f"%(asctime)s rank{rank} %(levelname)s %(name)s: %(message)s")
    sys.exit(run_worker(config, rank, init_method, control))


if __name__ == "__main__":
    main()
