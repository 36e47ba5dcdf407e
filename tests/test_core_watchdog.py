"""A hung engine core (SIGSTOPped while it has work) turns the engine NOT_SERVING and
refuses new requests, and the engine recovers once the core makes progress again."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable

import grpc
import pytest

from benchmarks.procs import core_pid
from clients import Client
from clients.errors import Unavailable
from nanoserve.v1 import nanoserve_pb2 as pb
from nanoserve.v1 import nanoserve_pb2_grpc as pb_grpc
from tests.procs import start_engine, wait_blocks_free

pytestmark = pytest.mark.timeout(120)


def wait_until(check: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.05)
    return check()


def test_stopped_core_turns_not_serving_and_recovers(tiny_model_dir):
    eng = start_engine(tiny_model_dir, "--max-model-len", "512", "--core-watchdog-timeout", "1")
    core = core_pid(eng.proc.pid)
    stream = None
    try:
        with Client(eng.target, timeout=10) as c:
            assert c.health() == "SERVING"
            stub = pb_grpc.GenerationStub(grpc.insecure_channel(eng.target))
            sampling = pb.SamplingParams(temperature=0, max_tokens=500, ignore_eos=True)
            stream = stub.Stream(pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5] * 4),
                                                    sampling=sampling), timeout=60)
            assert next(stream).token_ids
            os.kill(core, signal.SIGSTOP)
            assert c.load().num_running == 1, "the stream must still be in flight"

            assert wait_until(lambda: c.health() == "NOT_SERVING", 3), \
                "a stopped core with work in flight still reports SERVING"
            assert not c.load().accepting
            with pytest.raises(Unavailable, match="engine core has made no progress"):
                c.generate([1, 2], max_tokens=2)

            os.kill(core, signal.SIGCONT)
            assert wait_until(lambda: c.health() == "SERVING", 3), eng.output()[-3000:]
            assert c.load().accepting
            assert c.generate([1, 2], temperature=0, max_tokens=2).finish_reason == "length"
            stream.cancel()
            assert wait_blocks_free(c).kv_blocks_used == 0
        assert "no progress" in eng.output()
    finally:
        os.kill(core, signal.SIGCONT)  # never leave a stopped process behind
        if stream is not None:
            stream.cancel()
        eng.stop()
