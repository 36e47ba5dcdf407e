"""Diffusion LLMs (LLaDA, Dream) served: a real engine process per family (gRPC and its
OpenAI HTTP front) and a real router in front of each, against the offline `LLM` on the
same checkpoint (float32, CPU, temperature 0: the same tokens). A request's answer comes in
final blocks, one chunk each; usage reports its forward passes; the parameters of the other
kind of model are refused at the edge, naming the field; a cancelled stream frees its KV
blocks; the router continues a request on another engine from its next block (LLaDA's
router has two engines; the failover test, last, kills one).

The checkpoints get a word-level tokenizer (word i is id i) so text and chat work."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import openai
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from clients import Client
from clients.errors import InvalidArgument
from engine_service import LLM, SamplingParams
from engine_service.common.proto_convert import Refused, diffusion_params_to_proto
from engine_service.common.sampling_params import DIFFUSION_ARCHITECTURES, DiffusionParams
from engine_service.common.tokenizer import Tokenizer as ServingTokenizer
from nanoserve.v1 import nanoserve_pb2 as pb
from nanoserve.v1 import nanoserve_pb2_grpc as pb_grpc
from router.server import continuation_request, rest_of_canvas
from tests.procs import ServerProc, start_engine, start_router, wait_blocks_free
from tests.tiny_checkpoints import DIFFUSION_VOCAB_SIZE, make_tiny_dream, make_tiny_llada

pytestmark = pytest.mark.timeout(300)

MAX_MODEL_LEN = 256
ENGINE_ARGS = ("--kv-block-size", "4", "--max-model-len", str(MAX_MODEL_LEN),
               "--http-port", "0")
ROUTER_ARGS = ("--health-interval", "0.2", "--load-interval", "0.1")
OFFLINE = dict(device="cpu", dtype="float32", num_kv_blocks=512, kv_block_size=4,
               max_model_len=MAX_MODEL_LEN)
FAMILIES = {"llada": make_tiny_llada, "dream": make_tiny_dream}
PROMPTS = [[5, 9, 2, 77, 31], list(range(40, 60))]
SETTINGS = [
    dict(gen_length=16, steps=8, block_length=4),
    dict(gen_length=12, steps=12, block_length=6, remasking="random"),
    dict(gen_length=16, steps=16, block_length=8, confidence_threshold=0.02),
]
EMBEDDING_ROWS = 256  # make_tiny_llada's embedding_size
CHAT_TEMPLATE = "{% for m in messages %}w1 {{ m['content'] }} w2 {% endfor %}w3"


def write_word_tokenizer(model_dir: Path) -> None:
    """Word i is id i, for every row of the tiny checkpoints' embeddings (LLaDA's pad the
    vocabulary, and the engine may unmask to a padding row); a chat template."""
    words = {f"w{i}": i for i in range(EMBEDDING_ROWS)}
    tok = Tokenizer(models.WordLevel(words, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(model_dir / "tokenizer.json"))
    (model_dir / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": f"w{DIFFUSION_VOCAB_SIZE - 2}", "chat_template": CHAT_TEMPLATE}))


@dataclass
class Served:
    family: str
    model_dir: Path
    engine: ServerProc
    router: ServerProc
    llm: LLM
    spares: list[ServerProc]  # more engines behind the router
    killed: list[ServerProc]

    def http(self, proc: ServerProc) -> str:
        scheme, port = proc.http_address()
        return f"{scheme}://127.0.0.1:{port}"


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> Iterator[dict[str, Served]]:
    """Per family: an engine process (LLaDA: two), a router over them, and the offline LLM.
    Every process starts at once (each spends seconds importing)."""
    dirs = {}
    for family, make in FAMILIES.items():
        dirs[family] = Path(make(tmp_path_factory.mktemp(family), seed=3))
        write_word_tokenizer(dirs[family])
    procs: list[ServerProc] = []
    killed: list[ServerProc] = []
    try:
        with ThreadPoolExecutor(3) as pool:
            started = list(pool.map(lambda d: start_engine(d, *ENGINE_ARGS),
                                    [*dirs.values(), dirs["llada"]]))
            procs += started
            engines = {"llada": started[:1] + started[2:], "dream": started[1:2]}
            routers = dict(zip(dirs, pool.map(
                lambda es: start_router([e.target for e in es], *ROUTER_ARGS),
                engines.values()), strict=True))
            procs += routers.values()
        for router in routers.values():
            with Client(router.target, timeout=5) as c:
                deadline = time.monotonic() + 30
                while c.health() != "SERVING":
                    assert time.monotonic() < deadline, "the router never became SERVING"
                    time.sleep(0.05)
        yield {f: Served(f, dirs[f], engines[f][0], routers[f], LLM(str(dirs[f]), **OFFLINE),
                         engines[f][1:], killed) for f in dirs}
    finally:
        for proc in procs:
            if proc not in killed:
                assert proc.stop() == 0, proc.output()[-3000:]


@pytest.fixture(params=list(FAMILIES))
def family(request, served) -> Served:
    return served[request.param]


def offline(s: Served, prompt: list[int], diffusion: dict, count_passes: bool = False,
            **sampling):
    """(token ids, text, forward passes or 0) of the offline engine."""
    sp = SamplingParams(diffusion=DiffusionParams(**diffusion), **sampling)
    out = s.llm.generate([prompt], sp, use_tqdm=False)[0]
    engine = s.llm.engine
    passes = 0
    if count_passes:  # the same request again, on the engine itself
        engine.add_request("passes", prompt, sp)
        while engine.has_unfinished():
            passes = max([passes, *(o.num_forward_passes for o in engine.step())])
    assert engine.block_manager.all_free()
    return out.token_ids, out.text, passes


def test_architectures_known_without_the_model_code():
    from models.config import DIFFUSION_ARCHITECTURES as FROM_MODELS

    assert set(FROM_MODELS) == DIFFUSION_ARCHITECTURES


@pytest.mark.parametrize("via", ["engine", "router"])
@pytest.mark.parametrize("diffusion", SETTINGS, ids=lambda d: "-".join(map(str, d.values())))
def test_generate_and_stream_equal_offline(family, via, diffusion):
    target = (family.engine if via == "engine" else family.router).target
    block = diffusion["block_length"]
    with Client(target, timeout=60) as client:
        for i, prompt in enumerate(PROMPTS):
            want, text, passes = offline(family, prompt, diffusion, True, ignore_eos=True,
                                         seed=i)
            assert len(want) == diffusion["gen_length"] and text
            got = client.generate(prompt, diffusion=diffusion, ignore_eos=True, seed=i)
            assert got.token_ids == want and got.text == text
            assert got.finish_reason == "length"
            assert got.usage.num_forward_passes == passes > 0
            assert got.usage.prompt_tokens == len(prompt)
            assert got.usage.completion_tokens == len(want)
            chunks = list(client.stream(prompt, diffusion=DiffusionParams(**diffusion),
                                        ignore_eos=True, seed=i))
            assert [len(c.token_ids) for c in chunks] == [block] * (len(want) // block)
            assert [t for c in chunks for t in c.token_ids] == want
            assert "".join(c.text for c in chunks) == text
            assert [c.usage is not None for c in chunks] == [False] * (len(chunks) - 1) + [True]
            assert chunks[-1].usage.num_forward_passes == passes
            assert chunks[-1].finish_reason == "length"
    with Client(family.engine.target) as client:
        assert wait_blocks_free(client).kv_blocks_used == 0


def test_eos_ends_with_its_block_and_text_prompts(family):
    """Without ignore_eos a block holding the eos is the last (stop); a text prompt is
    tokenized by the engine as offline."""
    diffusion = SETTINGS[0]
    with Client(family.router.target, timeout=60) as client:
        for prompt in PROMPTS:
            want, text, _ = offline(family, prompt, diffusion)
            got = client.generate(prompt, diffusion=diffusion)
            assert got.token_ids == want and got.text == text
        words = "w5 w9 w2 w77"
        want, text, _ = offline(family, [5, 9, 2, 77], diffusion, ignore_eos=True)
        got = client.generate(words, diffusion=diffusion, ignore_eos=True)
        assert got.token_ids == want and got.text == text and got.usage.prompt_tokens == 4
    stop = want[5]  # in the second block: the answer ends at its first occurrence
    cut, _, _ = offline(family, [5, 9, 2, 77], diffusion, stop_token_ids=[stop])
    assert cut == want[:want.index(stop) + 1]
    with Client(family.engine.target, timeout=60) as client:
        got = client.generate([5, 9, 2, 77], diffusion=diffusion, stop_token_ids=[stop])
    assert got.token_ids == cut and got.finish_reason == "stop"
    assert got.stop_reason == str(stop)


@pytest.mark.parametrize("via", ["engine", "router"])
@pytest.mark.parametrize("sampling, field", [
    ({"temperature": 0.5}, "temperature"),
    ({"max_tokens": 8}, "max_tokens"),
    ({"top_p": 0.9}, "top_p"),
    ({"logprobs": 2}, "logprobs"),
    ({"json_object": True}, "json_object"),
])
def test_autoregressive_parameters_refused_naming_the_field(served, via, sampling, field):
    s = served["llada"]
    target = (s.engine if via == "engine" else s.router).target
    with Client(target, timeout=30) as client:
        with pytest.raises(InvalidArgument) as err:
            client.generate([1, 2, 3], diffusion=SETTINGS[0], **sampling)
        assert err.value.details.startswith(f"{field} applies to autoregressive models")
        assert client.generate([1, 2, 3], diffusion=SETTINGS[0]).token_ids  # serves on


@pytest.mark.parametrize("bad, field", [
    (dict(gen_length=16, block_length=5), "block_length"),
    (dict(gen_length=16, block_length=8, steps=3), "steps"),
    (dict(remasking="entropy"), "remasking"),
    (dict(confidence_threshold=1.5), "confidence_threshold"),
])
def test_bad_diffusion_values_name_the_field(served, bad, field):
    s = served["dream"]
    with pytest.raises(ValueError, match=f"^{field} must be"):  # the client's own check
        Client(s.engine.target).generate([1, 2], diffusion=bad)
    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 2]))
    for name, value in bad.items():  # the proto holds each: the engine's check names it
        setattr(request.diffusion, name, value)
    for proc in (s.engine, s.router):
        with grpc.insecure_channel(proc.target) as channel, \
                pytest.raises(grpc.RpcError) as err:
            pb_grpc.GenerationStub(channel).Generate(request, timeout=30)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.value.details().startswith(f"{field} must be")


@pytest.mark.parametrize("is_diffusion, sampling, diffusion, field", [
    (True, pb.SamplingParams(temperature=0.5), None, "temperature"),
    (True, pb.SamplingParams(min_tokens=1), pb.DiffusionParams(gen_length=8, block_length=8,
                                                               steps=8), "min_tokens"),
    (False, pb.SamplingParams(), pb.DiffusionParams(gen_length=8, block_length=8, steps=8),
     "diffusion"),
])
def test_the_other_kind_is_refused_before_the_core(served, is_diffusion, sampling, diffusion,
                                                   field):
    """The frontend knows its engine's kind from the model info: such a request never
    reaches the core process."""
    from engine_service import core_process as core
    from engine_service.frontend import Frontend
    from engine_service.metrics import EngineMetrics

    sent = []

    class Pipe:
        def send(self, msg) -> None:
            sent.append(msg)

    info = dict(max_model_len=64, vocab_size=DIFFUSION_VOCAB_SIZE, kv_block_size=4,
                is_diffusion=is_diffusion)
    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 2, 3]), sampling=sampling,
                                 diffusion=diffusion)

    async def submit() -> None:
        frontend = Frontend(model_dir=str(served["llada"].model_dir), engine_id="e",
                            requests=Pipe(), outputs=None, max_in_flight=4,
                            metrics=EngineMetrics("m"))
        frontend._on_core_message(core.CoreReady(info, [], core.LoadSnapshot()))
        with pytest.raises(Refused) as err:
            await frontend._submit(request)
        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert str(err.value).startswith(field)
        request.ClearField("sampling")
        request.ClearField("diffusion")
        await frontend._submit(request)  # the same prompt, for the right kind: sent

    asyncio.run(submit())
    assert [type(m) for m in sent] == [core.AddRequest]


def test_cancelled_stream_frees_every_block(family):
    diffusion = dict(gen_length=128, steps=128, block_length=8)
    with Client(family.engine.target, timeout=60) as client:
        it = client.stream(list(range(1, 60)), diffusion=diffusion, ignore_eos=True)
        first = next(it)
        assert len(first.token_ids) == 8 and first.finish_reason is None
        load = client.load()
        assert load.kv_blocks_used >= (59 + 128) // 4 and load.num_running == 1
        assert load.tokens_in_flight > 0
        it.close()  # cancels the RPC: the engine aborts the request
        load = wait_blocks_free(client)
        assert load.kv_blocks_used == load.num_running == load.num_waiting == 0
        assert client.generate([1, 2], diffusion=SETTINGS[0]).finish_reason is not None


def metric(url: str, name: str, **labels: str) -> float:
    """One sample of the Prometheus text at url/metrics (0 if absent)."""
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        series, _, value = line.rpartition(" ")
        if series.startswith(name + "{") and want in series:
            return float(value)
    return 0.0


def test_openai_completions_chat_and_metrics(family):
    url = family.http(family.engine)
    diffusion = SETTINGS[0]
    want, text, _ = offline(family, PROMPTS[0], diffusion, ignore_eos=True)
    before = {name: metric(url, name) for name in ("vllm:generation_tokens_total",
                                                   "vllm:prompt_tokens_total")}
    done = metric(url, "vllm:request_success_total", finished_reason="length")
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    model = family.model_dir.name
    body = {"diffusion": diffusion, "ignore_eos": True}
    out = client.completions.create(model=model, prompt=PROMPTS[0], extra_body=body)
    assert out.choices[0].text == text and out.choices[0].finish_reason == "length"
    assert out.usage.completion_tokens == len(want)
    streamed = list(client.completions.create(model=model, prompt=PROMPTS[0], stream=True,
                                              extra_body=body))
    assert "".join(c.choices[0].text for c in streamed) == text
    assert len(streamed) == len(want) // diffusion["block_length"]
    assert metric(url, "vllm:generation_tokens_total") == \
        before["vllm:generation_tokens_total"] + 2 * len(want)
    assert metric(url, "vllm:prompt_tokens_total") == \
        before["vllm:prompt_tokens_total"] + 2 * len(PROMPTS[0])
    assert metric(url, "vllm:request_success_total", finished_reason="length") == done + 2
    # Chat: the template's prompt, no max_tokens of its own; through the router's front too.
    messages = [{"role": "user", "content": "w7 w8 w9"}]
    ids = ServingTokenizer.from_dir(family.model_dir).encode_chat(messages)
    _, chat_text, _ = offline(family, ids, diffusion, ignore_eos=True)
    for base in (url, family.http(family.router)):
        chat = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
        answer = chat.chat.completions.create(model=model, messages=messages, extra_body=body)
        assert answer.choices[0].message.content == chat_text
        assert answer.usage.prompt_tokens == len(ids)


@pytest.mark.parametrize("extra, status_field", [
    ({"diffusion": {"gen_length": 16, "block_length": 5}}, "block_length"),
    ({"diffusion": {"gen_length": 16, "block_length": 8, "steps": 8, "temperature": "hot"}},
     "temperature"),
    ({"diffusion": {"gen_len": 16}}, "diffusion"),
    ({"diffusion": {"gen_length": 16, "block_length": 8, "steps": 8}, "top_k": 5}, "top_k"),
])
def test_openai_errors_name_the_field(served, extra, status_field):
    s = served["llada"]
    for base in (s.http(s.engine), s.http(s.router)):
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.BadRequestError) as err:
            client.completions.create(model=s.model_dir.name, prompt=[1, 2, 3],
                                      extra_body=extra)
        assert err.value.status_code == 400
        error = err.value.body
        assert error["param"] == status_field, error
        assert error["message"].startswith(status_field), error
        assert error["code"] == "invalid_argument"


@pytest.mark.parametrize("name", list(FAMILIES))
def test_failover_continuation_continues_the_canvas(served, name):
    """What the router sends another engine after `sent` blocks went out: the prompt plus
    those blocks, with the canvas's remaining blocks to decode; greedy, it gives the rest of
    the first engine's answer (offline here)."""
    s = served[name]
    p = DiffusionParams(gen_length=16, steps=8, block_length=4)
    prompt = PROMPTS[0]
    full, _, _ = offline(s, prompt, vars(p), ignore_eos=True)
    original = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt),
                                  sampling=pb.SamplingParams(ignore_eos=True))
    for sent in (4, 8, 12):
        request = continuation_request(original, "r", prompt, full[:sent], 16, p)
        assert list(request.token_ids.ids) == prompt + full[:sent]
        assert not request.sampling.HasField("max_tokens")
        assert request.diffusion == diffusion_params_to_proto(rest_of_canvas(p, sent))
        rest = rest_of_canvas(p, sent)
        assert (rest.gen_length, rest.steps, rest.block_length) == (16 - sent,
                                                                    (16 - sent) // 2, 4)
        tail, _, _ = offline(s, prompt + full[:sent], vars(rest), ignore_eos=True)
        assert tail == full[sent:]


def test_router_fails_over_mid_stream_from_the_next_block(served):
    """kill -9 the engine streaming a request after its third block (past max_tokens' default
    16, which does not bound a diffusion request): the router continues on the other engine
    from the next block, and the client gets the one engine's answer."""
    s = served["llada"]
    diffusion = dict(gen_length=128, steps=128, block_length=8)
    prompt = list(range(3, 40))
    want, _, _ = offline(s, prompt, diffusion, ignore_eos=True)
    with Client(s.router.target, timeout=60) as client:
        it = client.stream(prompt, diffusion=diffusion, ignore_eos=True)
        chunks = [next(it) for _ in range(3)]
        first = next(p for p in [s.engine, *s.spares] if p.target == chunks[0].engine_id)
        os.killpg(first.proc.pid, signal.SIGKILL)
        first.proc.wait(10)
        s.killed.append(first)
        chunks += list(it)
    assert [t for c in chunks for t in c.token_ids] == want
    assert {c.engine_id for c in chunks} == {p.target for p in [s.engine, *s.spares]}
    assert chunks[-1].finish_reason == "length"
    assert chunks[-1].usage.completion_tokens == len(want)
    assert chunks[-1].usage.prompt_tokens == len(prompt)
