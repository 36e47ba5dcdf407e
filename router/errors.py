"""Messages forwarded into a gRPC status stay small: a status travels in metadata (16 KiB
at most), so a message that echoes a huge value would break the call itself. Values the
router quotes itself go through engine_service.common.sampling_params.quote, and so do the engines';
this caps whatever else reaches a status (a message from elsewhere, an exception's text)."""

from __future__ import annotations

MAX_MESSAGE_BYTES = 1024


def bounded(message: str) -> str:
    """`message`, or its first bytes and its length when it is over MAX_MESSAGE_BYTES of
    UTF-8."""
    data = message.encode("utf-8")
    if len(data) <= MAX_MESSAGE_BYTES:
        return message
    tail = f"... (length {len(message)})"
    return data[:MAX_MESSAGE_BYTES - len(tail)].decode("utf-8", errors="ignore") + tail
