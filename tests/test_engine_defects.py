"""Regression tests for engine-service defects: CPU thread sizing, huge prompts (event loop,
size limit, memory), long values in error messages, undecodable requests, float32
conversion of sampling values, and how expired deadlines are counted."""

from __future__ import annotations

import os
import re
import socket
import threading
import time
import urllib.request

import grpc
import pytest

from benchmarks.procs import ServerProc
from engine_service.common.proto_convert import sampling_params_from_proto
from nanoserve.v1 import nanoserve_pb2 as pb
from nanoserve.v1 import nanoserve_pb2_grpc as pb_grpc
from tests.procs import rss_bytes, start_engine

pytestmark = pytest.mark.timeout(300)
HUGE_TEXT = ("hello world, this is a test of the tokenizer. " * 70_000)[:3_000_000]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def metrics_port():
    return _free_port()


@pytest.fixture(scope="module")
def engine(tiny_model_dir, metrics_port):
    proc = start_engine(tiny_model_dir, "--kv-block-size", "4", "--max-model-len", "512",
                        "--metrics-port", str(metrics_port))
    yield proc
    assert proc.stop() == 0, proc.output()[-3000:]


@pytest.fixture(scope="module")
def stub(engine):
    with grpc.insecure_channel(engine.target) as channel:
        yield pb_grpc.GenerationStub(channel)


def _request(prompt, **sampling) -> pb.GenerateRequest:
    sp = pb.SamplingParams(**sampling)
    if isinstance(prompt, str):
        return pb.GenerateRequest(text=prompt, sampling=sp)
    return pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), sampling=sp)


def _rejected(stub, request, timeout: float = 30) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as err:
        stub.Generate(request, timeout=timeout)
    return err.value


def _engine_still_serves(stub) -> None:
    resp = stub.Generate(_request([1, 2, 3], temperature=0, max_tokens=3, ignore_eos=True),
                         timeout=30)
    assert len(resp.token_ids) == 3


# ------------------------------------------------------------------ #2 threads


def test_cpu_threads_share_of_affinity_unless_omp_num_threads(monkeypatch):
    from engine_service.config import cpu_threads

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3}, raising=False)
    assert cpu_threads() == 4 and cpu_threads(2) == 2 and cpu_threads(8) == 1
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert cpu_threads() == 3 and cpu_threads(2) == 3


def _torch_threads(proc: ServerProc) -> int:
    found = re.findall(r"torch threads: (\d+)", proc.output())
    assert found, proc.output()[-3000:]
    return int(found[-1])


def test_engine_core_sizes_torch_threads_to_its_cores(tiny_model_dir):
    """Two engines on one host, as `make run` starts them: one told OMP_NUM_THREADS=1, one
    pinned to a single core (and no OMP_NUM_THREADS); each core process runs torch on one
    thread rather than on every core of the host."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("needs at least two cores to tell a share from all of them")
    args = ["engine", "--model", str(tiny_model_dir), "--port", "0", "--device", "cpu",
            "--dtype", "float32", "--num-kv-blocks", "64", "--max-model-len", "256"]
    told = ServerProc("engine-omp", args, {"OMP_NUM_THREADS": "1"})
    os.sched_setaffinity(0, cpus[:1])  # inherited by the engine and its core process
    try:
        pinned = ServerProc("engine-pinned", args, {"OMP_NUM_THREADS": ""})
    finally:
        os.sched_setaffinity(0, cpus)
    try:
        for proc in (told, pinned):
            proc.wait_for("nanoserve engine ready", 120)
            assert _torch_threads(proc) == 1
    finally:
        assert told.stop() == 0 and pinned.stop() == 0


# ------------------------------------------------------------------ #5, #6 huge prompts


def test_tokenizer_encode_lets_other_threads_run(tiny_model_dir):
    """Encoding a 3 MB text (seconds of work) must release the GIL, or tokenizing it on a
    worker thread still freezes the event loop."""
    from engine_service.common.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(tiny_model_dir)
    assert tok.encode("hello world") == tok._backend.encode("hello world").ids
    done = threading.Event()
    worker = threading.Thread(target=lambda: (tok.encode(HUGE_TEXT), done.set()))
    gaps, last = [], time.perf_counter()
    worker.start()
    while not done.is_set():
        time.sleep(0.005)
        now = time.perf_counter()
        gaps.append(now - last)
        last = now
    worker.join()
    assert max(gaps) < 0.5, f"the encoding thread held the GIL for {max(gaps):.2f}s"


def test_huge_text_prompt_is_refused_before_tokenizing_and_streams_keep_flowing(stub):
    running = stub.Stream(_request([5] * 10, temperature=0, max_tokens=400, ignore_eos=True))
    gaps: list[float] = []
    tokens: list[int] = []
    first = threading.Event()

    def consume():
        last = None
        for chunk in running:
            now = time.perf_counter()
            if last is not None:
                gaps.append(now - last)
            last = now
            tokens.extend(chunk.token_ids)
            first.set()

    reader = threading.Thread(target=consume, daemon=True)
    reader.start()
    assert first.wait(30)
    for _ in range(3):
        t0 = time.perf_counter()
        err = _rejected(stub, _request(HUGE_TEXT, max_tokens=4))
        took = time.perf_counter() - t0
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err.details()
        assert re.match(r"text must be at most \d+ bytes", err.details()), err.details()
        assert len(err.details()) < 300
        assert took < 1.0, f"the huge prompt took {took:.2f}s to refuse"
    reader.join(60)
    assert len(tokens) == 400
    assert max(gaps) < 0.5, f"the running stream stalled for {max(gaps):.2f}s"


def test_prompt_byte_limit_names_field_and_limit():
    from engine_service.common.proto_convert import check_prompt_bytes

    limit = 512 * 32
    check_prompt_bytes(pb.GenerateRequest(text="a" * limit), 512)
    check_prompt_bytes(pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1] * 5000)), 512)
    with pytest.raises(ValueError, match=rf"^text must be at most {limit} bytes .* got "
                                         rf"'{limit + 1} bytes'$"):
        check_prompt_bytes(pb.GenerateRequest(text="a" * (limit + 1)), 512)
    many = pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="a" * 200)] * 100)
    with pytest.raises(ValueError, match=rf"^messages must be at most {limit} bytes"):
        check_prompt_bytes(pb.GenerateRequest(messages=many), 512)


def test_rejected_huge_prompts_do_not_pile_up_memory(engine, stub):
    _engine_still_serves(stub)
    before = rss_bytes(engine.proc.pid)
    for _ in range(30):
        err = _rejected(stub, _request(HUGE_TEXT, max_tokens=4))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err.details()
    grown = rss_bytes(engine.proc.pid) - before
    assert grown < 100 << 20, f"frontend RSS grew by {grown >> 20} MiB"
    # A message far past any prompt limit is refused by grpc before it is parsed.
    err = _rejected(stub, _request("a" * (64 << 20), max_tokens=4))
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err.details()
    _engine_still_serves(stub)


# ------------------------------------------------------------------ #8 long values


def test_check_field_quotes_a_short_prefix():
    from engine_service.common.sampling_params import check_field

    with pytest.raises(ValueError) as err:
        check_field(False, "stop", "strings of 1..256 characters", "x" * 20_000)
    msg = str(err.value)
    assert len(msg) < 200 and "20000" in msg and msg.startswith("stop must be"), msg
    with pytest.raises(ValueError, match=r"got 'abc'$"):
        check_field(False, "stop", "short", "abc")


def test_long_values_are_not_echoed_in_errors(engine, stub):
    for sampling, field in [({"stop": ["x" * 20_000]}, "stop"),
                            ({"stop_token_ids": [7] * 20_000}, "stop_token_ids")]:
        err = _rejected(stub, _request([1, 2, 3], max_tokens=4, **sampling))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err.details()[:200]
        assert err.details().startswith(field) and len(err.details()) < 300, err.details()
    _engine_still_serves(stub)


# ------------------------------------------------------------------ #9 undecodable bytes


def test_undecodable_request_is_invalid_argument(engine, stub):
    bad_text = b"\x12\x02\xff\xfe"  # field 2 (text), length 2, not UTF-8
    with grpc.insecure_channel(engine.target) as channel:
        for method, call in (("Generate", channel.unary_unary), ("Stream", channel.unary_stream)):
            rpc = call(f"/nanoserve.v1.Generation/{method}")  # bytes in, bytes out
            with pytest.raises(grpc.RpcError) as err:
                result = rpc(bad_text, timeout=10)
                if method == "Stream":
                    list(result)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
            assert "could not be decoded" in err.value.details()
    assert "Traceback" not in engine.output()
    _engine_still_serves(stub)


# ------------------------------------------------------------------ #10 float32 values


def test_small_float32_values_reach_sampling_params_unrounded():
    msg = pb.SamplingParams(top_p=4e-7, repetition_penalty=4e-7, min_p=4e-7, temperature=0.9)
    params = sampling_params_from_proto(msg)
    assert (params.top_p, params.repetition_penalty, params.min_p) == (4e-7, 4e-7, 4e-7)
    assert params.temperature == 0.9  # still the decimal the client wrote
    assert sampling_params_from_proto(pb.SamplingParams(top_p=1.0)).top_p == 1.0


def test_small_float32_values_are_accepted(stub):
    resp = stub.Generate(_request([1, 2, 3], top_p=4e-7, repetition_penalty=4e-7, min_p=4e-7,
                                  max_tokens=3, ignore_eos=True), timeout=30)
    assert len(resp.token_ids) == 3


# ------------------------------------------------------------------ deadline metrics


def _outcomes(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return {m[0]: float(m[1]) for m in re.findall(
        r'^nanoserve_engine_requests_total\{outcome="(\w+)"\} (\S+)$', text, re.M)}


def test_expired_deadline_is_counted_as_deadline_exceeded(engine, stub, metrics_port):
    before = _outcomes(metrics_port)
    err = _rejected(stub, _request([6] * 30, temperature=0, max_tokens=400, ignore_eos=True),
                    timeout=0.3)
    assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    call = stub.Stream(_request([7] * 30, temperature=0, max_tokens=400, ignore_eos=True))
    next(call)
    call.cancel()
    deadline = time.monotonic() + 10
    while True:
        after = _outcomes(metrics_port)
        grew = {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}
        if grew == {"deadline_exceeded": 1, "cancelled": 1} or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert grew == {"deadline_exceeded": 1, "cancelled": 1}
