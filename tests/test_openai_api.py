"""The OpenAI HTTP front (--http-port) of a real engine and a real router, through the
official `openai` client (sync, async, streaming) and raw HTTP (httpx): answers equal to the
gRPC path's, the error objects and their statuses, cancellation, the API key, drain.

The module's engine and router run with --api-key, so every call here carries the key unless
a test is about its absence; the router sends its key on to the engine."""

from __future__ import annotations

import asyncio
import http.client
import json
import re
import signal
import socket
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc
import httpx
import openai
import pytest

from benchmarks.procs import ServerProc
from clients import Client
from clients.errors import NanoserveError
from engine_service.common.openai_protocol import (
    ChatRequest,
    CompletionRequest,
    ModelCard,
    generate_requests,
)
from engine_service.common.proto_convert import sampling_params_from_proto
from engine_service.common.sampling_params import SamplingParams
from tests.procs import start_engine, start_router, wait_blocks_free

pytestmark = pytest.mark.timeout(120)

KEY = "test-key"
MODEL = "tiny-served"
ENGINE_ARGS = ("--kv-block-size", "4", "--max-model-len", "512", "--http-port", "0",
               "--served-model-name", MODEL)
ROUTER_ARGS = ("--health-interval", "0.2", "--load-interval", "0.1")
GREEDY = {"temperature": 0.0, "ignore_eos": True}
PROMPT = "Hello there, tell me"
CHAT = [{"role": "user", "content": "hi, who are you?"}]


@dataclass
class Server:
    proc: ServerProc
    url: str  # the HTTP front, e.g. http://127.0.0.1:PORT

    @property
    def target(self) -> str:
        return self.proc.target


def with_http(proc: ServerProc) -> Server:
    scheme, port = proc.http_address()
    return Server(proc, f"{scheme}://127.0.0.1:{port}")


def wait_healthy(url: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while httpx.get(f"{url}/health", timeout=5).status_code != 200:
        assert time.monotonic() < deadline, f"{url}/health never answered 200"
        time.sleep(0.1)


@pytest.fixture(scope="module")
def servers(tiny_model_dir) -> Iterator[dict[str, Server]]:
    """The key-protected engine and router over it, plus a second engine (no key, long drain)
    that the drain test stops: the engines load in parallel."""
    started: list[ServerProc] = []
    try:
        with ThreadPoolExecutor(2) as pool:
            futures = [pool.submit(start_engine, tiny_model_dir, *ENGINE_ARGS, *extra)
                       for extra in (("--api-key", KEY), ("--drain-timeout", "60"))]
            for f in futures:
                if f.exception() is None:
                    started.append(f.result())
            for f in futures:
                f.result()
        engine, drain = (with_http(p) for p in started)
        router = with_http(start_router([engine.target], *ROUTER_ARGS, "--api-key", KEY))
        started.append(router.proc)
        wait_healthy(router.url)
        yield {"engine": engine, "router": router, "drain": drain}
    finally:
        for proc in reversed(started):
            assert proc.stop() == 0, proc.output()[-3000:]


@pytest.fixture(scope="module")
def grpc_client(servers) -> Iterator[Client]:
    with Client(servers["engine"].target, timeout=60, api_key=KEY) as c:
        yield c


def sdk(server: Server, key: str = KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0, timeout=60)


@pytest.mark.parametrize("target", ["engine", "router"])
def test_greedy_completion_and_chat_equal_the_grpc_path(servers, grpc_client, target):
    client = sdk(servers[target])
    expected = grpc_client.generate(PROMPT, max_tokens=12, **GREEDY)
    got = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert got.choices[0].text == expected.text and got.choices[0].finish_reason == "length"
    assert (got.usage.prompt_tokens, got.usage.completion_tokens) == (
        expected.usage.prompt_tokens, 12)
    expected = grpc_client.generate(CHAT, max_tokens=10, **GREEDY)
    chat = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=10,
                                          temperature=0, extra_body={"ignore_eos": True})
    assert chat.choices[0].message.content == expected.text
    assert chat.choices[0].message.role == "assistant" and chat.model == MODEL
    streamed = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=10,
                                              temperature=0, stream=True,
                                              stream_options={"include_usage": True},
                                              extra_body={"ignore_eos": True})
    chunks = list(streamed)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == \
        expected.text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    assert chunks[-1].usage.prompt_tokens == expected.usage.prompt_tokens


def test_prompt_forms_and_async_client(servers, grpc_client):
    ids = [[5, 6, 7, 8], [9, 10, 11]]
    expected = [grpc_client.generate(p, max_tokens=6, **GREEDY).text for p in ids]
    client = sdk(servers["router"])
    got = client.completions.create(model=MODEL, prompt=ids, max_tokens=6, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert [c.text for c in sorted(got.choices, key=lambda c: c.index)] == expected
    assert got.usage.prompt_tokens == 7 and got.usage.completion_tokens == 12

    async def concurrent() -> list[str]:
        async with openai.AsyncOpenAI(base_url=f"{servers['router'].url}/v1", api_key=KEY,
                                      max_retries=0) as aclient:
            replies = await asyncio.gather(*(aclient.completions.create(
                model=MODEL, prompt=p, max_tokens=6, temperature=0,
                extra_body={"ignore_eos": True}) for p in ids))
            return [r.choices[0].text for r in replies]

    assert asyncio.run(concurrent()) == expected


def test_n_choices_stop_strings_and_logprobs(servers, grpc_client):
    client = sdk(servers["engine"])
    seeded = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, n=2, seed=5,
                                       temperature=1.0, extra_body={"ignore_eos": True})
    want = [grpc_client.generate(PROMPT, max_tokens=8, seed=s, temperature=1.0,
                                 ignore_eos=True).text for s in (5, 6)]
    assert [c.text for c in sorted(seeded.choices, key=lambda c: c.index)] == want
    prompt_tokens = grpc_client.generate(PROMPT, max_tokens=1).usage.prompt_tokens
    assert seeded.usage.prompt_tokens == prompt_tokens  # once per prompt, not per choice
    assert seeded.usage.completion_tokens == 16

    full = grpc_client.generate(PROMPT, max_tokens=16, **GREEDY).text
    stop = full[len(full) // 2:len(full) // 2 + 2]
    expected = grpc_client.generate(PROMPT, max_tokens=16, stop=[stop], **GREEDY)
    got = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, stop=stop,
                                    temperature=0, extra_body={"ignore_eos": True})
    assert got.choices[0].text == expected.text and got.choices[0].finish_reason == "stop"
    assert stop not in got.choices[0].text

    expected = grpc_client.generate(PROMPT, max_tokens=5, logprobs=2, **GREEDY)
    got = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, logprobs=2,
                                    temperature=0, extra_body={"ignore_eos": True})
    lp = got.choices[0].logprobs
    assert lp.token_logprobs == pytest.approx([e.logprob for e in expected.logprobs])
    assert [len(top) for top in lp.top_logprobs] == [2] * 5
    chat = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4,
                                          temperature=0, logprobs=True, top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert all(len(c.top_logprobs) == 3 and c.top_logprobs[0].logprob == pytest.approx(c.logprob)
               for c in content)


# request body -> the start of the 400's message (the gRPC path's words) and the field named
BAD_BODIES = [
    ({"prompt": []}, "prompt must be non-empty", "prompt"),
    ({}, "prompt: Field required", "prompt"),
    ({"prompt": [1, 2, 10**6]}, "prompt_token_ids must be ids in [0, ", "prompt_token_ids"),
    ({"prompt": [-1, 2]}, "prompt_token_ids must be ids in [0, ", "prompt_token_ids"),
    ({"prompt": [1] * 600}, "prompt must be at most max_model_len - 1", "prompt"),
    ({"prompt": "w " * 10_000}, "text must be at most 16384 bytes", "text"),
    ({"prompt": "x", "stop": ["s" * 100_000]}, "stop must be strings of 1..256 characters",
     "stop"),
    ({"prompt": "x", "temperature": float("nan")}, "temperature must be >= 0", "temperature"),
    ({"prompt": "x", "top_p": 1.5}, "top_p must be in (0, 1]", "top_p"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens must be >= 1", "max_tokens"),
    ({"prompt": "x", "max_tokens": -1}, "max_tokens must be >= 1, got -1", "max_tokens"),
    ({"prompt": "x", "n": 0}, "n must be >= 1", "n"),
    ({"prompt": "x", "temperature": "hot"}, "temperature: Input should be a valid number",
     "temperature"),
    ({"prompt": 5}, "prompt must be str or list[str] or list[int] or list[list[int]]",
     "prompt"),
    ({"prompt": "x", "echo": True}, "echo must be false (echoing the prompt is not supported)",
     "echo"),
    ({"prompt": "x", "best_of": 3}, "best_of must be null, 1 or n = 1", "best_of"),
    ({"prompt": "x", "suffix": "end"}, "suffix must be null", "suffix"),
    ({"prompt": "x", "logit_bias": {"hello": 5}}, "logit_bias must be an object keyed by "
     "token ids (integers), got ['hello']", "logit_bias"),
    ({"prompt": "x", "logit_bias": {"5": 101}}, "logit_bias[5] must be in [-100, 100]",
     "logit_bias[5]"),
    ({"prompt": "x", "response_format": {"type": "xml"}}, "response_format.type must be text, "
     "json_object or json_schema, got 'xml'", "response_format.type"),
    ({"prompt": "x", "response_format": {"type": "json_object"}, "guided_regex": "a+"},
     "constraint must be at most one of json_schema, json_object, regex, choice, grammar",
     "constraint"),
]


@pytest.mark.parametrize("target", ["engine", "router"])
def test_bad_requests_are_400_naming_the_field_and_unknown_model_404(servers, target):
    url = f"{servers[target].url}/v1/completions"
    headers = {"Authorization": f"Bearer {KEY}"}
    with httpx.Client(headers=headers, timeout=30) as http:
        for body, message, param in BAD_BODIES:
            reply = http.post(url, content=json.dumps(body).encode())  # NaN as JSON's NaN
            error = reply.json()["error"]
            assert reply.status_code == 400, (body, error)
            assert error["message"].startswith(message), (body, error)
            assert error["type"] == "invalid_request_error" and error["param"] == param
            assert len(error["message"]) < 300
        undecodable = http.post(url, content=b'{"prompt": "\xff\xfe"}')
        assert undecodable.status_code == 400
        assert undecodable.json()["error"]["message"].startswith("request could not be decoded")
        chat = http.post(f"{servers[target].url}/v1/chat/completions",
                         json={"messages": [], "extra_gateway_field": True})
        assert chat.status_code == 400
        assert chat.json()["error"]["message"].startswith("messages must hold at least one")
    with pytest.raises(openai.NotFoundError) as err:
        sdk(servers[target]).completions.create(model="no-such-model", prompt="x")
    assert err.value.body["code"] == "model_not_found" and "no-such-model" in str(err.value)


SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}
# request fields -> the SamplingParams constraint they make (its `constraint` property)
CONSTRAINT_FIELDS = [
    ({"response_format": {"type": "text"}}, None),
    ({"response_format": {"type": "json_object"}}, ("json_object", True)),
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "n", "schema": SCHEMA, "strict": True}}},
     ("json_schema", json.dumps(SCHEMA))),
    ({"structured_outputs": {"json": SCHEMA}}, ("json_schema", json.dumps(SCHEMA))),
    ({"structured_outputs": {"json": '{"type": "string"}'}}, ("json_schema", '{"type": "string"}')),
    ({"structured_outputs": {"regex": "a+"}}, ("regex", "a+")),
    ({"structured_outputs": {"choice": ["yes", "no"]}}, ("choice", ["yes", "no"])),
    ({"structured_outputs": {"grammar": 'root ::= "a"'}}, ("grammar", 'root ::= "a"')),
    ({"structured_outputs": {"json_object": True}}, ("json_object", True)),
    ({"guided_json": SCHEMA}, ("json_schema", json.dumps(SCHEMA))),
    ({"guided_regex": "a+"}, ("regex", "a+")),
    ({"guided_choice": ["yes", "no"]}, ("choice", ["yes", "no"])),
    ({"guided_grammar": 'root ::= "a"'}, ("grammar", 'root ::= "a"')),
]


def test_logit_bias_and_constraint_fields_map_onto_sampling_params():
    card = ModelCard(MODEL, 512, 1000)

    def params(body: dict, kind=CompletionRequest) -> SamplingParams:
        request, = generate_requests(kind.model_validate(body), card, "r")
        return sampling_params_from_proto(request.sampling)  # what the engine will see

    got = params({"prompt": "x", "logit_bias": {"5": 10, "7": -100},
                  "allowed_token_ids": [1, 2]})
    assert (got.logit_bias, got.allowed_token_ids) == ({5: 10.0, 7: -100.0}, [1, 2])
    for fields, constraint in CONSTRAINT_FIELDS:
        assert params({"prompt": "x", **fields}).constraint == constraint, fields
        assert params({"messages": CHAT, **fields}, ChatRequest).constraint == constraint, fields
    # vLLM's extra `priority` reaches GenerateRequest.priority, within int32
    for kind, body in ((CompletionRequest, {"prompt": ["a", "b"]}),
                       (ChatRequest, {"messages": CHAT})):
        requests = generate_requests(kind.model_validate({**body, "priority": -3}), card, "r")
        assert [r.priority for r in requests] == [-3] * len(requests)
        with pytest.raises(ValueError, match=r"^priority must be an int32, got 2147483648$"):
            generate_requests(kind.model_validate({**body, "priority": 2**31}), card, "r")


@pytest.mark.parametrize("target", ["engine", "router"])
def test_body_over_the_request_limit_is_413_before_it_is_read(servers, target):
    limit = 64 << 20  # MAX_REQUEST_BYTES, the router's gRPC limit
    port = int(servers[target].url.rsplit(":", 1)[1])

    def post(framing: bytes, body: Iterator[bytes]) -> tuple[int, dict]:
        with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
                         + KEY.encode() + b"\r\nContent-Type: application/json\r\n" + framing)
            for part in body:
                sock.sendall(part)
            reply = http.client.HTTPResponse(sock)
            reply.begin()
            return reply.status, json.loads(reply.read())

    # a declared size past the limit is refused with only the headers read
    status, body = post(b"Content-Length: %d\r\n\r\n" % (limit + 1), iter([b'{"prompt": "']))
    assert status == 413, body
    assert body["error"] == {"message": f"request body must be at most {limit} bytes, got "
                             f"{limit + 1}", "type": "invalid_request_error", "param": None,
                             "code": "request_too_large"}
    if target == "engine":  # a chunked body is cut off as soon as it passes the limit
        chunk = b"a" * (1 << 20)
        status, body = post(b"Transfer-Encoding: chunked\r\n\r\n",
                            (b"100000\r\n" + chunk + b"\r\n" for _ in range(65)))
        assert status == 413, body
        assert body["error"]["message"].startswith(f"request body must be at most {limit} "
                                                   f"bytes, got at least ")
    done = sdk(servers[target]).completions.create(model=MODEL, prompt="x", max_tokens=2,
                                                   temperature=0, extra_body={"ignore_eos": True})
    assert done.usage.completion_tokens == 2  # and the server goes on serving


def abort_count(server: Server) -> float:
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    match = re.search(r'^vllm:request_success_total\{[^}]*finished_reason="abort"[^}]*\} (\S+)',
                      text, re.M)
    return float(match.group(1)) if match else 0.0


def test_cancelled_stream_and_dropped_request_abort_and_free_their_blocks(servers,
                                                                          grpc_client):
    engine = servers["engine"]
    before = abort_count(engine)
    stream = sdk(servers["router"]).completions.create(
        model=MODEL, prompt=[7] * 10, max_tokens=480, temperature=0, stream=True,
        extra_body={"ignore_eos": True})
    first = next(iter(stream))
    assert first.choices[0].text is not None
    assert grpc_client.load().num_running == 1  # still generating when the client leaves
    stream.close()
    assert wait_blocks_free(grpc_client).kv_blocks_used == 0
    assert abort_count(engine) == before + 1  # aborted, not finished by length
    # A non-streaming request whose client times out is aborted the same way.
    with pytest.raises(httpx.TimeoutException):
        httpx.post(f"{engine.url}/v1/completions", timeout=0.5,
                   headers={"Authorization": f"Bearer {KEY}"},
                   json={"prompt": [8] * 10, "max_tokens": 480, "ignore_eos": True,
                         "temperature": 0})
    assert wait_blocks_free(grpc_client).kv_blocks_used == 0
    assert abort_count(engine) == before + 2


def test_api_key_on_http_and_grpc(servers):
    engine, router = servers["engine"], servers["router"]
    for server in (engine, router):
        with pytest.raises(openai.AuthenticationError):
            sdk(server, key="wrong").completions.create(model=MODEL, prompt="x", max_tokens=1)
        plain = httpx.post(f"{server.url}/v1/completions", json={"prompt": "x"}, timeout=10)
        assert plain.status_code == 401 and plain.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200  # stay open
        assert httpx.get(f"{server.url}/metrics", timeout=10).status_code == 200
        with Client(server.target, timeout=30) as keyless:
            assert keyless.health() == "SERVING"
            with pytest.raises(NanoserveError) as err:
                keyless.generate([1, 2, 3], max_tokens=2)
            assert err.value.code == grpc.StatusCode.UNAUTHENTICATED
        with Client(server.target, timeout=30, api_key=KEY) as keyed:
            assert len(keyed.generate([1, 2, 3], max_tokens=2, **GREEDY).token_ids) == 2


def test_sse_framing_models_info_and_metrics(servers):
    router = servers["router"]
    headers = {"Authorization": f"Bearer {KEY}"}
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 6, "n": 2, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{router.url}/v1/completions", json=body, headers=headers,
                      timeout=30) as reply:
        assert reply.status_code == 200
        assert reply.headers["content-type"].startswith("text/event-stream")
        raw = reply.read().decode()
    assert raw.endswith("\n\ndata: [DONE]\n\n")
    events = raw.split("\n\n")[:-1]
    assert all(e.startswith("data: ") for e in events)
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    assert all(c["object"] == "text_completion" and c["model"] == MODEL for c in chunks)
    usage = chunks[-1]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 12
    finished = {c["choices"][0]["index"]: c["choices"][0]["finish_reason"] for c in chunks[:-1]
                if c["choices"][0]["finish_reason"]}
    assert finished == {0: "length", 1: "length"}
    models = httpx.get(f"{router.url}/v1/models", headers=headers, timeout=10).json()
    assert [m["id"] for m in models["data"]] == [MODEL]
    info = httpx.get(f"{router.url}/get_server_info", headers=headers, timeout=10).json()
    assert info["max_model_len"] == 512 and info["served_model_name"] == MODEL
    engine_metrics = httpx.get(f"{servers['engine'].url}/metrics", timeout=10).text
    assert 'vllm:num_requests_running{model_name="tiny-served"}' in engine_metrics
    assert "nanoserve_router_requests_total" in httpx.get(f"{router.url}/metrics",
                                                          timeout=10).text


def test_router_429_with_retry_after_when_full(servers):
    engine = servers["engine"]
    limited = with_http(start_router([engine.target], *ROUTER_ARGS, "--api-key", KEY,
                                     "--max-concurrent-requests", "1",
                                     "--max-queued-requests", "0"))
    try:
        wait_healthy(limited.url)
        stream = sdk(limited).completions.create(
            model=MODEL, prompt=[9] * 10, max_tokens=480, temperature=0, stream=True,
            extra_body={"ignore_eos": True})
        next(iter(stream))
        reply = httpx.post(f"{limited.url}/v1/completions", timeout=10,
                           headers={"Authorization": f"Bearer {KEY}"},
                           json={"prompt": "x", "max_tokens": 2, "stream": True})
        assert reply.status_code == 429, reply.text
        assert reply.headers["retry-after"] == "1"
        assert reply.json()["error"]["message"].startswith("router at --max-concurrent-requests")
        stream.close()
    finally:
        assert limited.proc.stop() == 0
    with Client(engine.target, api_key=KEY) as c:
        assert wait_blocks_free(c).kv_blocks_used == 0


def test_health_is_503_while_draining_and_the_open_stream_goes_on(servers):
    drain = servers["drain"]
    client = sdk(drain)
    stream = client.completions.create(model=MODEL, prompt=[4] * 10, max_tokens=480,
                                       temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    chunks = iter(stream)
    next(chunks)
    assert httpx.get(f"{drain.url}/health", timeout=10).status_code == 200
    drain.proc.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 10
    while httpx.get(f"{drain.url}/health", timeout=10).status_code != 503:
        assert time.monotonic() < deadline, "/health never turned 503 while draining"
        time.sleep(0.02)
    with pytest.raises(openai.InternalServerError) as err:  # 503: new requests are refused
        client.completions.create(model=MODEL, prompt="x", max_tokens=2)
    assert err.value.status_code == 503 and "draining" in str(err.value)
    more = [next(chunks) for _ in range(3)]  # the open stream still flows
    assert all(c.choices[0].finish_reason is None for c in more)
    stream.close()  # the engine aborts it; with nothing in flight the drain ends
    assert drain.proc.proc.wait(30) == 0


def test_cli_flags_reach_the_config():
    import argparse

    from router.cli import add_arguments, config_from_args

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    config = config_from_args(parser.parse_args(
        ["--engine", "a:1", "--http-port", "off", "--served-model-name", "m", "--api-key", "k"]))
    assert (config.http_port, config.served_model_name, config.api_key) == (None, "m", "k")
    assert config_from_args(parser.parse_args(["--engine", "a:1"])).http_port == 8000
    with pytest.raises(SystemExit):
        parser.parse_args(["--engine", "a:1", "--http-port", "70000"])
