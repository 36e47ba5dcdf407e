"""Structured output and allowed tokens: each request's constraint is compiled off the step
loop (xgrammar; its compiler caches grammars by their text), a matcher follows each
request's tokens, and a step's token bitmask is filled on the CPU while its forward runs."""

from __future__ import annotations

import functools
import json
import logging
import re
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch
import xgrammar as xgr

from engine_service.common.sampling_params import SamplingParams
from engine_service.scheduler import ScheduledSeq

logger = logging.getLogger(__name__)

COMPILER_CACHE_BYTES = 256 << 20
# xgrammar prefixes its messages with "[hh:mm:ss] /path/file.cc:123: ".
_SOURCE_PREFIX = re.compile(r"^\[[^\]]*\] \S+:\d+: ")


def choice_grammar(choices: list[str]) -> str:
    """EBNF for "exactly one of these strings": JSON string literals are EBNF literals."""
    return "root ::= " + " | ".join(json.dumps(c) for c in choices)


# "Any JSON object", compact like json_schema outputs.
JSON_OBJECT_SCHEMA = '{"type": "object"}'


def _control_free_lengths(node):
    """The schema with each length-bounded plain string given as a pattern instead: xgrammar
    turns minLength/maxLength into a character class that admits raw control characters,
    which JSON forbids (mlc-ai/xgrammar#800); its pattern path escapes them properly."""
    if isinstance(node, list):
        return [_control_free_lengths(n) for n in node]
    if not isinstance(node, dict):
        return node
    node = {k: _control_free_lengths(v) for k, v in node.items()}
    bounded = "minLength" in node or "maxLength" in node
    if node.get("type") == "string" and bounded and not node.keys() & {"pattern", "format"}:
        lo, hi = node.pop("minLength", 0), node.pop("maxLength", "")
        node["pattern"] = f"^[^\\x00-\\x1f]{{{lo},{hi}}}$"
    return node


def json_schema_text(schema: str) -> str:
    """The schema as this engine compiles it (see _control_free_lengths)."""
    try:
        return json.dumps(_control_free_lengths(json.loads(schema)))
    except (ValueError, RecursionError):
        return schema  # not JSON: xgrammar's parser says why


def _parse(kind: str, value: str | bool | tuple[str, ...]) -> xgr.Grammar:
    if kind == "json_schema":
        return xgr.Grammar.from_json_schema(json_schema_text(value), any_whitespace=False)
    if kind == "regex":
        return xgr.Grammar.from_regex(value)
    if kind == "grammar":
        return xgr.Grammar.from_ebnf(value)
    if kind == "choice":
        return xgr.Grammar.from_ebnf(choice_grammar(list(value)))
    return xgr.Grammar.from_json_schema(JSON_OBJECT_SCHEMA, any_whitespace=False)


def allowed_bitmask(token_ids: list[int], vocab_size: int) -> torch.Tensor:
    """int32 [ceil(vocab_size / 32)]: bit t % 32 of word t // 32 set for each allowed id."""
    words = torch.zeros(-(-vocab_size // 32), dtype=torch.int64)
    for t in set(token_ids):
        words[t >> 5] |= 1 << (t & 31)
    return words.to(torch.int32)  # wraps bit 31 to the sign bit, as xgrammar's masks hold it


class TokenConstraint:
    """One request's limits on its next token: a grammar matcher, allowed ids, or both."""

    __slots__ = ("matcher", "allowed")

    def __init__(self, matcher: xgr.GrammarMatcher | None, allowed: torch.Tensor | None):
        self.matcher = matcher
        self.allowed = allowed  # int32 [W] bitmask

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete and its stop token accepted: nothing may follow."""
        return self.matcher is not None and self.matcher.is_terminated()


class StructuredOutput:
    """The engine's compiler (made on first use, from the model's tokenizer) and bitmasks."""

    def __init__(self, model_dir: str, vocab_size: int, eos_token_ids: list[int],
                 pin_memory: bool) -> None:
        self.model_dir = model_dir
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.pin_memory = pin_memory
        self._compiler: xgr.GrammarCompiler | None = None
        # Parsing a schema takes milliseconds, on the thread that accepts requests; requests
        # usually repeat a few constraints, so parsed ones are kept by their text.
        self._parse = functools.lru_cache(maxsize=256)(_parse)
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="grammar-compile")
        # One thread: filling a row takes microseconds, less than handing it to a pool
        # (more threads filled 256 rows three to four times slower on a 16-core host).
        self._batch = xgr.BatchGrammarMatcher(max_threads=1)
        self.fill_seconds = 0.0  # host time in fill_bitmask, and its calls (benchmarks read)
        self.num_fills = 0

    def check(self, params: SamplingParams) -> xgr.Grammar | None:
        """The request's constraint parsed (cheap: no tokenizer, so it runs before the request
        is accepted), or None. ValueError naming the field and quoting the compiler when it
        does not parse, or when this engine has no tokenizer to compile it with."""
        if params.constraint is None:
            return None
        kind, value = params.constraint
        if not (Path(self.model_dir, "tokenizer.json").exists()
                or Path(self.model_dir, "tokenizer_config.json").exists()):
            raise ValueError(f"{kind} needs the model's tokenizer, which {self.model_dir} lacks")
        try:
            return self._parse(kind, value if isinstance(value, str | bool) else tuple(value))
        except Exception as e:  # xgrammar raises RuntimeError and its own error types
            message = _SOURCE_PREFIX.sub("", str(e)).strip()
            raise ValueError(f"{kind} does not compile: {message}") from None

    def submit(self, params: SamplingParams, grammar: xgr.Grammar | None
               ) -> Future[TokenConstraint]:
        """The request's TokenConstraint (from `check`'s grammar), built on the compile
        thread."""
        return self._executor.submit(self.build, params, grammar)

    def build(self, params: SamplingParams, grammar: xgr.Grammar | None) -> TokenConstraint:
        allowed = (allowed_bitmask(params.allowed_token_ids, self.vocab_size)
                   if params.allowed_token_ids else None)
        if grammar is None:
            return TokenConstraint(None, allowed)
        compiler = self._compiler or self._make_compiler()
        return TokenConstraint(xgr.GrammarMatcher(compiler.compile_grammar(grammar)), allowed)

    def _make_compiler(self) -> xgr.GrammarCompiler:
        from transformers import AutoTokenizer  # slow to import: only once a grammar comes

        tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.vocab_size,
                                                  stop_token_ids=self.eos_token_ids)
        self._compiler = xgr.GrammarCompiler(info, cache_limit_bytes=COMPILER_CACHE_BYTES)
        return self._compiler

    def accept(self, rows: list[tuple[TokenConstraint, int]]) -> list[bool]:
        """Feed each row's sampled token to its matcher, all in one call; rows with allowed
        ids alone accept (the mask already held them to the set)."""
        accepted = [True] * len(rows)
        grammar = [i for i, (c, _) in enumerate(rows) if c.matcher is not None]
        if grammar:
            ok = xgr.BatchGrammarMatcher.batch_accept_token(
                [rows[i][0].matcher for i in grammar], [rows[i][1] for i in grammar])
            for i, a in zip(grammar, ok, strict=True):
                accepted[i] = a
        return accepted

    def fill_bitmask(self, rows: list[ScheduledSeq]) -> torch.Tensor:
        """int32 [len(rows), W] on the host: each row's allowed next tokens, all for rows
        without a constraint. The matchers fill theirs in one xgrammar call."""
        t0 = time.perf_counter()
        bitmask = torch.full((len(rows), -(-self.vocab_size // 32)), -1, dtype=torch.int32,
                             pin_memory=self.pin_memory)
        matchers: list[xgr.GrammarMatcher] = []
        indices: list[int] = []
        allowed: list[tuple[int, torch.Tensor]] = []
        for i, item in enumerate(rows):
            c = item.seq.constraint
            if c is None or item.seq.is_finished:
                continue  # a sequence that ended in the step that just landed
            if c.matcher is not None:
                matchers.append(c.matcher)
                indices.append(i)
            if c.allowed is not None:
                allowed.append((i, c.allowed))
        if matchers:
            self._batch.batch_fill_next_token_bitmask(matchers, bitmask, indices)
        for i, words in allowed:
            bitmask[i] &= words
        self.fill_seconds += time.perf_counter() - t0
        self.num_fills += 1
        return bitmask

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
