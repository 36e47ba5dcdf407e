"""Structured output (json_schema, json_object, regex, choice, grammar), logit_bias and
allowed_token_ids, offline and over gRPC, on a tiny random Qwen3 with a byte-level BPE of a
few thousand merges. A random model writes random but grammatical text: every output that
stops must be in its constraint's language, and most must stop, so no check passes vacuously.
The conftest's autouse kv_blocks_all_free check runs after every test."""

from __future__ import annotations

import json
import random
import re
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import jsonschema
import pytest

from clients import Client
from clients.errors import InvalidArgument
from engine_service import LLM, SamplingParams
from nanoserve.v1 import nanoserve_pb2 as pb
from nanoserve.v1 import nanoserve_pb2_grpc as pb_grpc
from tests.helpers import spy_preemptions
from tests.procs import start_engine, wait_blocks_free

pytestmark = pytest.mark.timeout(180)

VOCAB = 4096
MAX_TOKENS = 200  # every constraint below is bounded; a random model needs ~130 at most
PROMPTS = ["Give me JSON: ", "The weather today", "Once upon a time", "Numbers: 1 2 3 "]

WORDS = ["red", "green", "blue", "fox", "dog", "tea", "cake", "city", "river", "book",
         "north", "south", "yes", "no", "maybe", "alpha", "beta", "gamma"]
KEYS = ["name", "id", "age", "tags", "items", "color", "count", "ok", "meta", "kind",
        "size", "owner", "score", "city", "level", "note"]

REGEXES = [r"\d{3}-\d{4}", r"(cat|dog|bird)s?", r"[a-z]{2,6}@[a-z]{2,5}\.(com|org)",
           r"-?(0|[1-9][0-9]{0,3})\.[0-9]{1,2}", r"(yes|no)( maybe)?", r"[A-Z][a-z ]{0,10}!"]
CHOICES = [["yes", "yes please", "no"], ["red", "green", "blue sky", '{"a": 1}']]
_ITEM = r"([0-9]{1,3}|true|false)"
# GBNF-style grammars, each with a Python regex of the same language.
GRAMMARS = {
    'root ::= greeting " " name ("!" | ".")\n'
    'greeting ::= "hello" | "hi" | "good " ("morning" | "evening")\n'
    'name ::= [A-Z] [a-z]{1,6}\n': r"(hello|hi|good (morning|evening)) [A-Z][a-z]{1,6}[!.]",
    'root ::= "[" item ("," item){0,3} "]"\n'
    'item ::= [0-9]{1,3} | "true" | "false"\n': rf"\[{_ITEM}(,{_ITEM}){{0,3}}\]",
}


# -- schemas and the check of an output ------------------------------------------------------


def leaf_schema(rng: random.Random) -> dict:
    """A bounded string, integer, boolean or enum."""
    kind = rng.randrange(5)
    if kind == 0:
        lo = rng.randint(0, 3)
        return {"type": "string", "minLength": lo, "maxLength": lo + rng.randint(1, 8)}
    if kind == 1:
        lo = rng.randint(-50, 50)
        return {"type": "integer", "minimum": lo, "maximum": lo + rng.randint(0, 500)}
    if kind == 2:
        return {"type": "boolean"}
    if kind == 3:
        return {"enum": rng.sample(WORDS, rng.randint(1, 4))}
    return {"enum": [rng.choice(WORDS), rng.randint(-9, 99), True, None][:rng.randint(2, 4)]}


def random_schema(rng: random.Random, depth: int = 0) -> dict:
    """An object (at the root mostly) or array, nested up to depth 2, every part bounded so
    that a random model finishes it."""
    kind = rng.randrange(4) if depth < 2 else 0
    if kind == 0 and depth > 0:
        return leaf_schema(rng)
    if kind == 1:
        lo = rng.randint(0, 2)
        return {"type": "array", "items": random_schema(rng, depth + 1), "minItems": lo,
                "maxItems": lo + rng.randint(0, 2)}
    keys = rng.sample(KEYS, rng.randint(1, 4))
    return {"type": "object", "properties": {k: random_schema(rng, depth + 1) for k in keys},
            "required": [k for k in keys if rng.random() < 0.6],
            "additionalProperties": False}


def generated_schemas(n: int = 36, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    return [random_schema(rng) for _ in range(n)]


_JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')


def language_error(kw: dict, text: str) -> str | None:
    """Why `text` is outside the language of the constraint in sampling keywords `kw`; None
    when it is inside. Strict json.loads: raw control characters in a string are not JSON.
    JSON is compact: no whitespace outside strings but the ", " and ": " separators."""
    try:
        if "json_schema" in kw or kw.get("json_object"):
            value = json.loads(text)
            bare = _JSON_STRING.sub('""', text).replace(", ", ",").replace(": ", ":")
            assert not re.search(r"\s", bare), "free whitespace"
        if "json_schema" in kw:
            jsonschema.validate(value, json.loads(kw["json_schema"]))
        elif kw.get("json_object"):
            assert isinstance(value, dict), "not a JSON object"
        elif "regex" in kw:
            assert re.fullmatch(kw["regex"], text), "no full match"
        elif "choice" in kw:
            assert text in kw["choice"], "not one of the choices"
        else:
            assert re.fullmatch(GRAMMARS[kw["grammar"]], text), "not in the grammar"
    except (AssertionError, ValueError, jsonschema.ValidationError) as e:
        return f"{text!r}: {type(e).__name__}: {str(e).splitlines()[0]}"
    return None


def constrained_cases(json_object_bias: dict[int, float], seed: int = 0) -> list[dict]:
    """Sampling keywords: every generated schema, regex, choice list and grammar, and
    json_object; temperatures 1.0, 0.7 and greedy in turn, each with its own seed."""
    constraints = ([{"json_schema": json.dumps(s)} for s in generated_schemas()]
                   + [{"regex": r} for r in REGEXES] + [{"choice": c} for c in CHOICES]
                   + [{"grammar": g} for g in GRAMMARS] * 2
                   # A random model rarely closes free-form JSON: a bias on '"' and '}'
                   # makes it close strings and objects sooner (and mixes bias with a mask).
                   + [{"json_object": True, "logit_bias": json_object_bias}] * 3)
    return [{**c, "temperature": (1.0, 0.7, 0.0)[i % 3], "seed": seed + i,
             "max_tokens": MAX_TOKENS} for i, c in enumerate(constraints)]


def check_outputs(cases: list[dict], outs: list, eos_ids: list[int]) -> list[str]:
    """Every output that stopped is complete and in its language; returns its problems."""
    problems = []
    for kw, out in zip(cases, outs, strict=True):
        assert out.finish_reason in ("stop", "length"), out.finish_reason
        if out.finish_reason == "stop":
            if out.token_ids[-1] not in eos_ids:
                problems.append(f"{kw}: stopped on {out.token_ids[-1]}, not on eos")
            elif (err := language_error(kw, out.text)) is not None:
                problems.append(f"{json.dumps(kw)[:300]} -> {err}")
    return problems


# -- fixtures --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    from models.tiny_model import make_tiny_model
    from tests.tiny_checkpoints import json_tokenizer

    return make_tiny_model(tmp_path_factory.mktemp("so-model"), seed=0,
                           tokenizer=json_tokenizer(VOCAB))


@pytest.fixture(scope="module")
def token_id(model_dir):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(model_dir / "tokenizer.json")).token_to_id


@pytest.fixture(scope="module")
def cases(token_id) -> list[dict]:
    return constrained_cases({token_id('"'): 5.0, token_id("}"): 5.0})


@pytest.fixture(scope="module")
def llm(model_dir) -> LLM:
    return LLM(str(model_dir), device="cpu", dtype="float32", num_kv_blocks=512,
               kv_block_size=16, max_model_len=512)


@pytest.fixture(scope="module")
def engine(model_dir):
    proc = start_engine(model_dir, "--kv-block-size", "4", "--max-model-len", "512")
    yield proc
    assert proc.stop() == 0, proc.output()[-3000:]


@pytest.fixture(scope="module")
def client(engine):
    with Client(engine.target, timeout=60) as c:
        yield c


def pick(cases: list[dict], **counts: int) -> list[dict]:
    """The first counts[kind] cases of each constraint kind."""
    return [kw for kind, n in counts.items() for kw in [c for c in cases if kind in c][:n]]


def generate(llm: LLM, cases: list[dict], first_prompt: int = 0) -> list:
    prompts = [PROMPTS[(first_prompt + i) % len(PROMPTS)] for i in range(len(cases))]
    return llm.generate(prompts, [SamplingParams(**kw) for kw in cases], use_tqdm=False)


# -- offline ---------------------------------------------------------------------------------


def test_tokenizer_has_thousands_of_merges_and_json_tokens(model_dir, token_id):
    tok = json.loads((model_dir / "tokenizer.json").read_text())
    assert len(tok["model"]["merges"]) >= 3000
    assert json.loads((model_dir / "config.json").read_text())["vocab_size"] == VOCAB
    assert all(token_id(t) is not None for t in ('":"', '","', '"}', "true", "false"))


def test_schema_generator_covers_the_issue_list():
    text = json.dumps(generated_schemas())
    for word in ('"object"', '"array"', '"enum"', '"string"', '"integer"', '"boolean"',
                 "minItems", "maxItems", "maxLength", "minimum", '"required": ["'):
        assert word in text, word
    nested = [s for s in generated_schemas() if any(
        p.get("type") in ("object", "array") for p in s.get("properties", {}).values())]
    assert len(nested) >= 10


def test_outputs_that_stop_are_in_their_language(llm, cases):
    outs = generate(llm, cases)
    problems = check_outputs(cases, outs, llm.engine.eos_token_ids)
    assert not problems, "\n".join(problems)
    stopped = Counter(next(iter(kw)) for kw, o in zip(cases, outs, strict=True)
                      if o.finish_reason == "stop")
    total = Counter(next(iter(kw)) for kw in cases)
    assert stopped["json_schema"] >= 0.9 * total["json_schema"], (stopped, total)
    assert sum(stopped.values()) >= 0.9 * len(cases), (stopped, total)
    assert min(stopped[k] for k in total) >= 1, (stopped, total)


def test_preemption_keeps_outputs_in_language_and_tokens_seeded(model_dir, cases):
    """8 requests of tens of tokens each in 24 blocks of 4 tokens preempt each other; each
    request's tokens equal those it gets alone (draws depend on seed and position only)."""
    small = LLM(str(model_dir), device="cpu", dtype="float32", num_kv_blocks=24,
                kv_block_size=4, max_model_len=96)
    chosen = [{**kw, "max_tokens": 88}
              for kw in pick(cases, json_schema=6, regex=1, grammar=1)]
    preempted = spy_preemptions(small)
    outs = generate(small, chosen)
    assert preempted, "the KV budget was meant to force preemption"
    problems = check_outputs(chosen, outs, small.engine.eos_token_ids)
    assert not problems, "\n".join(problems)
    assert sum(o.finish_reason == "stop" for o in outs) >= len(outs) // 2
    for i, (kw, out) in enumerate(zip(chosen, outs, strict=True)):
        alone = generate(small, [kw], first_prompt=i)[0]
        assert alone.token_ids == out.token_ids, (kw, alone.text, out.text)


def test_json_object_is_a_compact_object_whatever_the_model_prefers(llm, token_id):
    """The model is pushed to open an array or write whitespace: neither is allowed."""
    push = {token_id(t): 100.0 for t in ("[", "Ġ", "ĠĠ", "Ċ", "ĉ")}
    outs = llm.generate(PROMPTS, [SamplingParams(json_object=True, logit_bias=push,
                                                 max_tokens=4, temperature=t, seed=1)
                                  for t in (0.0, 1.0, 0.0, 1.0)], use_tqdm=False)
    for out in outs:
        assert re.match(r'\{["}]', out.text), repr(out.text)


BAD_CONSTRAINTS = [
    ("json_schema", '{"type": "strin"}', 'Unsupported type "strin"'),
    ("regex", "(abc", "parenthesis is not closed"),
    ("grammar", 'root ::= "a" undefined_rule', 'Rule "undefined_rule" is not defined'),
]


@pytest.mark.parametrize(("field", "value", "message"), BAD_CONSTRAINTS)
def test_bad_constraint_is_an_error_naming_field_and_harms_no_other(llm, cases, field,
                                                                     value, message):
    good = pick(cases, json_schema=1, regex=1, choice=1, grammar=1)
    before = generate(llm, good)
    bad = {field: value, "max_tokens": 8}
    with pytest.raises(ValueError, match=field) as err:
        generate(llm, good[:2] + [bad] + good[2:])
    assert message in str(err.value)
    assert not llm.engine.has_unfinished()
    after = generate(llm, good)
    assert [o.token_ids for o in after] == [o.token_ids for o in before]


def test_two_constraints_is_an_error_naming_constraint(client):
    with pytest.raises(ValueError, match="constraint"):
        SamplingParams(json_schema='{"type": "object"}', regex="a+")
    with pytest.raises(ValueError, match="constraint"):
        client.generate("hi", json_object=True, choice=["a", "b"])


def test_logit_bias_forces_and_bans_tokens_and_allowed_ids_restrict(llm):
    prompt = "The weather today"
    greedy = dict(max_tokens=12, ignore_eos=True, temperature=0.0)
    sampled = dict(max_tokens=12, ignore_eos=True, temperature=1.0, seed=3)
    base = llm.generate(prompt, SamplingParams(**greedy), use_tqdm=False)[0].token_ids
    forced = next(t for t in range(1000, VOCAB) if t not in base)
    banned = Counter(base).most_common(1)[0][0]
    allowed = [forced, banned, 7, 300, 2500]
    controls = [{"logit_bias": {forced: 100}}, {"logit_bias": {banned: -100}},
                {"allowed_token_ids": allowed}]
    params = [SamplingParams(**c, **kw) for c in controls for kw in (greedy, sampled)]
    f_greedy, f_sampled, b_greedy, b_sampled, a_greedy, a_sampled = (
        o.token_ids for o in llm.generate([prompt] * 6, params, use_tqdm=False))
    assert f_greedy == f_sampled == [forced] * 12
    for ids in (b_greedy, b_sampled):
        assert len(ids) == 12 and banned not in ids, ids
    for ids in (a_greedy, a_sampled):
        assert ids and set(ids) <= set(allowed), ids
    for field, kw in (("logit_bias", {"logit_bias": {VOCAB + 5: 1.0}}),
                      ("allowed_token_ids", {"allowed_token_ids": [3, VOCAB]})):
        with pytest.raises(ValueError, match=field):
            llm.generate([prompt, prompt], [SamplingParams(**greedy),
                                            SamplingParams(**kw, **greedy)], use_tqdm=False)
        assert not llm.engine.has_unfinished()


# -- over gRPC -------------------------------------------------------------------------------


def test_stream_deltas_equal_unary_text(client, cases):
    chosen = pick(cases, json_schema=3, regex=1, choice=1, grammar=1, json_object=1)
    requests = [(PROMPTS[i % len(PROMPTS)], kw) for i, kw in enumerate(chosen)]
    with ThreadPoolExecutor(2 * len(chosen)) as pool:  # all at once: the engine batches them
        wholes = [pool.submit(client.generate, p, **kw) for p, kw in requests]
        streams = [pool.submit(list, client.stream(p, **kw)) for p, kw in requests]
    for kw, whole_f, chunks_f in zip(chosen, wholes, streams, strict=True):
        whole, chunks = whole_f.result(), chunks_f.result()
        assert "".join(c.text for c in chunks) == whole.text, kw
        assert [t for c in chunks for t in c.token_ids] == whole.token_ids
        assert chunks[-1].finish_reason == whole.finish_reason
        if whole.finish_reason == "stop":
            assert language_error(kw, whole.text) is None, (kw, language_error(kw, whole.text))
    assert wait_blocks_free(client).kv_blocks_used == 0


def test_bad_constraints_in_flight_harm_no_other_stream(engine, client, cases):
    good = pick(cases, json_schema=3, regex=1, grammar=1)
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(good))]
    streams = [client.stream(p, **kw) for p, kw in zip(prompts, good, strict=True)]
    firsts = [next(s) for s in streams]  # every good request is running now
    for field, value, message in BAD_CONSTRAINTS:
        with pytest.raises(InvalidArgument, match=field) as err:
            client.generate("hi", **{field: value}, max_tokens=8)
        assert message in err.value.details
    stub = pb_grpc.GenerationStub(grpc.insecure_channel(engine.target))
    with pytest.raises(grpc.RpcError) as raw:  # under the client's own checks
        stub.Generate(pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(regex="(abc")))
    assert raw.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert raw.value.details().startswith("regex")
    for p, kw, first, stream in zip(prompts, good, firsts, streams, strict=True):
        chunks = [first, *stream]
        text = "".join(c.text for c in chunks)
        assert chunks[-1].finish_reason in ("stop", "length")
        if chunks[-1].finish_reason == "stop":
            assert language_error(kw, text) is None, (kw, language_error(kw, text))
        assert [t for c in chunks for t in c.token_ids] == client.generate(p, **kw).token_ids
    assert wait_blocks_free(client).kv_blocks_used == 0


def test_logit_bias_and_allowed_ids_over_grpc(client):
    forced = client.generate("hi", temperature=1.0, seed=1, max_tokens=6, ignore_eos=True,
                             logit_bias={1234: 100.0})
    assert forced.token_ids == [1234] * 6
    allowed = client.generate("hi", temperature=1.0, seed=1, max_tokens=6, ignore_eos=True,
                              allowed_token_ids=[5, 50, 500])
    assert allowed.token_ids and set(allowed.token_ids) <= {5, 50, 500}
    for field, kw in (("logit_bias", {"logit_bias": {VOCAB: 1.0}}),
                      ("allowed_token_ids", {"allowed_token_ids": [VOCAB + 1]})):
        with pytest.raises(InvalidArgument, match=field):
            client.generate("hi", max_tokens=4, **kw)


def test_cancel_constrained_stream_frees_blocks(client):
    # 200 bounded integers: hundreds of tokens, so the stream is cancelled mid-way.
    long_schema = json.dumps({"type": "array", "minItems": 200, "maxItems": 200,
                              "items": {"type": "integer", "minimum": 0, "maximum": 9}})
    it = client.stream("Numbers: ", json_schema=long_schema, temperature=1.0, seed=2,
                       max_tokens=500)
    first = next(it)
    assert first.token_ids and first.finish_reason is None
    it.close()  # cancels the RPC
    assert wait_blocks_free(client).kv_blocks_used == 0
    after = client.generate("Numbers: ", choice=["yes", "no"], temperature=1.0, seed=2)
    assert after.finish_reason == "stop" and after.text in ("yes", "no")
    assert wait_blocks_free(client).kv_blocks_used == 0
