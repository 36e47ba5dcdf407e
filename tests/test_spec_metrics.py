"""Speculative decoding's metrics on a real engine's /metrics, under vLLM's spec_decode names,
and the speculative flags of `nanoserve engine`."""

from __future__ import annotations

import socket
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from clients.cli import build_parser, main
from engine_service.cli import engine_config_from_args
from engine_service.config import EngineConfig
from engine_service.spec_decode.ngram_proposer import propose_ngram
from engine_service.spec_decode.speculator import SpecDecodeStats
from nanoserve.v1 import nanoserve_pb2 as pb
from nanoserve.v1 import nanoserve_pb2_grpc as pb_grpc
from tests.procs import start_engine

pytestmark = pytest.mark.timeout(300)
K, LOOKUP_MIN, LOOKUP_MAX = 3, 1, 2
SPEC_FLAGS = ("--speculative-method", "ngram", "--num-speculative-tokens", str(K),
              "--prompt-lookup-min", str(LOOKUP_MIN), "--prompt-lookup-max", str(LOOKUP_MAX))
MAX_MODEL_LEN, MAX_TOKENS = 256, 24
# Repetitive prompts: their n-grams recur, so prompt lookup proposes from the first step.
PROMPTS = [[5, 6, 7, 8] * 6, [11, 12] * 10, [20, 21, 22, 23, 24] * 4, list(range(30, 40)) * 3]
COUNTERS = ("drafts", "draft_tokens", "accepted_tokens")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(model_dir, *flags: str):
    port = _free_port()
    proc = start_engine(model_dir, "--max-model-len", str(MAX_MODEL_LEN), "--metrics-port",
                        str(port), *flags)
    return proc, port


@pytest.fixture(scope="module")
def engines(tiny_model_dir):
    """(spec engine, its metrics port), (plain engine, its metrics port): started together."""
    with ThreadPoolExecutor(2) as pool:
        started = [pool.submit(_start, tiny_model_dir, *SPEC_FLAGS),
                   pool.submit(_start, tiny_model_dir)]
        pairs = [f.result() for f in started]
    yield pairs
    for proc, _ in pairs:
        assert proc.stop() == 0, proc.output()[-3000:]


def _generate(target: str, prompts: list[list[int]]) -> list[list[int]]:
    """Greedy outputs of MAX_TOKENS each; a request returns once the frontend has counted
    its last step, whose speculative counts came in the same message."""
    sp = pb.SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    with grpc.insecure_channel(target) as channel:
        stub = pb_grpc.GenerationStub(channel)
        return [list(stub.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=p),
                                                      sampling=sp), timeout=60).token_ids)
                for p in prompts]


def _spec_samples(port: int) -> dict[tuple[str, tuple], float]:
    """spec_decode samples of /metrics: (name, sorted labels) -> value."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples
            if "spec_decode" in s.name}


def _scraped_stats(port: int, model_name: str) -> SpecDecodeStats:
    samples = _spec_samples(port)
    model = (("model_name", model_name),)

    def value(name: str, *labels: tuple[str, str]) -> int:
        return int(samples[(f"vllm:spec_decode_num_{name}_total", tuple(sorted(model + labels)))])

    positions = [dict(labels)["position"] for name, labels in samples
                 if name == "vllm:spec_decode_num_accepted_tokens_per_pos_total"]
    assert sorted(positions) == [str(i) for i in range(K)]  # 0-based, as vLLM
    per_pos = [value("accepted_tokens_per_pos", ("position", str(i))) for i in range(K)]
    return SpecDecodeStats(*(value(c) for c in COUNTERS), accepted_per_pos=per_pos)


def _replayed_stats(prompt: list[int], output: list[int]) -> SpecDecodeStats:
    """What the speculator counts for one greedy request, replayed from its output. While a
    plain step is in flight, the engine lands it to speculate only if the tokens before it
    recur; otherwise the next step overlaps it, without proposals. A speculative step
    proposes from the tokens so far, and the target keeps the proposals its output repeats,
    then adds one token of its own."""
    stats = SpecDecodeStats(accepted_per_pos=[0] * K)
    n = 1  # the prefill step makes the first output token
    plain_in_flight = True
    while n < len(output):
        if plain_in_flight and not propose_ngram(prompt + output[:n - 1], 1, LOOKUP_MIN,
                                                 LOOKUP_MAX):
            n += 1
            continue
        tokens = prompt + output[:n]
        limit = max(0, min(K, MAX_TOKENS - n - 1, MAX_MODEL_LEN - len(tokens) - 1))
        proposal = propose_ngram(tokens, limit, LOOKUP_MIN, LOOKUP_MAX) if limit else []
        kept = 0
        while kept < len(proposal) and proposal[kept] == output[n + kept]:
            kept += 1
        if proposal:
            stats = _plus(stats, SpecDecodeStats(1, len(proposal), kept,
                                                 [1] * kept + [0] * (K - kept)))
        plain_in_flight = not proposal
        n += kept + 1
    return stats


def _plus(a: SpecDecodeStats, b: SpecDecodeStats) -> SpecDecodeStats:
    return SpecDecodeStats(a.num_drafts + b.num_drafts, a.num_draft_tokens + b.num_draft_tokens,
                           a.num_accepted_tokens + b.num_accepted_tokens,
                           [x + y for x, y in zip(a.accepted_per_pos, b.accepted_per_pos,
                                                  strict=True)])


def _minus(after: SpecDecodeStats, before: SpecDecodeStats) -> SpecDecodeStats:
    return SpecDecodeStats(*(getattr(after, f"num_{c}") - getattr(before, f"num_{c}")
                             for c in COUNTERS),
                           [a - b for a, b in zip(after.accepted_per_pos,
                                                  before.accepted_per_pos, strict=True)])


def test_spec_decode_counters_match_what_the_requests_did(engines, tiny_model_dir):
    (spec, spec_port), (plain, plain_port) = engines
    model_name = tiny_model_dir.name
    before = _scraped_stats(spec_port, model_name)  # the series exist from start-up, at 0
    assert before == SpecDecodeStats(0, 0, 0, [0] * K)
    outputs = _generate(spec.target, PROMPTS)
    grew = _minus(_scraped_stats(spec_port, model_name), before)

    assert grew.num_drafts > 0
    assert grew.num_draft_tokens >= grew.num_drafts
    assert 0 < grew.num_accepted_tokens <= grew.num_draft_tokens
    assert sum(grew.accepted_per_pos) == grew.num_accepted_tokens
    per_pos = grew.accepted_per_pos
    assert per_pos == sorted(per_pos, reverse=True)  # a kept proposal follows kept ones
    expected = SpecDecodeStats(accepted_per_pos=[0] * K)
    for prompt, output in zip(PROMPTS, outputs, strict=True):
        expected = _plus(expected, _replayed_stats(prompt, output))
    assert grew == expected

    # Speculation changes no token; an engine without it exports no spec_decode series.
    assert _generate(plain.target, PROMPTS) == outputs
    assert _spec_samples(plain_port) == {}


SPEC_FLAG_NAMES = ("--speculative-method", "--num-speculative-tokens", "--prompt-lookup-min",
                   "--prompt-lookup-max", "--speculative-model")


def test_engine_help_lists_the_speculative_flags(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["engine", "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    missing = [flag for flag in SPEC_FLAG_NAMES if flag not in out]
    assert not missing, out


def _config(*argv: str):
    parser, _ = build_parser("engine")  # `nanoserve engine`'s own parser
    return engine_config_from_args(parser.parse_args(["engine", *argv]))


SPEC_FIELDS = ("speculative_method", "num_speculative_tokens", "prompt_lookup_min",
               "prompt_lookup_max", "speculative_model", "speculative_disable_by_batch_size")


def test_engine_config_from_args_maps_the_speculative_flags(tiny_model_dir):
    model = str(tiny_model_dir)

    def fields(config) -> tuple:
        return tuple(getattr(config, name) for name in SPEC_FIELDS)

    batch = EngineConfig.speculative_disable_by_batch_size
    assert fields(_config("--model", model)) == (None, None, None, None, None, batch)
    ngram = _config("--model", model, "--speculative-method", "ngram",
                    "--num-speculative-tokens", "4", "--prompt-lookup-min", "2",
                    "--prompt-lookup-max", "3", "--speculative-disable-by-batch-size", "8")
    assert fields(ngram) == ("ngram", 4, 2, 3, None, 8)
    draft = _config("--model", model, "--speculative-method", "draft",
                    "--num-speculative-tokens", "2", "--speculative-model", model)
    assert fields(draft) == ("draft", 2, None, None, model, batch)
