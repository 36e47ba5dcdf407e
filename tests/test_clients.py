"""Python clients, the `nanoserve` dispatcher, `nanoserve generate` and the Node client,
all against the in-process fake engine (tests/fake_engine.py), whose tokens follow plain
arithmetic: next = (previous + 1) % vocab_size, starting from the last prompt token."""

from __future__ import annotations

import asyncio
import gc
import re
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from clients import (
    AsyncClient,
    Client,
    DeadlineExceeded,
    InvalidArgument,
    NanoserveError,
    ResourceExhausted,
    Unavailable,
    Usage,
    build_request,
)
from clients import cli as nanoserve_cli
from engine_service.common.block_hash import hash_prompt_blocks
from nanoserve.v1 import nanoserve_pb2 as pb
from nanoserve.v1 import nanoserve_pb2_grpc as pb_grpc
from tests.fake_engine import FakeBehavior, FakeEngine, render_chat, start_fake_engine
from tests.procs import run_node_client_test

ROOT = Path(__file__).resolve().parent.parent
NANOSERVE = Path(sys.executable).parent / "nanoserve"


def expected_ids(last_prompt_token: int, n: int, vocab: int = 1000) -> list[int]:
    return [(last_prompt_token + i) % vocab for i in range(1, n + 1)]


def expected_text(ids: list[int]) -> str:
    return "".join(f" {t}" for t in ids)


@pytest.fixture
def fake() -> Iterator[FakeEngine]:
    engine, _ = start_fake_engine(engine_id="fake-0")
    yield engine
    engine.stop()


@pytest.fixture
def client(fake: FakeEngine) -> Iterator[Client]:
    with Client(f"127.0.0.1:{fake.port}", timeout=30) as c:
        yield c


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- requests -------------------------------------------------------------------------------


def test_build_request_sets_only_given_fields() -> None:
    req = build_request([3, 4], request_id="r1", max_tokens=7, temperature=0.0, stop="END",
                        stop_token_ids=[5], seed=None)
    assert req.request_id == "r1"
    assert list(req.token_ids.ids) == [3, 4]
    assert req.sampling.max_tokens == 7
    assert req.sampling.HasField("temperature") and req.sampling.temperature == 0.0
    assert list(req.sampling.stop) == ["END"]
    assert list(req.sampling.stop_token_ids) == [5]
    assert not req.sampling.HasField("seed")
    assert not req.sampling.HasField("top_p")


@pytest.mark.parametrize("prompt, error", [
    ([], ValueError), ([1, "a"], TypeError), ({"role": "user"}, TypeError),
    ([{"role": "user"}], TypeError), ([-1], ValueError), (b"bytes", TypeError),
])
def test_build_request_rejects_bad_prompts(prompt: object, error: type) -> None:
    with pytest.raises(error):
        build_request(prompt)  # type: ignore[arg-type]


@pytest.mark.parametrize("sampling, message", [
    (dict(max_tokens=-1), "max_tokens must be >= 1, got -1"),
    (dict(top_p=1.5), "top_p must be in (0, 1], got 1.5"),
    (dict(stop=["s"] * 17), "stop must be a list of at most 16 strings, got 17"),
])
def test_client_runs_the_engines_checks_before_sending(client: Client, fake: FakeEngine,
                                                       sampling: dict, message: str) -> None:
    with pytest.raises(ValueError) as info:
        client.generate("x", **sampling)
    assert str(info.value) == message  # the allowed range, numbers unquoted
    with pytest.raises(ValueError, match=re.escape(message)):
        client.stream("x", **sampling)  # raised before any iteration
    assert fake.requests == []


def test_unknown_keyword_is_a_type_error_naming_it(client: Client, fake: FakeEngine) -> None:
    with pytest.raises(TypeError, match="max_token"):
        client.generate("hi", max_token=3)
    with pytest.raises(TypeError, match="temprature"):
        client.stream("hi", temprature=0.5)  # raised before any iteration
    assert fake.requests == []


def test_prompt_kinds_reach_the_server(client: Client, fake: FakeEngine) -> None:
    result = client.generate("abc", max_tokens=3)
    assert fake.requests[-1].WhichOneof("prompt") == "text"
    assert fake.requests[-1].text == "abc"
    assert result.token_ids == expected_ids(ord("c"), 3)
    assert result.usage.prompt_tokens == 3

    result = client.generate([7, 42], max_tokens=2)
    assert fake.requests[-1].WhichOneof("prompt") == "token_ids"
    assert list(fake.requests[-1].token_ids.ids) == [7, 42]
    assert result.token_ids == [43, 44]

    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "héllo"}]
    result = client.generate(messages, max_tokens=2)
    sent = fake.requests[-1]
    assert sent.WhichOneof("prompt") == "messages"
    assert [(m.role, m.content) for m in sent.messages.messages] == [
        ("system", "be brief"), ("user", "héllo")]
    rendered = render_chat(sent.messages.messages).encode()
    assert result.usage.prompt_tokens == len(rendered)
    assert result.token_ids == expected_ids(rendered[-1], 2)


def test_sampling_fields_reach_the_server(client: Client, fake: FakeEngine) -> None:
    sampling = dict(max_tokens=4, min_tokens=1, temperature=0.5, top_p=0.75, top_k=5,
                    min_p=0.125, seed=2**40, repetition_penalty=1.25, presence_penalty=0.5,
                    frequency_penalty=-0.5, stop=["a", "b"], stop_token_ids=[998],
                    ignore_eos=True, logprobs=2, skip_special_tokens=False)
    client.generate("x", request_id="req-1", **sampling)
    sent = fake.requests[-1]
    assert sent.request_id == "req-1"
    for name, value in sampling.items():
        got = getattr(sent.sampling, name)
        assert (list(got) if isinstance(value, list) else got) == value, name


# -- answers --------------------------------------------------------------------------------


def test_generate_equals_concatenated_stream(client: Client) -> None:
    result = client.generate("hello", max_tokens=6, temperature=0)
    chunks = list(client.stream("hello", max_tokens=6, temperature=0))
    ids = expected_ids(ord("o"), 6)
    assert result.token_ids == ids
    assert result.text == expected_text(ids)
    assert result.finish_reason == "length"
    assert result.engine_id == "fake-0"
    assert (result.usage.prompt_tokens, result.usage.completion_tokens) == (5, 6)
    assert [t for c in chunks for t in c.token_ids] == result.token_ids
    assert "".join(c.text for c in chunks) == result.text
    assert all(c.finish_reason is None and c.usage is None for c in chunks[:-1])
    assert chunks[-1].finish_reason == "length"
    # the second call finds the prompt's first block in the fake's prefix cache
    assert chunks[-1].usage == Usage(5, 6, 4)


def test_stop_reasons_and_logprobs(client: Client) -> None:
    by_token = client.generate([10], max_tokens=10, stop_token_ids=[13])
    assert by_token.token_ids == [11, 12, 13]
    assert (by_token.finish_reason, by_token.stop_reason) == ("stop", "13")
    by_string = client.generate([10], max_tokens=10, stop=" 13")
    assert by_string.text == " 11 12"
    assert (by_string.finish_reason, by_string.stop_reason) == ("stop", " 13")
    eos = client.generate([996], max_tokens=10)  # the fake's eos is 999
    assert eos.token_ids == [997, 998, 999] and eos.finish_reason == "stop"
    with_lp = client.generate([20], max_tokens=2, logprobs=2)
    assert [lp.token_id for lp in with_lp.logprobs] == [21, 22]
    assert with_lp.logprobs[0].top_token_ids == [21, 22]


def test_cached_prompt_tokens_reported(client: Client) -> None:
    prompt = list(range(1, 11))  # 2 full blocks of 4 (the fake's kv_block_size) + 2 tokens
    first = client.generate(prompt, max_tokens=1)
    second = client.generate(prompt, max_tokens=1)
    assert first.usage.cached_prompt_tokens == 0
    assert second.usage.cached_prompt_tokens == 8


def test_engine_service_calls(client: Client, fake: FakeEngine) -> None:
    info = client.model_info()
    assert (info.vocab_size, info.kv_block_size, info.engine_id) == (1000, 4, "fake-0")
    assert client.health() == "SERVING"
    fake.set_serving(False)
    assert client.health() == "NOT_SERVING"
    fake.behavior.token_delay_s = 0.02
    stream = client.stream("x", max_tokens=500, request_id="busy")
    next(stream)
    load = client.load()
    assert load.num_running == 1
    assert 0 < load.tokens_in_flight < 500
    assert load.kv_blocks_used >= 1
    stream.close()


# -- errors and cancellation ----------------------------------------------------------------


def test_invalid_argument_carries_details(client: Client) -> None:
    with pytest.raises(InvalidArgument) as info:
        client.generate("x", max_tokens=5000)
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "max_tokens" in info.value.details and "5000" in info.value.details
    assert isinstance(info.value, NanoserveError)
    with pytest.raises(InvalidArgument):
        list(client.stream("x", max_tokens=5000))


def test_unavailable_when_nothing_listens() -> None:
    with Client(f"127.0.0.1:{free_port()}", timeout=20) as c, \
            pytest.raises(Unavailable) as info:
        c.generate("x", max_tokens=1)
    assert info.value.code == grpc.StatusCode.UNAVAILABLE


def test_deadline_exceeded_against_slow_engine(client: Client, fake: FakeEngine) -> None:
    fake.behavior.token_delay_s = 0.05  # 200 tokens take 10 s; the deadline is 0.3 s
    with pytest.raises(DeadlineExceeded):
        client.generate("x", max_tokens=200, request_id="slow", timeout=0.3)
    # the engine notices the expired call and stops working on it
    assert fake.wait_until(lambda: "slow" in fake.cancelled, timeout=10)


def test_resource_exhausted_and_mid_stream_failure(client: Client, fake: FakeEngine) -> None:
    fake.behavior.reject_code = grpc.StatusCode.RESOURCE_EXHAUSTED
    fake.behavior.reject_count = 1
    with pytest.raises(ResourceExhausted):
        client.generate("x", max_tokens=2)
    assert client.generate("x", max_tokens=2).token_ids == expected_ids(ord("x"), 2)

    fake.behavior.fail_after_tokens = 3
    received: list[int] = []
    with pytest.raises(Unavailable):
        for chunk in client.stream("x", max_tokens=10, request_id="crash"):
            received.extend(chunk.token_ids)
    assert received == expected_ids(ord("x"), 3)
    assert fake.failed == ["crash"]


@pytest.mark.parametrize("how", ["close", "garbage_collect"])
def test_early_stream_close_cancels_server_side(client: Client, fake: FakeEngine,
                                                how: str) -> None:
    fake.behavior.token_delay_s = 0.01
    stream = client.stream("x", max_tokens=900, request_id=f"early-{how}")
    first = next(stream)
    assert first.token_ids == expected_ids(ord("x"), 1)
    if how == "close":
        stream.close()
    else:
        del stream
        gc.collect()
    assert fake.wait_until(lambda: f"early-{how}" in fake.cancelled, timeout=10)
    assert f"early-{how}" not in fake.finished


# -- asyncio --------------------------------------------------------------------------------


def test_async_client(fake: FakeEngine) -> None:
    async def scenario() -> None:
        async with AsyncClient(f"127.0.0.1:{fake.port}", timeout=30) as c:
            result = await c.generate("hello", max_tokens=5)
            chunks = [chunk async for chunk in c.stream("hello", max_tokens=5)]
            assert result.token_ids == expected_ids(ord("o"), 5)
            assert [t for ch in chunks for t in ch.token_ids] == result.token_ids
            assert "".join(ch.text for ch in chunks) == result.text
            assert chunks[-1].usage == Usage(5, 5, 4)  # first block cached by then
            assert (await c.model_info()).engine_id == "fake-0"
            assert await c.health() == "SERVING"
            with pytest.raises(InvalidArgument, match="max_tokens"):
                await c.generate("x", max_tokens=5000)
            with pytest.raises(TypeError, match="bogus"):
                c.stream("x", bogus=1)

            fake.behavior.token_delay_s = 0.01
            stream = c.stream("x", max_tokens=900, request_id="async-early")
            await stream.__anext__()
            await stream.aclose()
            done = await asyncio.to_thread(
                fake.wait_until, lambda: "async-early" in fake.cancelled, 10)
            assert done
            with pytest.raises(DeadlineExceeded):
                await c.generate("x", max_tokens=500, timeout=0.2)

    asyncio.run(scenario())


def test_async_client_unavailable() -> None:
    async def scenario() -> None:
        async with AsyncClient(f"127.0.0.1:{free_port()}", timeout=20) as c:
            with pytest.raises(Unavailable):
                await c.generate("x")

    asyncio.run(scenario())


# -- command line ---------------------------------------------------------------------------


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    assert NANOSERVE.exists(), f"{NANOSERVE} missing: install the package (make venv)"
    return subprocess.run([str(NANOSERVE), *args], capture_output=True, text=True, timeout=120)


def test_cli_generate_stream_prints_text(fake: FakeEngine) -> None:
    proc = run_cli("generate", "--target", f"127.0.0.1:{fake.port}", "--stream",
                   "--max-tokens", "5", "--temperature", "0", "abc")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == expected_text(expected_ids(ord("c"), 5)) + "\n"
    assert "finish=length" in proc.stderr and "completion=5" in proc.stderr
    assert fake.requests[-1].sampling.temperature == 0.0


def test_cli_generate_chat_unary_and_stop(fake: FakeEngine) -> None:
    proc = run_cli("generate", "--target", f"127.0.0.1:{fake.port}", "--chat",
                   "--max-tokens", "2", "10")
    assert proc.returncode == 0, proc.stderr
    sent = fake.requests[-1]
    assert sent.WhichOneof("prompt") == "messages"
    assert sent.messages.messages[0].content == "10"
    proc = run_cli("generate", "--target", f"127.0.0.1:{fake.port}", "--token-ids",
                   "--max-tokens", "9", "--stop", " 13", "10")
    assert proc.stdout == " 11 12\n"
    assert "finish=stop" in proc.stderr


def test_cli_generate_reports_errors(fake: FakeEngine) -> None:
    proc = run_cli("generate", "--target", f"127.0.0.1:{fake.port}", "--stream",
                   "--max-tokens", "5000", "abc")
    assert proc.returncode != 0
    assert proc.stderr.startswith("error: INVALID_ARGUMENT: ")
    assert "max_tokens" in proc.stderr
    proc = run_cli("generate", "--target", f"127.0.0.1:{free_port()}", "--timeout", "20", "x")
    assert proc.returncode != 0
    assert proc.stderr.startswith("error: UNAVAILABLE: ")


def test_cli_help_lists_every_subcommand(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        nanoserve_cli.main(["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    for name, (_, help_text) in nanoserve_cli.SUBCOMMANDS.items():
        assert name in out and help_text in out


def test_cli_version_engine_help_and_bare_bench(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        nanoserve_cli.main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out == f"nanoserve {nanoserve_cli.package_version()}\n"
    assert nanoserve_cli.package_version()[0].isdigit()
    with pytest.raises(SystemExit):
        nanoserve_cli.main(["engine", "--help"])
    out = capsys.readouterr().out
    # every flag has a help text, and each help text ends with its default
    flags = re.findall(r"^  (--[\w-]+)", out, re.M)
    assert len(flags) >= 20 and "--max-num-seqs" in flags
    for flag in flags:
        entry = " ".join(out.split(f"  {flag}", 1)[1].split("\n  --", 1)[0].split())
        assert "(default: " in entry, f"{flag} shows no default: {entry!r}"
    with pytest.raises(SystemExit) as info:
        nanoserve_cli.main(["bench"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "{offline,serve,routing,soak,diffusion}" in err and "bench_kind" not in err


def test_cli_missing_owner_module_breaks_only_its_subcommand(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(nanoserve_cli.SUBCOMMANDS, "ghost", ("no_such_module_xyz", "gone"))
    assert nanoserve_cli.main(["ghost"]) == 2
    assert "no_such_module_xyz" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:
        nanoserve_cli.main(["generate", "--help"])
    assert info.value.code == 0


def test_clients_and_generate_cli_import_no_torch_nor_other_owners() -> None:
    code = (
        "import sys\n"
        "import clients, clients.generate_cli\n"
        "from clients.cli import main\n"
        "try:\n    main(['generate', '--help'])\nexcept SystemExit:\n    pass\n"
        "owners = ('torch', 'engine_service', 'router', 'models', 'benchmarks')\n"
        # of engine_service, only the torch-free common subpackage (TLS credentials)
        "print(sorted(m for m in sys.modules if m.split('.')[0] in owners\n"
        "             and m != 'engine_service' and not m.startswith('engine_service.common')))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=ROOT, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "[]"


# -- Node.js client -------------------------------------------------------------------------


def test_node_client_matches_python_client(fake: FakeEngine, client: Client,
                                           tmp_path: Path) -> None:
    spec = {"prompt": "Hello", "sampling": {"max_tokens": 8, "temperature": 0}}
    result = client.generate(spec["prompt"], **spec["sampling"])
    # the Node suite runs with its apiKey against a fake that requires it (as --api-key does)
    fake.behavior.api_key = "node-key"
    out = run_node_client_test(f"127.0.0.1:{fake.port}", spec, result, tmp_path,
                               env={"NANOSERVE_API_KEY": "node-key"})
    assert re.search(r"^ok \d+ - apiKey .* the server refuses$", out, re.M), out  # not skipped
    # the Node test's early-closed stream was cancelled in the engine
    assert fake.wait_until(
        lambda: any(r.startswith("node-early-close-") for r in fake.cancelled), timeout=10)


# -- the fake engine's Engine service (router tests rely on it) ------------------------------


def test_fake_kv_events_snapshot_then_events_and_resume(client: Client, fake: FakeEngine) -> None:
    stub = pb_grpc.EngineStub(grpc.insecure_channel(f"127.0.0.1:{fake.port}"))
    prompt_a, prompt_b = list(range(1, 9)), list(range(50, 55))
    hashes_a, hashes_b = hash_prompt_blocks(prompt_a, 4), hash_prompt_blocks(prompt_b, 4)
    client.generate(prompt_a, max_tokens=1)
    call = stub.SubscribeKvEvents(pb.SubscribeKvEventsRequest(), timeout=30)
    snapshot = next(call)
    assert snapshot.snapshot and list(snapshot.block_hashes_stored) == hashes_a
    assert snapshot.sequence_number == 1 and snapshot.kv_block_size == 4
    client.generate(prompt_b, max_tokens=1)
    batch = next(call)
    assert not batch.snapshot and list(batch.block_hashes_stored) == hashes_b[:1]
    assert batch.sequence_number == 2
    fake.remove_blocks([hashes_a[0]])
    batch = next(call)
    assert list(batch.block_hashes_removed) == [hashes_a[0]] and batch.sequence_number == 3
    call.cancel()

    resumed = stub.SubscribeKvEvents(pb.SubscribeKvEventsRequest(after_sequence_number=1),
                                     timeout=30)
    assert [next(resumed).sequence_number, next(resumed).sequence_number] == [2, 3]
    fake.break_kv_streams()
    with pytest.raises(grpc.RpcError) as info:
        next(resumed)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE

    unknown = stub.SubscribeKvEvents(pb.SubscribeKvEventsRequest(after_sequence_number=99),
                                     timeout=30)
    fresh = next(unknown)
    assert fresh.snapshot and set(fresh.block_hashes_stored) == {hashes_a[1], hashes_b[0]}
    unknown.cancel()


def test_fake_evicts_least_recently_used_blocks() -> None:
    fake, port = start_fake_engine(behavior=FakeBehavior(num_kv_blocks=2))
    try:
        fake.store_blocks([1, 2])
        fake.store_blocks([1])  # touch 1: block 2 is now the least recently used
        fake.store_blocks([3])
        assert fake.cached_hashes() == [1, 3]
        stub = pb_grpc.EngineStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
        call = stub.SubscribeKvEvents(pb.SubscribeKvEventsRequest(after_sequence_number=1),
                                      timeout=30)
        batch = next(call)
        assert list(batch.block_hashes_stored) == [3] and list(batch.block_hashes_removed) == [2]
        call.cancel()
    finally:
        fake.stop()


def test_fake_streams_tokenizer_files(tmp_path: Path) -> None:
    files = {"tokenizer.json": b'{"version": "1.0"}', "empty.txt": b""}
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    fake, port = start_fake_engine(
        behavior=FakeBehavior(tokenizer_dir=str(tmp_path), tokenizer_piece_bytes=5))
    try:
        stub = pb_grpc.EngineStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
        got: dict[str, bytes] = {}
        closed: list[str] = []
        for piece in stub.GetTokenizer(pb.GetTokenizerRequest(), timeout=30):
            assert piece.name not in closed
            got[piece.name] = got.get(piece.name, b"") + piece.content
            if piece.last:
                closed.append(piece.name)
        assert got == files and sorted(closed) == sorted(files)
    finally:
        fake.stop()
