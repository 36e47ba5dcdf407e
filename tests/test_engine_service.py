"""The gRPC engine service as a real process on a loopback port."""

from __future__ import annotations

import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from clients import Client
from clients.errors import InvalidArgument, NanoserveError, ResourceExhausted
from engine_service import LLM, SamplingParams
from engine_service.common.block_hash import hash_prompt_blocks
from nanoserve.v1 import nanoserve_pb2 as pb
from nanoserve.v1 import nanoserve_pb2_grpc as pb_grpc
from tests.helpers import random_prompts
from tests.procs import run_node_client_test, start_engine, wait_blocks_free

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    proc = start_engine(tiny_model_dir, "--kv-block-size", "4", "--max-model-len", "512")
    yield proc
    assert proc.stop() == 0, proc.output()[-3000:]


@pytest.fixture(scope="module")
def client(engine):
    with Client(engine.target) as c:
        yield c


@pytest.fixture(scope="module")
def offline(tiny_model_dir):
    return LLM(str(tiny_model_dir), device="cpu", dtype="float32", num_kv_blocks=512,
               kv_block_size=4, max_model_len=512)


def test_health_serving_and_model_info(engine, client):
    assert client.health() == "SERVING"
    info = client.model_info()
    assert info.kv_block_size == 4 and info.max_model_len == 512 and info.vocab_size > 0
    assert info.hash_scheme and info.engine_id == engine.target


def test_stream_equals_offline_and_generate_equals_stream(client, offline):
    ps = random_prompts(6, seed=1)
    expected = offline.generate(ps, SamplingParams(temperature=0, max_tokens=10,
                                                   ignore_eos=True), use_tqdm=False)
    for p, exp in zip(ps, expected, strict=True):
        chunks = list(client.stream(p, temperature=0, max_tokens=10, ignore_eos=True))
        streamed = [t for c in chunks for t in c.token_ids]
        assert streamed == exp.token_ids
        assert chunks[-1].finish_reason == "length" and chunks[-1].usage.completion_tokens == 10
        whole = client.generate(p, temperature=0, max_tokens=10, ignore_eos=True)
        assert whole.token_ids == streamed
        assert whole.text == "".join(c.text for c in chunks) == exp.text
    assert wait_blocks_free(client).kv_blocks_used == 0


def test_64_concurrent_streams(client, offline):
    ps = random_prompts(64, seed=2)
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    expected = [o.token_ids for o in offline.generate(ps, sp, use_tqdm=False)]

    def run(p):
        return [t for c in client.stream(p, temperature=0, max_tokens=8, ignore_eos=True)
                for t in c.token_ids]

    with ThreadPoolExecutor(64) as pool:
        got = list(pool.map(run, ps))
    assert got == expected
    load = wait_blocks_free(client)
    assert load.kv_blocks_used == 0 and load.num_running == 0


def test_text_and_chat_prompts(client, offline):
    out = client.generate("Hello there", temperature=0, max_tokens=6, ignore_eos=True)
    exp = offline.generate("Hello there", SamplingParams(temperature=0, max_tokens=6,
                                                         ignore_eos=True), use_tqdm=False)[0]
    assert out.token_ids == exp.token_ids and out.text == exp.text
    chat = client.generate([{"role": "user", "content": "hi"}], temperature=0, max_tokens=4)
    assert chat.usage.prompt_tokens > 3  # the chat template added its markup


@pytest.mark.parametrize(("prompt", "kwargs", "field"), [
    ([], {}, "prompt"),
    ("", {}, "prompt"),
    ([1] * 600, {}, "prompt"),
    ([10**6], {}, "prompt_token_ids"),
    ([1, 2], {"temperature": -1.0}, "temperature"),
    ([1, 2], {"top_p": 0.0}, "top_p"),
    ([1, 2], {"top_p": 1.5}, "top_p"),
    ([1, 2], {"max_tokens": 0}, "max_tokens"),
    ([1, 2], {"stop": ["s"] * 17}, "stop"),
])
def test_bad_input_invalid_argument(engine, client, prompt, kwargs, field):
    if prompt == [] or kwargs:  # the Python client refuses these itself: go under it too
        stub = pb_grpc.GenerationStub(grpc.insecure_channel(engine.target))
        with pytest.raises(grpc.RpcError) as err:
            stub.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt),
                                             sampling=pb.SamplingParams(**kwargs)))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.value.details().startswith(field)
        with pytest.raises(ValueError) as local:  # the engines' check, run by the client
            client.generate(prompt, **kwargs)
        assert prompt == [] or str(local.value) == err.value.details()
    else:
        with pytest.raises(InvalidArgument, match=field):
            client.generate(prompt, **kwargs)
    ok = client.generate([1, 2, 3], temperature=0, max_tokens=3)
    assert len(ok.token_ids) >= 1


def test_both_text_and_token_ids_is_rejected(engine):
    # proto3 oneof keeps only the last one set; a request with neither is rejected.
    stub = pb_grpc.GenerationStub(grpc.insecure_channel(engine.target))
    with pytest.raises(grpc.RpcError) as err:
        stub.Generate(pb.GenerateRequest())
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "prompt" in err.value.details()


def test_diffusion_parameters_on_an_autoregressive_engine_are_refused(engine, client):
    stub = pb_grpc.GenerationStub(grpc.insecure_channel(engine.target))
    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 2, 3]),
                                 diffusion=pb.DiffusionParams(gen_length=16, block_length=8,
                                                              steps=8))
    with pytest.raises(grpc.RpcError) as err:
        stub.Generate(request)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "diffusion" in err.value.details()
    # A bad diffusion value is named before the engine kind is even considered.
    request.diffusion.block_length = 5
    with pytest.raises(grpc.RpcError) as err:
        stub.Generate(request)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "block_length" in err.value.details()
    assert client.generate([1, 2, 3], max_tokens=2).token_ids  # the engine serves on


def test_cancel_mid_stream_and_deadline_free_blocks(client):
    it = client.stream([5] * 30, temperature=0, max_tokens=400, ignore_eos=True)
    first = next(it)
    assert first.token_ids
    it.close()  # cancels the RPC
    assert wait_blocks_free(client).kv_blocks_used == 0
    with pytest.raises(NanoserveError) as err:
        client.generate([6] * 30, temperature=0, max_tokens=400, ignore_eos=True, timeout=0.3)
    assert err.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert wait_blocks_free(client).kv_blocks_used == 0
    assert client.generate([1, 2], temperature=0, max_tokens=2).finish_reason == "length"


def test_kv_events_snapshot_plus_deltas_match_cached_blocks(engine, client):
    stub = pb_grpc.EngineStub(grpc.insecure_channel(engine.target))
    stream = stub.SubscribeKvEvents(pb.SubscribeKvEventsRequest())
    held: set[int] = set()
    last_seq = 0
    out_of_order: list[tuple[int, int]] = []  # checked on the test's thread, not in consume
    lock = threading.Lock()

    def consume():
        nonlocal last_seq
        try:
            for batch in stream:
                with lock:
                    if batch.snapshot:
                        held.clear()
                    held.update(batch.block_hashes_stored)
                    held.difference_update(batch.block_hashes_removed)
                    if not (batch.sequence_number > last_seq or batch.snapshot):
                        out_of_order.append((last_seq, batch.sequence_number))
                    last_seq = batch.sequence_number
        except grpc.RpcError:
            pass

    t = threading.Thread(target=consume, daemon=True)
    t.start()
    ps = random_prompts(5, seed=9, lo=20, hi=40)
    outs = [client.generate(p, temperature=0, max_tokens=6, ignore_eos=True) for p in ps]
    time.sleep(0.5)
    expected = set()
    for p, o in zip(ps, outs, strict=True):
        computed = (p + o.token_ids)[:-1]  # the last sampled token has no KV yet
        expected.update(hash_prompt_blocks(computed, 4))
    with lock:
        assert expected <= held
        assert not out_of_order, f"batch numbers went backwards: {out_of_order}"
        snapshot_seq = last_seq
        current = set(held)
    # A fresh snapshot equals what the subscriber rebuilt from snapshot + deltas.
    fresh = next(iter(stub.SubscribeKvEvents(pb.SubscribeKvEventsRequest())))
    assert fresh.snapshot and set(fresh.block_hashes_stored) == current
    # Resuming from a sequence number replays exactly the later batches.
    client.generate(random_prompts(1, seed=10, lo=30, hi=30)[0], temperature=0, max_tokens=4)
    resumed = stub.SubscribeKvEvents(pb.SubscribeKvEventsRequest(
        after_sequence_number=snapshot_seq))
    first = next(iter(resumed))
    assert not first.snapshot and first.sequence_number == snapshot_seq + 1
    stream.cancel()


def test_request_id_reused_after_cancel_and_deadline_gets_only_its_own_tokens(engine, client,
                                                                            offline):
    """A request_id reused right after a cancel or an expired deadline is a new request:
    none of the old one's tokens or its abort reach it, and nothing is left running."""
    stub = pb_grpc.GenerationStub(grpc.insecure_channel(engine.target))
    old_prompt, new_prompt = random_prompts(2, seed=21, lo=12, hi=12)
    expected = offline.generate([new_prompt], SamplingParams(temperature=0, max_tokens=6,
                                                             ignore_eos=True),
                                use_tqdm=False)[0].token_ids
    old = pb.GenerateRequest(request_id="reused", token_ids=pb.TokenIds(ids=old_prompt),
                             sampling=pb.SamplingParams(temperature=0, max_tokens=400,
                                                        ignore_eos=True))
    new = pb.GenerateRequest(request_id="reused", token_ids=pb.TokenIds(ids=new_prompt),
                             sampling=pb.SamplingParams(temperature=0, max_tokens=6,
                                                        ignore_eos=True))
    for i in range(30):
        if i % 2:  # cancelled after its first chunk
            call = stub.Stream(old)
            next(call)
            call.cancel()
        else:  # its deadline expires mid-stream
            with pytest.raises(grpc.RpcError) as err:
                for _ in stub.Stream(old, timeout=0.05):
                    pass
            assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        resp = stub.Generate(new, timeout=30)
        assert resp.request_id == "reused"
        assert list(resp.token_ids) == expected, f"round {i}"
        assert resp.finish_reason == pb.FINISH_REASON_LENGTH
    load = wait_blocks_free(client)
    assert load.kv_blocks_used == 0 and load.num_running == 0 and load.num_waiting == 0


def test_queue_full_resource_exhausted(tiny_model_dir):
    eng = start_engine(tiny_model_dir, "--max-num-seqs", "1", "--max-waiting-requests", "1")
    try:
        stub = pb_grpc.GenerationStub(grpc.insecure_channel(eng.target))
        sampling = pb.SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
        # Raw calls start at once and can be cancelled from here (one running, one waiting).
        calls = [stub.Stream(pb.GenerateRequest(token_ids=pb.TokenIds(ids=[3 + i] * 20),
                                                sampling=sampling)) for i in range(2)]
        with Client(eng.target) as c:
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                load = c.load()
                if load.num_running == 1 and load.num_waiting == 1:
                    break
                time.sleep(0.02)
            with pytest.raises(ResourceExhausted, match="queue is full"):
                c.generate([4] * 5, max_tokens=2)
            for call in calls:
                call.cancel()
            assert wait_blocks_free(c).kv_blocks_used == 0
            assert c.generate([1, 2], temperature=0, max_tokens=2).finish_reason == "length"
    finally:
        assert eng.stop() == 0


def test_sigterm_drains_in_flight_streams(tiny_model_dir):
    eng = start_engine(tiny_model_dir)
    channel = grpc.insecure_channel(eng.target)
    health = health_pb2_grpc.HealthStub(channel)
    assert health.Check(health_pb2.HealthCheckRequest()).status == \
        health_pb2.HealthCheckResponse.SERVING
    with Client(eng.target) as c:
        it = c.stream([7] * 10, temperature=0, max_tokens=60, ignore_eos=True)
        got = list(next(it).token_ids)
        eng.proc.send_signal(signal.SIGTERM)
        for chunk in it:
            got.extend(chunk.token_ids)
        assert len(got) == 60, "the in-flight stream was cut by the drain"
    assert eng.proc.wait(30) == 0


def test_node_client_streams_same_tokens_as_python(engine, client, tmp_path):
    spec = {"prompt": "Hello there", "sampling": {"max_tokens": 12, "temperature": 0,
                                                  "ignore_eos": True}}
    expected = client.generate(spec["prompt"], **spec["sampling"])
    assert len(expected.token_ids) == 12
    run_node_client_test(engine.target, spec, expected, tmp_path)
    assert wait_blocks_free(client).kv_blocks_used == 0


def test_dummy_weights_engine_without_tokenizer_serves_token_ids(tiny_model_dir, tmp_path):
    """--load-format dummy starts from config.json alone (how benchmarks run any shape)."""
    (tmp_path / "config.json").write_text((tiny_model_dir / "config.json").read_text())
    eng = start_engine(tmp_path, "--load-format", "dummy")
    try:
        with Client(eng.target) as c:
            out = c.generate([1, 2, 3], temperature=0, max_tokens=5, ignore_eos=True)
            assert len(out.token_ids) == 5 and out.text == ""
            with pytest.raises(InvalidArgument, match="token_ids"):
                c.generate("text needs a tokenizer", max_tokens=2)
    finally:
        assert eng.stop() == 0
