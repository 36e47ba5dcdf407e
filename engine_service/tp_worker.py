"""Tensor-parallel ranks: starting them, the per-step control channel, and liveness.

Rank 0 is the engine's own ModelRunner; ranks 1..N-1 are processes started here
(engine_service/tp_worker_main.py, by subprocess: the daemonic core process may not have
multiprocessing children). Every rank runs rank 0's batch, so the collectives line up, and ends
the step with the same sampled tokens on its device, so pending input tokens never wait for a
host. With SHARDED_SAMPLING (draws shaped by temperature alone) every rank draws over its vocab
shard and the ranks exchange each row's best (value, index); otherwise rank 0 samples the
gathered logits and broadcasts the tokens.

Control channel: a socketpair per worker, one message per step (a worker writes back only "up"
and its traceback on failure). A message is a flat int32 array, [flags], then per row:

    delta row: [prev_row, num_new_tokens, sample, n_tok, n_blk, n_spec, *new_tokens,
                *new_blocks, *spec_tokens]
    full row:  [-1,       num_new_tokens, sample, n_tok, n_blk, n_spec, num_computed,
                num_prompt, temperature (float32 bits), seed_hi, seed_lo, *tokens, *blocks,
                *spec_tokens]

`spec_tokens` are a verify row's proposed tokens (speculative decoding): inputs of this step
only, never part of the mirror's tokens.

`prev_row` indexes the previous step's rows; rows it does not name drop out of the worker's
mirror. Tokens are those on rank 0's host when sent. An empty message means "stop". A
message with the DRAFT flag is a draft model's proposal instead (`encode_draft`); it leaves
the mirror alone.

A dead rank raises `RuntimeError("tensor-parallel rank N died ...")` before a step or from a
failed collective; where a collective would hang instead (NCCL), a watchdog thread aborts the
process group and, if rank 0 stays stuck, exits. Workers exit when their pipe closes or their
parent changes.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import struct
import subprocess
import sys
import threading
import time
import weakref
from array import array
from collections.abc import Iterator
from dataclasses import dataclass
from multiprocessing import Pipe
from multiprocessing.connection import Connection
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from engine_service.common.sampling_params import SamplingParams
from engine_service.scheduler import ScheduledSeq
from models.layers.sampler import effective_temperature
from models.parallel import disable_nvlink_multicast

if TYPE_CHECKING:
    from engine_service.config import EngineConfig
    from engine_service.sequence import Sequence

logger = logging.getLogger(__name__)

FULL_ROW = -1
ROW_HEADER = 6  # prev_row, num_new_tokens, sample, n_tok, n_blk, n_spec
FULL_ROW_EXTRA = 5  # num_computed, num_prompt, temperature bits, seed_hi, seed_lo
SHARDED_SAMPLING = 1  # flags bit: every rank draws over its vocab shard this step
DRAFT = 2  # flags bit: the draft model's passes of one proposal (speculative decoding)
DRAFT_ROW_HEADER = 4  # num_tokens, start, k, n_blk
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=10)  # backstop; dead peers are caught sooner
STARTUP_TIMEOUT_S = 600.0  # a worker must say "up" (torch imported) within this
STUCK_GRACE_S = 5.0  # rank 0 waiting this long on a dead rank's collective is stuck
WATCH_INTERVAL_S = 0.25
STOP_TIMEOUT_S = 10.0
UP = b"up"


@dataclass(slots=True)
class MirrorSeq:
    """A worker's view of one sequence: what prepare_inputs and prepare_sampling read."""

    seq_id: int  # the worker's own numbering: keys the previous step's sampled rows
    token_ids: list[int]
    num_computed_tokens: int
    block_table: list[int]
    num_prompt_tokens: int
    sampling_params: SamplingParams  # temperature only: the rest is rank 0's business
    seed: int
    constraint: None = None  # structured output is applied by rank 0 alone


def _float_bits(x: float) -> int:
    return struct.unpack("<i", struct.pack("<f", x))[0]


def _bits_float(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<i", bits))[0]


def _sampling_fields(seq: Sequence) -> tuple[int, int, int]:
    """(temperature as float32 bits, seed high word, seed low word as a signed int32); the
    near-zero cut is applied here so rounding cannot move a row across it."""
    temperature = effective_temperature(seq.sampling_params.temperature)
    low = seq.seed & 0xFFFFFFFF
    return _float_bits(temperature), seq.seed >> 32, low - (1 << 32) if low >= 1 << 31 else low


@dataclass(slots=True)
class _Sent:
    """What rank 0 last told the workers about one sequence."""

    seq: Sequence
    num_tokens: int
    blocks: list[int]  # own copy: the block manager clears seq.block_table in place
    num_computed_tokens: int  # after the step it was sent for


class StepEncoder:
    """Rank 0's side: turns a scheduled batch into the delta against the previous step."""

    def __init__(self) -> None:
        self._prev: dict[str, tuple[int, _Sent]] = {}  # seq_id -> (row, what was sent)

    def encode(self, batch: list[ScheduledSeq], sharded_sampling: bool = False) -> bytes:
        out = array("i", [SHARDED_SAMPLING if sharded_sampling else 0])
        current: dict[str, tuple[int, _Sent]] = {}
        for row, item in enumerate(batch):
            seq = item.seq
            hit = self._prev.get(seq.seq_id)
            if hit is not None and _still_mirrored(hit[1], item):
                prev_row, sent = hit
                tokens = seq.token_ids[sent.num_tokens:]
                blocks = seq.block_table[len(sent.blocks):]
                out.extend((prev_row, item.num_new_tokens, item.sample, len(tokens),
                            len(blocks), len(item.spec_token_ids)))
                sent.blocks.extend(blocks)
            else:
                tokens, blocks = seq.token_ids, seq.block_table
                out.extend((FULL_ROW, item.num_new_tokens, item.sample, len(tokens),
                            len(blocks), len(item.spec_token_ids), item.start,
                            seq.num_prompt_tokens))
                out.extend(_sampling_fields(seq))
                sent = _Sent(seq, 0, list(blocks), 0)
            out.extend(tokens)
            out.extend(blocks)
            out.extend(item.spec_token_ids)
            sent.num_tokens = len(seq.token_ids)
            sent.num_computed_tokens = item.start + item.num_new_tokens
            current[seq.seq_id] = (row, sent)
        self._prev = current
        return out.tobytes()


def encode_draft(rows: list[tuple[Sequence, int, int]]) -> bytes:
    """A draft message: per (seq, k, start) row [num_tokens, start, k, n_blk,
    *tokens[start:], *blocks]; the workers learn the drafted tokens by broadcast."""
    out = array("i", [DRAFT])
    for seq, k, start in rows:
        out.extend((seq.num_tokens, start, k, len(seq.block_table)))
        out.extend(seq.token_ids[start:])
        out.extend(seq.block_table)
    return out.tobytes()


def decode_draft(values: list[int]) -> list[tuple[MirrorSeq, int, int]]:
    """A worker's side of encode_draft: rows over stand-in sequences whose tokens before
    `start` are zeros (the draft reads only what it feeds)."""
    rows = []
    i = 1
    while i < len(values):
        num_tokens, start, k, n_blk = values[i:i + DRAFT_ROW_HEADER]
        i += DRAFT_ROW_HEADER
        tokens = [0] * start + values[i:i + num_tokens - start]
        i += num_tokens - start
        seq = MirrorSeq(-1, tokens, start, values[i:i + n_blk], 0, SamplingParams(), 0)
        i += n_blk
        rows.append((seq, k, start))
    return rows


def _still_mirrored(sent: _Sent, item: ScheduledSeq) -> bool:
    """The worker's copy is a prefix of the row's sequence: same object (ids are reused),
    computed as far as the last step left it, same leading blocks (preemption)."""
    seq = item.seq
    return (sent.seq is seq and item.start == sent.num_computed_tokens
            and seq.block_table[:len(sent.blocks)] == sent.blocks)


def message_values(message: bytes) -> list[int]:
    """A message's int32 words: [flags, ...]."""
    data = array("i")
    data.frombytes(message)
    return data.tolist()


def decode_step(message: bytes, prev: list[MirrorSeq], ids: Iterator[int]
                ) -> tuple[list[ScheduledSeq], bool]:
    """A worker's side: (the batch rebuilt from a message and the previous step's rows,
    whether sampling is sharded). Full rows become MirrorSeqs numbered from `ids`."""
    values = message_values(message)
    batch: list[ScheduledSeq] = []
    i = 1
    while i < len(values):
        prev_row, num_new, sample, n_tok, n_blk, n_spec = values[i:i + ROW_HEADER]
        i += ROW_HEADER
        if prev_row == FULL_ROW:
            computed, num_prompt, temperature, seed_hi, seed_lo = \
                values[i:i + FULL_ROW_EXTRA]
            i += FULL_ROW_EXTRA
            seq = MirrorSeq(next(ids), values[i:i + n_tok], computed,
                            values[i + n_tok:i + n_tok + n_blk], num_prompt,
                            SamplingParams(temperature=_bits_float(temperature)),
                            (seed_hi << 32) | (seed_lo & 0xFFFFFFFF))
        else:
            seq = prev[prev_row]
            seq.token_ids.extend(values[i:i + n_tok])
            seq.block_table.extend(values[i + n_tok:i + n_tok + n_blk])
        i += n_tok + n_blk
        spec = values[i:i + n_spec]
        i += n_spec
        batch.append(ScheduledSeq(seq, num_new, bool(sample),  # type: ignore[arg-type]
                                  seq.num_computed_tokens, spec))
    return batch, bool(values[0] & SHARDED_SAMPLING)


def finish_step(batch: list[ScheduledSeq]) -> list[MirrorSeq]:
    """After a worker's forward: the rows' KV is computed; they are the next `prev`."""
    for item in batch:
        item.seq.num_computed_tokens += item.num_new_tokens
    return [item.seq for item in batch]  # type: ignore[misc]


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def join_process_group(device: torch.device, init_method: str, rank: int,
                       world_size: int, store: dist.Store | None = None) -> None:
    """Join the default process group through the TCPStore at `init_method`
    (tcp://HOST:PORT); rank 0 passes the store it serves."""
    if store is None:
        host, port = init_method.removeprefix("tcp://").rsplit(":", 1)
        store = dist.TCPStore(host, int(port), world_size, False,
                              timeout=datetime.timedelta(seconds=STARTUP_TIMEOUT_S))
    disable_nvlink_multicast()  # before NCCL reads its environment
    dist.init_process_group(backend_for(device), store=store, rank=rank,
                            world_size=world_size, timeout=COLLECTIVE_TIMEOUT)


def agree_on_num_kv_blocks(num_blocks: int, device: torch.device) -> int:
    """Every rank must hold the same blocks: the smallest count any rank can afford."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return num_blocks
    t = torch.tensor([num_blocks], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())


def start_tensor_parallel(config: EngineConfig, rank: int,
                          device: torch.device) -> TPWorkers | None:
    """Rank 0 starts its workers and joins the group here (workers have joined already).
    One TP engine per process: the group is the process-wide default one."""
    if rank != 0:
        return None
    if dist.is_available() and dist.is_initialized():
        raise RuntimeError(
            "a tensor-parallel engine is already running in this process (its process group "
            "is the default one); shut it down (LLM.engine.shutdown()) before creating "
            "another engine here")
    if config.tensor_parallel_size == 1:
        return None
    if device.type == "cuda" and torch.cuda.device_count() < config.tensor_parallel_size:
        raise ValueError(f"tensor_parallel_size={config.tensor_parallel_size} needs as many "
                         f"GPUs, found {torch.cuda.device_count()}")
    return TPWorkers(config, device)


class _Liveness:
    """State the watchdog thread shares with rank 0's main thread (no ref to TPWorkers, so
    the finalizer can run)."""

    def __init__(self, procs: dict[int, subprocess.Popen]) -> None:
        self.procs = procs
        self.busy_since: float | None = None  # set while rank 0 may wait in a collective
        self.stop = threading.Event()

    def dead_rank(self) -> tuple[int, int] | None:
        for rank, proc in self.procs.items():
            code = proc.poll()
            if code is not None:
                return rank, code
        return None


class TPWorkers:
    """Ranks 1..N-1 as seen from rank 0: start, per-step messages, liveness, stop."""

    def __init__(self, config: EngineConfig, device: torch.device) -> None:
        self.world_size = config.tensor_parallel_size
        self.device = device
        self.encoder = StepEncoder()
        self.controls: dict[int, Connection] = {}
        procs: dict[int, subprocess.Popen] = {}
        self.live = _Liveness(procs)
        self.failed_because: str | None = None
        self._finalizer = weakref.finalize(self, _stop_workers, procs, self.controls,
                                           self.live, False)
        # Serve the store on a port the kernel picks, so two engines never collide.
        store = dist.TCPStore("127.0.0.1", 0, self.world_size, True,
                              timeout=datetime.timedelta(seconds=STARTUP_TIMEOUT_S),
                              wait_for_workers=False)
        init_method = f"tcp://127.0.0.1:{store.port}"
        self.live.busy_since = time.monotonic()  # start-up runs collectives until ready()
        try:
            for rank in range(1, self.world_size):
                procs[rank], self.controls[rank] = _spawn_worker(config, rank, init_method)
            self._wait_until_up()
            threading.Thread(target=_watch, args=(self.live,), name="tp-watchdog",
                             daemon=True).start()
            join_process_group(device, init_method, 0, self.world_size, store)
        except BaseException:
            self.shutdown()
            raise
        logger.info("tensor parallel: %d ranks, %s, store %s", self.world_size,
                    backend_for(device), init_method)

    def _wait_until_up(self) -> None:
        """Each worker says "up" before joining the group, so one that cannot start fails
        here with its own error, not in the rendezvous."""
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        for rank, conn in self.controls.items():
            while not conn.poll(WATCH_INTERVAL_S):
                if self.live.procs[rank].poll() is not None or time.monotonic() > deadline:
                    raise self._dead_error(rank, "while starting")
            try:
                msg = conn.recv_bytes()
            except (EOFError, OSError):
                raise self._dead_error(rank, "while starting") from None
            if msg != UP:
                raise RuntimeError(f"tensor-parallel rank {rank} failed to start:\n"
                                   f"{msg.decode(errors='replace')}")

    def ready(self) -> None:
        """Start-up collectives are done (the ModelRunner is built on every rank)."""
        self.live.busy_since = None

    @contextlib.contextmanager
    def step(self, batch: list[ScheduledSeq], sharded_sampling: bool) -> Iterator[None]:
        """Send the step to every worker, then let rank 0 launch it (under `guard`)."""
        with self.run(self.encoder.encode(batch, sharded_sampling)):
            yield

    @contextlib.contextmanager
    def run(self, message: bytes) -> Iterator[None]:
        """Send a message to every worker, then let rank 0 do its part (under `guard`)."""
        self.check_alive()
        for rank, conn in self.controls.items():
            try:
                conn.send_bytes(message)
            except OSError:
                raise self._dead_error(rank, "before a step", wait=True) from None
        with self.guard():
            yield

    @contextlib.contextmanager
    def guard(self) -> Iterator[None]:
        """Rank 0 may wait on the workers in here: the watchdog looks, and a dead rank
        becomes one clear RuntimeError."""
        self.live.busy_since = time.monotonic()
        try:
            yield
        except BaseException as exc:  # Ctrl-C too
            # The workers may now wait in a collective rank 0 never reaches: no more steps.
            self.failed_because = f"{type(exc).__name__}: {exc}"
            if not isinstance(exc, Exception):
                raise
            dead = self._find_dead(wait=isinstance(exc, RuntimeError))
            if dead is not None:
                raise self._dead_error(dead[0], "during a step") from exc
            raise
        finally:
            self.live.busy_since = None

    def check_alive(self) -> None:
        """Raise the clear error if a rank has died (cheap: one waitpid per worker)."""
        if self.failed_because is not None:
            raise RuntimeError(f"a tensor-parallel step failed earlier ({self.failed_because})"
                               f"; the ranks may be out of step, so the engine cannot go on")
        dead = self.live.dead_rank()
        if dead is not None:
            raise self._dead_error(dead[0], "")

    def _find_dead(self, wait: bool) -> tuple[int, int] | None:
        # A collective error may arrive a moment before the peer's exit is visible.
        deadline = time.monotonic() + (2.0 if wait else 0.0)
        while True:
            dead = self.live.dead_rank()
            if dead is not None or time.monotonic() >= deadline:
                return dead
            time.sleep(0.05)

    def _dead_error(self, rank: int, when: str, wait: bool = False) -> RuntimeError:
        proc = self.live.procs[rank]
        code = proc.poll()
        if code is None and wait:
            with contextlib.suppress(subprocess.TimeoutExpired):
                code = proc.wait(2.0)
        how = ("is not responding" if code is None else
               f"died (killed by signal {-code})" if code < 0 else f"died (exit code {code})")
        reason = _worker_error(self.controls[rank])
        message = (f"tensor-parallel rank {rank} (pid {proc.pid}) {how}"
                   f"{' ' + when if when else ''}; the engine cannot continue without it")
        self.failed_because = message
        return RuntimeError(message + (f". Its error:\n{reason}" if reason else ""))

    def shutdown(self) -> None:
        # Not idle (start-up or a step broke off): the workers may wait in a collective.
        stuck = self.failed_because is not None or self.live.busy_since is not None
        self._finalizer.detach()
        _stop_workers(self.live.procs, self.controls, self.live, stuck)


def _worker_error(conn: Connection) -> str:
    """The traceback a failing worker wrote back, if any."""
    text = ""
    with contextlib.suppress(EOFError, OSError):
        while conn.poll(0):
            msg = conn.recv_bytes()
            if msg != UP:
                text = msg.decode(errors="replace").strip()
    return text


def _spawn_worker(config: EngineConfig, rank: int,
                  init_method: str) -> tuple[subprocess.Popen, Connection]:
    ours, theirs = Pipe(duplex=True)
    package_root = str(Path(__file__).resolve().parent.parent)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    proc = subprocess.Popen(
        [sys.executable, "-m", "engine_service.tp_worker_main", str(os.getpid()),
         str(theirs.fileno())],
        pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, env=env)
    theirs.close()  # so the worker sees EOF when rank 0 goes away, and rank 0 when it does
    ours.send((config, rank, init_method))
    return proc, ours


def _watch(live: _Liveness) -> None:
    """Rank 0's watchdog: a collective waiting on a dead rank (NCCL does not notice) would
    hang forever. Abort the group; if that does not free rank 0, exit."""
    dead_since: float | None = None
    aborted_at: float | None = None
    while not live.stop.wait(WATCH_INTERVAL_S):
        dead = live.dead_rank()
        busy = live.busy_since
        if dead is None or busy is None:
            dead_since = None if dead is None else dead_since
            continue
        now = time.monotonic()
        dead_since = dead_since or now
        if now - max(dead_since, busy) < STUCK_GRACE_S:
            continue
        if aborted_at is None:
            logger.error("tensor-parallel rank %d died (status %d) and rank 0 is stuck in a "
                         "collective; aborting the process group", *dead)
            aborted_at = now
            with contextlib.suppress(Exception):
                dist.distributed_c10d._abort_process_group()
        elif now - aborted_at >= STUCK_GRACE_S:
            logger.critical("tensor-parallel rank %d died (status %d); rank 0 is still stuck "
                            "in a collective: exiting", *dead)
            logging.shutdown()
            os._exit(1)


def _stop_workers(procs: dict[int, subprocess.Popen], controls: dict[int, Connection],
                  live: _Liveness, failed: bool) -> None:
    """Ask the workers to stop (kill them if a step failed: they may sit in a collective),
    reap them, and leave the process group so this process can host another engine."""
    live.stop.set()
    for conn in controls.values():
        with contextlib.suppress(OSError):
            if not failed:
                conn.send_bytes(b"")
    deadline = time.monotonic() + (0 if failed else STOP_TIMEOUT_S)
    for proc in procs.values():
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(max(0.0, deadline - time.monotonic()))
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    for conn in controls.values():
        conn.close()
    if dist.is_available() and dist.is_initialized():
        if failed and dist.get_backend() == "nccl":  # a destroy could wait on a dead peer
            with contextlib.suppress(Exception):
                dist.distributed_c10d._abort_process_group()
        if dist.is_initialized():
            with contextlib.suppress(Exception):
                dist.destroy_process_group()
