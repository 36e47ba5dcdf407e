"""Protobuf <-> engine dataclasses: the one place the wire format is converted."""

from __future__ import annotations

from engine_service.sampling_params import SamplingParams
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


def sampling_params_from_proto(msg: pb.SamplingParams) -> SamplingParams:
    """Unset optional fields keep SamplingParams' defaults; values are checked there."""
    kwargs = {name: getattr(msg, name) for name in _OPTIONAL_FIELDS if msg.HasField(name)}
    for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                 "frequency_penalty"):
        if name in kwargs:  # proto floats are float32: 0.9 arrives as 0.8999999761...
            kwargs[name] = round(kwargs[name], 6)
    return SamplingParams(stop=list(msg.stop), stop_token_ids=list(msg.stop_token_ids),
                          ignore_eos=msg.ignore_eos, **kwargs)


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


def logprob_to_proto(token_id: int, entry: tuple[float, list[int], list[float]]
                     ) -> pb.TokenLogprob:
    chosen, top_ids, top_lps = entry
    return pb.TokenLogprob(token_id=token_id, logprob=chosen, top_token_ids=top_ids,
                           top_logprobs=top_lps)


def stop_reason_to_str(stop_reason: str | int | None) -> str:
    return "" if stop_reason is None else str(stop_reason)
