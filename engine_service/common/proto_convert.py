"""Protobuf <-> engine dataclasses: the one place the wire format is converted."""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import struct
from collections.abc import AsyncIterator, Mapping
from typing import Any

import grpc
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import DecodeError

from engine_service.common.sampling_params import (
    DiffusionParams,
    SamplingParams,
    check_field,
    check_prompt_len,
    quote,
)
from nanoserve.v1 import nanoserve_pb2 as pb

FINISH_REASONS = {
    None: pb.FINISH_REASON_UNSPECIFIED,
    "stop": pb.FINISH_REASON_STOP,
    "length": pb.FINISH_REASON_LENGTH,
    "abort": pb.FINISH_REASON_ABORT,
}
_OPTIONAL_FIELDS = ("max_tokens", "min_tokens", "temperature", "top_p", "top_k", "min_p", "seed",
                    "repetition_penalty", "presence_penalty", "frequency_penalty", "logprobs",
                    "skip_special_tokens")
_FLOAT_FIELDS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                 "frequency_penalty")
# A text prompt's bytes per token of max_model_len beyond which it cannot fit (real text
# averages ~4 bytes a token).
MAX_PROMPT_BYTES_PER_TOKEN = 32
# The largest request (gRPC message, HTTP body) a router or engine reads: a 2M-token context's
# text prompt at MAX_PROMPT_BYTES_PER_TOKEN. Prompts are checked against the model's own limit.
MAX_REQUEST_BYTES = 64 << 20
DEADLINE_SLACK_S = 0.1  # seconds; see cancel_code


def float32_to_decimal(x: float) -> float:
    """The shortest decimal that is the same float32: the value the client wrote (0.9 arrives
    as 0.8999999761..., 4e-7 as 4.0000000467e-07), small values kept. 9 digits always do."""
    for digits in range(1, 10):
        y = float(f"{x:.{digits}g}")
        if struct.unpack("f", struct.pack("f", y))[0] == x:
            return y
    return x  # NaN, which validation refuses


def diffusion_params_from_proto(msg: pb.DiffusionParams) -> DiffusionParams:
    """Unset fields keep DiffusionParams' defaults; values are checked there."""
    kwargs = {f.name: getattr(msg, f.name) for f in msg.DESCRIPTOR.fields
              if msg.HasField(f.name)}
    for name in ("temperature", "cfg_scale", "confidence_threshold", "retention_ratio"):
        if name in kwargs:
            kwargs[name] = float32_to_decimal(kwargs[name])
    return DiffusionParams(**kwargs)


def sampling_params_from_request(request: pb.GenerateRequest) -> SamplingParams:
    """The request's SamplingParams, its DiffusionParams included when set."""
    params = sampling_params_from_proto(request.sampling)
    if request.HasField("diffusion"):
        params.diffusion = diffusion_params_from_proto(request.diffusion)
    return params


def sampling_params_from_proto(msg: pb.SamplingParams) -> SamplingParams:
    """Unset optional fields keep SamplingParams' defaults; values are checked there."""
    kwargs = {name: getattr(msg, name) for name in _OPTIONAL_FIELDS if msg.HasField(name)}
    for name in _FLOAT_FIELDS:
        if name in kwargs:
            kwargs[name] = float32_to_decimal(kwargs[name])
    if msg.logit_bias:
        kwargs["logit_bias"] = {t: float32_to_decimal(b) for t, b in msg.logit_bias.items()}
    if msg.allowed_token_ids:
        kwargs["allowed_token_ids"] = list(msg.allowed_token_ids)
    kind = msg.WhichOneof("constraint")
    if kind == "choice":
        kwargs["choice"] = list(msg.choice.choices)
    elif kind is not None:
        kwargs[kind] = getattr(msg, kind)
    return SamplingParams(stop=list(msg.stop), stop_token_ids=list(msg.stop_token_ids),
                          ignore_eos=msg.ignore_eos, **kwargs)


def _is_repeated(f) -> bool:
    # protobuf 7 dropped FieldDescriptor.label; versions before 5.x lack is_repeated
    is_repeated = getattr(f, "is_repeated", None)
    return bool(is_repeated) if is_repeated is not None else f.label == f.LABEL_REPEATED


SAMPLING_FIELDS = frozenset(pb.SamplingParams.DESCRIPTOR.fields_by_name)
_REPEATED_FIELDS = frozenset(f.name for f in pb.SamplingParams.DESCRIPTOR.fields
                             if _is_repeated(f) and f.name != "logit_bias")


def sampling_params_to_proto(sampling: dict) -> pb.SamplingParams:
    """pb.SamplingParams from SamplingParams field values (None = unset); `stop` and `choice`
    may be one string. ValueError or TypeError names the field when the proto cannot hold a
    value (a negative max_tokens, say)."""
    msg = pb.SamplingParams()
    for name, value in sampling.items():
        if value is None:
            continue
        try:
            if name == "choice":
                msg.choice.choices.extend([value] if isinstance(value, str) else value)
            elif name == "logit_bias":
                msg.logit_bias.update({int(t): b for t, b in value.items()})
            elif name in _REPEATED_FIELDS:
                getattr(msg, name).extend([value] if isinstance(value, str) else list(value))
            else:
                setattr(msg, name, value)
        except (TypeError, ValueError, AttributeError) as e:
            raise ValueError(f"sampling parameter {name}={quote(value)}: {e}") from None
    return msg


DIFFUSION_FIELDS = tuple(pb.DiffusionParams.DESCRIPTOR.fields_by_name)
_PROTO_KINDS = {FieldDescriptor.TYPE_UINT32: "an integer in [0, 2**32)",
                FieldDescriptor.TYPE_FLOAT: "a number", FieldDescriptor.TYPE_STRING: "a string"}


def diffusion_params_to_proto(diffusion: DiffusionParams | Mapping[str, Any]
                              ) -> pb.DiffusionParams:
    """pb.DiffusionParams from a DiffusionParams or some of its field values (None or absent:
    the default), checked as the engines check them. ValueError names the field: unknown,
    of the wrong type, or out of range."""
    if isinstance(diffusion, DiffusionParams):  # its defaults are the engines' too: unsent
        values = {f.name: v for f in dataclasses.fields(diffusion)
                  if (v := getattr(diffusion, f.name)) != f.default}
    else:
        check_field(isinstance(diffusion, Mapping), "diffusion",
                    "DiffusionParams or a mapping of its fields", type(diffusion).__name__)
        values = dict(diffusion)
    values = {name: value for name, value in values.items() if value is not None}
    unknown = sorted(set(values) - set(DIFFUSION_FIELDS))
    check_field(not unknown, "diffusion", f"an object of {', '.join(DIFFUSION_FIELDS)}",
                unknown)
    # The engines' value check first, in their words; the wrong types fail it with a
    # TypeError that names no field, so the proto below names them.
    with contextlib.suppress(TypeError):
        DiffusionParams(**values)
    msg = pb.DiffusionParams()
    for name, value in values.items():
        try:
            setattr(msg, name, value)
        except (TypeError, ValueError):
            kind = _PROTO_KINDS.get(msg.DESCRIPTOR.fields_by_name[name].type, "a valid value")
            raise ValueError(f"{name} must be {kind}, got {quote(value)}") from None
    return msg


def check_prompt_bytes(request: pb.GenerateRequest, max_model_len: int) -> None:
    """ValueError when a text or chat prompt has more bytes than max_model_len tokens could
    hold (MAX_PROMPT_BYTES_PER_TOKEN each), or token ids are more than it holds: checked
    before tokenizing or copying the ids, so a huge prompt costs no time."""
    kind = request.WhichOneof("prompt")
    if kind == "token_ids":
        check_prompt_len(len(request.token_ids.ids), max_model_len)
        return
    if kind == "text":
        size = len(request.text.encode("utf-8"))
    elif kind == "messages":
        size = sum(len(m.role.encode("utf-8")) + len(m.content.encode("utf-8"))
                   for m in request.messages.messages)
    else:
        return
    limit = max_model_len * MAX_PROMPT_BYTES_PER_TOKEN
    check_field(size <= limit, kind, f"at most {limit} bytes ({MAX_PROMPT_BYTES_PER_TOKEN} "
                f"per token of max_model_len {max_model_len})", size)


def prompt_ids_from_proto(request: pb.GenerateRequest, tokenizer) -> list[int]:
    """The request's prompt as token ids (text and chat messages through `tokenizer`, which
    may be None when the prompt is token ids). ValueError names what is wrong."""
    kind = request.WhichOneof("prompt")
    if kind is None:
        raise ValueError("prompt must be one of text, token_ids or messages, got none")
    if kind == "token_ids":
        return list(request.token_ids.ids)
    if kind == "messages" and not request.messages.messages:
        raise ValueError("messages must hold at least one message, got none")
    if tokenizer is None:
        raise ValueError(f"prompt must be token_ids: no tokenizer is loaded, got {kind}")
    if kind == "text":
        return list(tokenizer.encode(request.text))
    messages = [{"role": m.role, "content": m.content} for m in request.messages.messages]
    try:
        return list(tokenizer.encode_chat(messages))
    except Exception as e:  # the chat template rejected the conversation
        raise ValueError(f"messages were rejected by the chat template: {e}") from None


def add_chunk(response: pb.GenerateResponse, chunk: pb.GenerateChunk) -> None:
    """Fold one streamed chunk into a unary response."""
    if chunk.request_id:
        response.request_id = chunk.request_id
    response.token_ids.extend(chunk.token_ids)
    response.text += chunk.text
    response.logprobs.extend(chunk.logprobs)
    if chunk.engine_id:
        response.engine_id = chunk.engine_id
    if chunk.finish_reason:
        response.finish_reason = chunk.finish_reason
        response.stop_reason = chunk.stop_reason
        response.usage.CopyFrom(chunk.usage)


async def unary_from_stream(chunks: AsyncIterator[pb.GenerateChunk]) -> pb.GenerateResponse:
    """A unary Generate served from the request's Stream (so both fail the same way)."""
    response = pb.GenerateResponse()
    async with contextlib.aclosing(chunks):
        async for chunk in chunks:
            add_chunk(response, chunk)
    return response


def cancel_code(context) -> str:
    """The status name of a cancelled handler: grpc cancels it both when the client goes away
    and when its deadline passes, and only the time left tells them apart. The client's own
    deadline timer often fires first, so a cancel this close to the deadline is the deadline."""
    left = context.time_remaining()
    return "DEADLINE_EXCEEDED" if left is not None and left < DEADLINE_SLACK_S else "CANCELLED"


def logprob_to_proto(token_id: int, entry: tuple[float, list[int], list[float]]
                     ) -> pb.TokenLogprob:
    chosen, top_ids, top_lps = entry
    return pb.TokenLogprob(token_id=token_id, logprob=chosen, top_token_ids=top_ids,
                           top_logprobs=top_lps)


def stop_reason_to_str(stop_reason: str | int | None) -> str:
    return "" if stop_reason is None else str(stop_reason)


class Refused(Exception):
    """Ends an RPC with `code`; handlers raise it rather than await grpc's context.abort, which
    keeps its exception on the call in a reference cycle with the handler's frames, so every
    refused request (a 3 MB prompt, say) would stay in memory until a full garbage collection."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code = code


def _varint(raw: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while raw[pos] & 0x80:
        value |= (raw[pos] & 0x7F) << shift
        pos, shift = pos + 1, shift + 7
    return value | raw[pos] << shift, pos + 1


def _bad_utf8_field(raw: bytes, descriptor, prefix: str = "") -> str | None:
    """The dotted name of the first string field whose bytes are not UTF-8 in `raw`, the wire
    form of a `descriptor` message (protobuf's DecodeError does not name it); None if none."""
    pos = 0
    try:
        while pos < len(raw):
            tag, pos = _varint(raw, pos)
            wire, field = tag & 7, descriptor.fields_by_number.get(tag >> 3)
            if wire != 2:  # a varint, 64 or 32 bits: no string there
                pos = _varint(raw, pos)[1] if wire == 0 else pos + {1: 8, 5: 4}[wire]
                continue
            size, pos = _varint(raw, pos)
            data, pos = raw[pos:pos + size], pos + size
            if field is None:
                continue
            name = f"{prefix}{field.name}"
            if field.type == field.TYPE_MESSAGE:
                if found := _bad_utf8_field(data, field.message_type, f"{name}."):
                    return found
            elif field.type == field.TYPE_STRING:
                data.decode("utf-8")
    except UnicodeDecodeError:
        return name
    except (IndexError, KeyError):  # truncated, or a wire type nanoserve's protos never use
        return None
    return None


def _parse(parse, raw: bytes):
    try:
        return parse(raw)
    except DecodeError as e:
        message_type = getattr(parse, "__self__", None)  # the generated class's FromString
        field = _bad_utf8_field(raw, message_type.DESCRIPTOR) if message_type else None
        raise Refused(grpc.StatusCode.INVALID_ARGUMENT,
                      f"{field} must be valid UTF-8; the request could not be decoded"
                      if field else f"request could not be decoded: {e}") from None


def _set_status(context, refused: Refused) -> None:
    context.set_code(refused.code)
    context.set_details(str(refused))


class StatusInterceptor(grpc.aio.ServerInterceptor):
    """Handlers of single requests get raw bytes, parsed here so that undecodable ones (bad
    UTF-8 in a string field, say) get INVALID_ARGUMENT where grpc would answer UNKNOWN, and a
    Refused they raise becomes the RPC's status. Every handler must be async."""

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_streaming or handler.request_deserializer is None:
            return handler
        parse = handler.request_deserializer
        behavior = handler.unary_unary or handler.unary_stream
        if inspect.isasyncgenfunction(behavior):
            async def run(raw, context):
                try:
                    request = _parse(parse, raw)
                    async with contextlib.aclosing(behavior(request, context)) as items:
                        async for item in items:
                            yield item
                except Refused as e:
                    _set_status(context, e)
        else:  # a unary handler, or a stream one writing through context.write
            async def run(raw, context):
                try:
                    return await behavior(_parse(parse, raw), context)
                except Refused as e:
                    _set_status(context, e)
        make = (grpc.unary_unary_rpc_method_handler if handler.unary_unary is not None
                else grpc.unary_stream_rpc_method_handler)
        return make(run, response_serializer=handler.response_serializer)
