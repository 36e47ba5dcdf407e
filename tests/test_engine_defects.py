"""Regression tests for engine-service defects: CPU thread sizing, huge prompts (event loop,
size limit, memory), long values in error messages, undecodable requests, float32
conversion of sampling values, and how expired deadlines are counted."""

from __future__ import annotations

import itertools
import os
import re
import socket
import threading
import time
import urllib.request

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from benchmarks.procs import ServerProc, rss_bytes
from engine_service.common.proto_convert import sampling_params_from_proto
from nanoserve.v1 import nanoserve_pb2 as pb
from nanoserve.v1 import nanoserve_pb2_grpc as pb_grpc
from tests.procs import start_engine

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
    check_prompt_bytes(pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1] * 511)), 512)
    with pytest.raises(ValueError, match=r"^prompt must be at most max_model_len - 1 = 511 "
                                         r"tokens \(room for one output token\), got 5000$"):
        check_prompt_bytes(pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1] * 5000)), 512)
    with pytest.raises(ValueError, match=rf"^text must be at most {limit} bytes .* got "
                                         rf"{limit + 1}$"):
        check_prompt_bytes(pb.GenerateRequest(text="a" * (limit + 1)), 512)
    many = pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="a" * 200)] * 100)
    with pytest.raises(ValueError, match=rf"^messages must be at most {limit} bytes"):
        check_prompt_bytes(pb.GenerateRequest(messages=many), 512)


def test_prompts_past_grpcs_default_size_are_invalid_argument_naming_the_limit(stub):
    # 5 MB each, past grpc's 4 MiB default: the engine reads them and names its own limit
    for request, message in (
            (_request("a" * (5 << 20), max_tokens=1),
             f"text must be at most 16384 bytes (32 per token of max_model_len 512), "
             f"got {5 << 20}"),
            (_request([1000] * 2_500_000, max_tokens=1),  # 2 bytes an id on the wire
             "prompt must be at most max_model_len - 1 = 511 tokens (room for one output "
             "token), got 2500000")):
        for call in (stub.Generate, lambda r, **kw: list(stub.Stream(r, **kw))):
            with pytest.raises(grpc.RpcError) as err:
                call(request, timeout=30)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
            assert err.value.details() == message
    _engine_still_serves(stub)


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


def test_undecodable_request_is_invalid_argument_naming_the_field(engine, stub):
    chat = pb.GenerateRequest(messages=pb.ChatMessages(messages=[pb.ChatMessage(
        role="user", content="hi")]), sampling=pb.SamplingParams(stop=["ab"]))
    cases = [  # (request bytes, the message)
        (b"\x12\x02\xff\xfe", "text"),  # field 2 (text), length 2, not UTF-8
        (chat.SerializeToString().replace(b"hi", b"h\xff"), "messages.messages.content"),
        (chat.SerializeToString().replace(b"ab", b"a\xff"), "sampling.stop"),
        (b"\x12\x05ab", None),  # 5 bytes promised, 2 sent: no field to blame
    ]
    with grpc.insecure_channel(engine.target) as channel:
        for (raw, field), (method, call) in itertools.product(
                cases, (("Generate", channel.unary_unary), ("Stream", channel.unary_stream))):
            rpc = call(f"/nanoserve.v1.Generation/{method}")  # bytes in, bytes out
            with pytest.raises(grpc.RpcError) as err:
                result = rpc(raw, timeout=10)
                if method == "Stream":
                    list(result)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
            if field is None:
                assert err.value.details().startswith("request could not be decoded: ")
            else:
                assert err.value.details() == (f"{field} must be valid UTF-8; the request "
                                               f"could not be decoded")
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


# ------------------------------------------------------------------ metrics


def _scrape(port: int) -> dict[tuple[str, tuple], float]:
    """(sample name, sorted labels) -> value."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def _outcomes(port: int) -> dict[str, float]:
    """nanoserve_engine_request_errors_total by code, plus vLLM's aborts."""
    samples = _scrape(port)
    seen = {dict(labels)["code"]: v for (name, labels), v in samples.items()
            if name == "nanoserve_engine_request_errors_total"}
    aborts = [v for (name, labels), v in samples.items()
              if name == "vllm:request_success_total" and ("finished_reason", "abort") in labels]
    return {**seen, "abort": aborts[0]}


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
        if grew == {"DEADLINE_EXCEEDED": 1, "CANCELLED": 1, "abort": 2} \
                or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert grew == {"DEADLINE_EXCEEDED": 1, "CANCELLED": 1, "abort": 2}


# vLLM's bucket boundaries (vllm/v1/metrics/loggers.py), so dashboards aggregate across both
VLLM_TTFT_LE = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]


def test_vllm_metrics_count_what_the_requests_did(engine, stub, metrics_port, tiny_model_dir):
    model = (("model_name", tiny_model_dir.name),)

    def value(name: str, *labels: tuple[str, str]) -> float:
        return _scrape(metrics_port).get((name, tuple(sorted(model + labels))), 0.0)

    names = ("vllm:prompt_tokens_total", "vllm:generation_tokens_total",
             "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
             "vllm:time_to_first_token_seconds_count", "vllm:e2e_request_latency_seconds_count",
             "vllm:request_queue_time_seconds_count", "vllm:inter_token_latency_seconds_count")
    before = {n: value(n) for n in names}
    length, stop = (value("vllm:request_success_total", ("finished_reason", r))
                    for r in ("length", "stop"))
    prompt = [int(x) for x in os.urandom(13)]  # 3 full blocks of 4: cached for the second
    first = stub.Generate(_request(prompt, temperature=0, max_tokens=5, ignore_eos=True))
    others = [stub.Generate(_request(prompt, temperature=0, max_tokens=5,
                                     stop_token_ids=[first.token_ids[1]])),
              stub.Generate(_request([5] * 7, temperature=0, max_tokens=3, ignore_eos=True))]
    answers = [first, *others]
    assert [a.finish_reason for a in answers] == [pb.FINISH_REASON_LENGTH,
                                                  pb.FINISH_REASON_STOP, pb.FINISH_REASON_LENGTH]
    grew = {n: value(n) - before[n] for n in names}
    generated = sum(a.usage.completion_tokens for a in answers)
    assert grew == {
        "vllm:prompt_tokens_total": 13 + 13 + 7,
        "vllm:generation_tokens_total": generated,
        "vllm:prefix_cache_queries_total": 13 + 13 + 7,
        "vllm:prefix_cache_hits_total": sum(a.usage.cached_prompt_tokens for a in answers),
        "vllm:time_to_first_token_seconds_count": 3,
        "vllm:e2e_request_latency_seconds_count": 3,
        "vllm:request_queue_time_seconds_count": 3,
        "vllm:inter_token_latency_seconds_count": generated - 3,  # one token per output
    }
    assert others[0].usage.cached_prompt_tokens == 12
    assert value("vllm:request_success_total", ("finished_reason", "length")) == length + 2
    assert value("vllm:request_success_total", ("finished_reason", "stop")) == stop + 1
    assert [le for (name, labels) in _scrape(metrics_port)
            if name == "vllm:time_to_first_token_seconds_bucket" and model[0] in labels
            for k, le in labels if k == "le"] == [str(b) for b in VLLM_TTFT_LE] + ["+Inf"]
    # idle again: the gauges say so (they follow the core's load reports)
    deadline = time.monotonic() + 10
    while (value("vllm:num_requests_running"), value("vllm:num_requests_waiting"),
           value("vllm:kv_cache_usage_perc")) != (0, 0, 0) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert value("vllm:num_requests_running") == value("vllm:kv_cache_usage_perc") == 0
    assert value("nanoserve_engine_core_stalled") == 0
