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


def logprob_to_proto(token_id: int, entry: tuple[float, list[int], list[float]]
                     ) -> pb.TokenLogprob:
    chosen, top_ids, top_lps = entry
    return pb.TokenLogprob(token_id=token_id, logprob=chosen, top_token_ids=top_ids,
                           top_logprobs=top_lps)


def stop_reason_to_str(stop_reason: str | int | None) -> str:
    return "" if stop_reason is None else str(stop_reason)
