"""The OpenAI API in nanoserve's own terms: the request models, the one mapping of an OpenAI
request to pb.GenerateRequests, and pb.GenerateChunks back to OpenAI responses and SSE chunks.

Values are checked where the gRPC path checks them (SamplingParams, the servicers), so an HTTP
client reads the same words as a gRPC one; this module checks only what gRPC cannot carry
(n, content parts, logit_bias keys, numbers outside the proto's integer types) and refuses
the OpenAI fields nanoserve cannot honour (echo, best_of, suffix). Structured output comes
from OpenAI's response_format or vLLM's structured_outputs and guided_* fields. Unknown
fields are accepted and ignored, as vLLM does (gateways add their own). nanoserve's own extra
field `diffusion` (DiffusionParams' fields) sets how an engine serving a diffusion model
(LLaDA, Dream) decodes; that engine refuses the autoregressive-only fields, naming them."""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from engine_service.common.proto_convert import (
    diffusion_params_to_proto,
    sampling_params_to_proto,
)
from engine_service.common.sampling_params import CONSTRAINTS, SamplingParams, check_field
from nanoserve.v1 import nanoserve_pb2 as pb

if TYPE_CHECKING:
    from engine_service.common.tokenizer import Tokenizer

log = logging.getLogger("nanoserve.http")

MAX_CHOICES = 1024  # prompts x n of one request: each one is a request in an engine
FINISH_REASONS = {pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_LENGTH: "length",
                  pb.FINISH_REASON_ABORT: "abort"}
_SAMPLING_FIELDS = ("max_tokens", "min_tokens", "temperature", "top_p", "top_k", "min_p", "seed",
                    "repetition_penalty", "presence_penalty", "frequency_penalty", "stop",
                    "stop_token_ids", "ignore_eos", "skip_special_tokens", "allowed_token_ids")
DONE_EVENT = b"data: [DONE]\n\n"


@dataclass(frozen=True)
class ModelCard:
    """The served model as the HTTP front shows it."""

    name: str
    max_model_len: int
    vocab_size: int
    is_diffusion: bool = False  # a diffusion model: no max_tokens of its own (gen_length)


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


class StreamOptions(_Open):
    include_usage: bool = False


class ContentPart(_Open):
    type: str
    text: str = ""


class Message(_Open):
    role: str
    content: str | list[ContentPart] | None = None


class JsonSchemaFormat(_Open):
    schema_: dict[str, Any] | None = Field(None, alias="schema")


class ResponseFormat(_Open):
    type: str
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(_Open):
    """vLLM's structured_outputs: one of these."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class _Request(_Open):
    model: str | None = None
    max_tokens: int | None = None
    min_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    logit_bias: dict[str, float] | None = None  # token id (a string, as JSON keys are) -> bias
    allowed_token_ids: list[int] | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None  # vLLM's older spellings
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    n: int = 1
    priority: int = 0  # vLLM's extra field: lower runs earlier (--scheduling-policy priority)
    user: str | None = None  # accepted; nothing is done with it
    stream: bool = False
    stream_options: StreamOptions | None = None
    return_token_ids: bool | None = None  # vLLM's: each choice carries its new token ids
    diffusion: dict[str, Any] | None = None  # DiffusionParams' fields (diffusion models)

    @field_validator("n", "stream", "logprobs", "priority", mode="before", check_fields=False)
    @classmethod
    def _null_is_default(cls, value: Any, info: ValidationInfo) -> Any:
        """Clients that send null for a field mean its default."""
        return cls.model_fields[info.field_name].default if value is None else value


class CompletionRequest(_Request):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None  # top-n alternatives per token
    echo: bool | None = None  # refused when true, as are best_of and suffix: not supported
    best_of: int | None = None
    suffix: str | None = None


class ChatRequest(_Request):
    messages: list[Message]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None


# ---- OpenAI request -> GenerateRequests ----------------------------------------------------


def _sampling_kwargs(req: _Request, card: ModelCard) -> dict[str, Any]:
    kwargs = {name: value for name in _SAMPLING_FIELDS
              if (value := getattr(req, name)) is not None}
    if isinstance(req.stop, str):
        kwargs["stop"] = [req.stop]
    if isinstance(req, ChatRequest):
        if req.max_completion_tokens is not None:
            kwargs["max_tokens"] = req.max_completion_tokens
        # As in OpenAI and vLLM, a chat answer may run to the end of the context (a diffusion
        # model's length is its gen_length, and max_tokens does not apply to it).
        if not card.is_diffusion:
            kwargs.setdefault("max_tokens", card.max_model_len)
        check_field(req.logprobs or req.top_logprobs is None, "top_logprobs",
                    "set only with logprobs: true", req.top_logprobs)
        if req.logprobs:
            kwargs["logprobs"] = req.top_logprobs or 0
    else:
        _check_supported(req)
        if req.logprobs is not None:
            kwargs["logprobs"] = req.logprobs
    if req.logit_bias is not None:
        bad = [t for t in req.logit_bias if not t.strip().removeprefix("-").isdecimal()]
        check_field(not bad, "logit_bias", "an object keyed by token ids (integers)", bad[:5])
        kwargs["logit_bias"] = {int(t): bias for t, bias in req.logit_bias.items()}
    given = _constraints(req)
    kinds = [kind for kind, _ in given]  # two different kinds: SamplingParams refuses them
    check_field(len(set(kinds)) == len(kinds), "constraint",
                f"at most one of {', '.join(CONSTRAINTS)}", kinds)
    kwargs.update(given)
    return kwargs


def _check_supported(req: CompletionRequest) -> None:
    """Refused rather than ignored: each would change the answer the client expects."""
    check_field(not req.echo, "echo", "false (echoing the prompt is not supported)", req.echo)
    check_field(req.best_of in (None, 1, req.n), "best_of",
                f"null, 1 or n = {req.n} (ranking extra choices is not supported)", req.best_of)
    check_field(not req.suffix, "suffix", "null (text after the completion is not supported)",
                req.suffix)


def _constraints(req: _Request) -> list[tuple[str, Any]]:
    """(SamplingParams field, value) of every structured-output constraint the request
    names: OpenAI's response_format, vLLM's structured_outputs and guided_* fields."""
    given: list[tuple[str, Any]] = []
    if (fmt := req.response_format) is not None:
        check_field(fmt.type in ("text", "json_object", "json_schema"), "response_format.type",
                    "text, json_object or json_schema", fmt.type)
        if fmt.type == "json_object":
            given.append(("json_object", True))
        elif fmt.type == "json_schema":
            schema = fmt.json_schema.schema_ if fmt.json_schema else None
            check_field(schema is not None, "response_format.json_schema.schema",
                        "a JSON schema (an object)", schema)
            given.append(("json_schema", schema))
    so = req.structured_outputs or StructuredOutputs()
    given += [(kind, value) for kind, value in (
        ("json_schema", req.guided_json), ("regex", req.guided_regex),
        ("choice", req.guided_choice), ("grammar", req.guided_grammar),
        ("json_schema", so.json_), ("regex", so.regex), ("choice", so.choice),
        ("grammar", so.grammar), ("json_object", so.json_object or None)) if value is not None]
    return [(kind, json.dumps(v) if kind == "json_schema" and not isinstance(v, str) else v)
            for kind, v in given]


def _prompts(req: CompletionRequest, card: ModelCard) -> list[str | list[int]]:
    prompt = req.prompt
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        return [[]]  # the servicer refuses it, in its words
    prompts = list(prompt) if isinstance(prompt[0], (str, list)) else [prompt]
    bad = [t for p in prompts if isinstance(p, list) for t in p if not 0 <= t < 2**32]
    check_field(not bad, "prompt_token_ids", f"ids in [0, {card.vocab_size})", bad[:5])
    return prompts


def _chat_messages(messages: list[Message]) -> pb.ChatMessages:
    out = pb.ChatMessages()
    for i, m in enumerate(messages):
        content = m.content
        if isinstance(content, list):
            kinds = [p.type for p in content]
            check_field(all(k == "text" for k in kinds), f"messages[{i}].content",
                        "a string or a list of text parts", kinds)
            content = "".join(p.text for p in content)
        out.messages.add(role=m.role, content=content or "")
    return out


def generate_requests(req: CompletionRequest | ChatRequest, card: ModelCard,
                      request_id: str) -> list[pb.GenerateRequest]:
    """One GenerateRequest per prompt and choice: choice j of prompt p has index p * n + j and
    request_id f"{request_id}-{index}"; sampled choices of a seeded request get seed + j.
    ValueError names what is wrong, in the gRPC path's words where it checks the same."""
    if req.model_extra:
        log.debug("ignored request fields: %s", ", ".join(sorted(req.model_extra)))
    kwargs = _sampling_kwargs(req, card)
    params = SamplingParams(**kwargs)  # the one value check, raised here in its words
    chat = isinstance(req, ChatRequest)
    prompts = [_chat_messages(req.messages)] if chat else _prompts(req, card)
    check_field(req.n >= 1 and len(prompts) * req.n <= MAX_CHOICES, "n",
                f">= 1, with n x prompts at most {MAX_CHOICES}", req.n)
    check_field(-2**31 <= req.priority < 2**31, "priority", "an int32", req.priority)
    sampling = sampling_params_to_proto(kwargs)
    diffusion = None if req.diffusion is None else diffusion_params_to_proto(req.diffusion)
    requests = []
    for p, prompt in enumerate(prompts):
        for j in range(req.n):
            request = pb.GenerateRequest(request_id=f"{request_id}-{p * req.n + j}",
                                         sampling=sampling, priority=req.priority,
                                         diffusion=diffusion)
            if isinstance(prompt, pb.ChatMessages):
                request.messages.CopyFrom(prompt)
            elif isinstance(prompt, str):
                request.text = prompt
            else:
                request.token_ids.ids.extend(prompt)
            if params.seed is not None and params.temperature != 0:
                request.sampling.seed = (params.seed + j) % 2**63
            requests.append(request)
    return requests


# ---- GenerateChunks -> OpenAI responses ------------------------------------------------------


def sse_event(payload: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"


class ResponseBuilder:
    """The OpenAI JSON of one HTTP request's choices: whole (`response`) or as SSE events
    (`sse_start`, `sse_chunk` per GenerateChunk, `sse_end`)."""

    def __init__(self, req: CompletionRequest | ChatRequest, model: str,
                 tokenizer: Tokenizer | None) -> None:
        self.chat = isinstance(req, ChatRequest)
        self.id = f"{'chatcmpl' if self.chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = model
        self.n = req.n
        self.logprobs = bool(req.logprobs) if self.chat else req.logprobs is not None
        self.include_usage = bool(req.stream_options and req.stream_options.include_usage)
        self.return_token_ids = bool(req.return_token_ids)
        self.tokenizer = tokenizer
        self.usages: dict[int, pb.Usage] = {}  # choice -> its usage, once it finished
        self._offsets: dict[int, int] = {}  # choice -> text length so far (text_offset)

    def response(self, outs: Sequence[pb.GenerateResponse]) -> dict[str, Any]:
        choices = [self._choice(i, o.text, o.logprobs, o.finish_reason, o.stop_reason, False,
                                o.token_ids) for i, o in enumerate(outs)]
        return {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": choices,
                "usage": self.usage({i: o.usage for i, o in enumerate(outs)})}

    def sse_start(self, num_choices: int) -> list[bytes]:
        """Chat streams open every choice with the assistant's role."""
        if not self.chat:
            return []
        return [self._event([{"index": i, "delta": {"role": "assistant", "content": ""},
                              "logprobs": None, "finish_reason": None}])
                for i in range(num_choices)]

    def sse_chunk(self, index: int, chunk: pb.GenerateChunk) -> bytes:
        if chunk.finish_reason:
            self.usages[index] = chunk.usage
        return self._event([self._choice(index, chunk.text, chunk.logprobs, chunk.finish_reason,
                                         chunk.stop_reason, True, chunk.token_ids)])

    def sse_end(self) -> list[bytes]:
        usage = [self._event([], self.usage(self.usages))] if self.include_usage else []
        return [*usage, DONE_EVENT]

    def usage(self, usages: dict[int, pb.Usage]) -> dict[str, Any]:
        """Completion tokens of every choice; prompt (and cached) tokens once per prompt."""
        per_prompt: dict[int, pb.Usage] = {}
        for index in sorted(usages):
            per_prompt.setdefault(index // self.n, usages[index])
        prompt = sum(u.prompt_tokens for u in per_prompt.values())
        completion = sum(u.completion_tokens for u in usages.values())
        cached = sum(u.cached_prompt_tokens for u in per_prompt.values())
        return {"prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": cached}}

    def _event(self, choices: list[dict[str, Any]],
               usage: dict[str, Any] | None = None) -> bytes:
        payload = {"id": self.id, "object": "chat.completion.chunk" if self.chat
                   else "text_completion", "created": self.created, "model": self.model,
                   "choices": choices}
        if self.include_usage:
            payload["usage"] = usage
        return sse_event(payload)

    def _choice(self, index: int, text: str, logprobs: Sequence[pb.TokenLogprob],
                finish_reason: int, stop_reason: str, delta: bool,
                token_ids: Sequence[int] = ()) -> dict[str, Any]:
        if not self.chat:
            body: dict[str, Any] = {"text": text}
        elif delta:
            body = {"delta": {"content": text}}
        else:
            body = {"message": {"role": "assistant", "content": text}}
        return {"index": index, **body,
                "logprobs": self._logprobs(index, logprobs) if self.logprobs else None,
                "finish_reason": FINISH_REASONS.get(finish_reason),
                "stop_reason": stop_reason or None,
                **({"token_ids": list(token_ids)} if self.return_token_ids else {})}

    def _token(self, token_id: int) -> str:
        if self.tokenizer is None:  # vLLM's spelling for tokens it cannot show as text
            return f"token_id:{token_id}"
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def _logprobs(self, index: int, entries: Sequence[pb.TokenLogprob]) -> dict[str, Any]:
        tokens = [self._token(e.token_id) for e in entries]
        tops = [[(self._token(t), lp) for t, lp in zip(e.top_token_ids, e.top_logprobs,
                                                        strict=False)] for e in entries]
        if self.chat:
            return {"content": [
                {"token": tok, "logprob": e.logprob, "bytes": list(tok.encode()),
                 "top_logprobs": [{"token": t, "logprob": lp, "bytes": list(t.encode())}
                                  for t, lp in top]}
                for tok, e, top in zip(tokens, entries, tops, strict=True)]}
        offsets, at = [], self._offsets.get(index, 0)
        for tok in tokens:
            offsets.append(at)
            at += len(tok)
        self._offsets[index] = at
        return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries],
                "top_logprobs": [dict(top) for top in tops], "text_offset": offsets}
