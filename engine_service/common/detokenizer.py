"""Incremental detokenization with stop strings, for streamed generation (torch-free).

Each update returns only final text: no trailing U+FFFD of a character split over tokens not
yet arrived, nothing that may still start a stop string. The deltas concatenate to exactly
`tokenizer.decode(output ids)` (unless a stop string cuts it). Decoding follows vLLM's
prefix_offset/read_offset scheme, so a step costs the same at token 10 and token 10 000.
Limit: ByteFallback decoders (Llama-2 <0xNN> tokens) turn a whole run of byte tokens into
U+FFFDs when any is invalid, so there the deltas equal decode() only for valid UTF-8.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from engine_service.common.tokenizer import Tokenizer

_REPLACEMENT = "\ufffd"  # what lossy UTF-8 decoding puts where bytes are missing or invalid
# Undecodable tokens a byte-level window holds before it looks for a cut (a char is <= 4 bytes).
_MAX_PENDING = 8


@dataclass(frozen=True)
class DetokenizerUpdate:
    text_delta: str
    stopped: bool = False
    stop_string: str | None = None
    # Of the tokens given, those the output keeps: fewer only when a stop string ended
    # before the last of them (several tokens come at once under speculative decoding).
    num_tokens: int = 0


class IncrementalDetokenizer:
    """Turns one request's output token ids into text deltas and watches its stop strings.
    No prompt context, on purpose: the streamed text must equal decode(output ids)."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        skip_special_tokens: bool = True,
        stop: Sequence[str] = (),
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop: tuple[str, ...] = tuple(s for s in stop if s)  # "" would stop at once
        self._max_held = max((len(s) for s in self.stop), default=1) - 1
        # Token side. _window = output ids from prefix_offset on; offsets are relative to it.
        self._window: list[int] = []
        self._read_offset = 0  # _window[:_read_offset] is decoded and final
        self._prefix_text = ""  # decode(_window[:_read_offset]), subtracted from every decode
        # Text side.
        self._sent: list[str] = []  # deltas handed out so far
        self._held = ""  # final text kept back because a stop string may start in it
        self.stopped = False
        self.stop_string: str | None = None

    @property
    def output_text(self) -> str:
        """All text so far (held-back text included), cut before a stop string that matched."""
        return "".join(self._sent) + self._held

    def update(self, new_token_ids: Sequence[int]) -> DetokenizerUpdate:
        if self.stopped:
            return DetokenizerUpdate("", True, self.stop_string)
        if len(new_token_ids) > 1 and self.stop:
            # One token at a time, so a stop string ends the output at the token that
            # completes it, as when tokens come one a step.
            deltas = []
            for n, token in enumerate(new_token_ids, 1):
                upd = self._emit(self._decode_new([token]), final=False, num_tokens=n)
                deltas.append(upd.text_delta)
                if upd.stopped:
                    break
            return DetokenizerUpdate("".join(deltas), upd.stopped, upd.stop_string, n)
        new_text = self._decode_new(new_token_ids) if new_token_ids else ""
        return self._emit(new_text, final=False, num_tokens=len(new_token_ids))

    def finish(self) -> str:
        """The request ended for another reason: release all held text (a stop string it
        completes still cuts it)."""
        if self.stopped:
            return ""
        text = self._decode(self._window)
        tail = text[len(self._prefix_text):]
        self._window, self._read_offset, self._prefix_text = [], 0, ""
        return self._emit(tail, final=True).text_delta

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _decode_new(self, new_token_ids: Sequence[int]) -> str:
        """Text that became final with these tokens ("" while a character is incomplete)."""
        # Tokens decode() drops never enter the window: decoders that treat the first token
        # specially (SentencePiece's leading space) must see the same one every time.
        skipped = self.tokenizer.skipped_special_ids if self.skip_special_tokens else ()
        visible = [i for i in new_token_ids
                   if i not in skipped and self.tokenizer.is_known_id(i)]
        if not visible:
            return ""
        self._window.extend(visible)
        text = self._decode(self._window)
        # Strictly longer, as in vLLM: tokens that added no text stay in the window, so the
        # next window still starts on a token that shows text.
        if not text.endswith(_REPLACEMENT) and len(text) > len(self._prefix_text):
            return self._advance(text)
        if (
            self.tokenizer.decoder_is_byte_level
            and len(self._window) - self._read_offset > _MAX_PENDING
        ):
            return self._cut_undecodable(text)
        return ""

    def _advance(self, text: str) -> str:
        """Everything in the window is final: hand it out, slide the window forward."""
        delta = text[len(self._prefix_text):]
        self._window = self._window[self._read_offset:]
        self._read_offset = len(self._window)
        if self.tokenizer.decoder_is_byte_level:
            # Lossy UTF-8 restarts cleanly after a complete character, so the new window's
            # prefix decodes to exactly the delta: skip the second decode.
            self._prefix_text = delta
        else:
            self._prefix_text = self._decode(self._window)
        return delta

    def _cut_undecodable(self, text: str) -> str:
        """Garbage bytes keep the window ending in U+FFFD: find a token boundary whose text
        is final anyway, so the window stays bounded. For lossy UTF-8 (byte-level decoders
        only) a cut is final exactly when decode(before) + decode(after) == decode(all)."""
        for cut in range(len(self._window) - 1, self._read_offset, -1):
            after = self._decode(self._window[cut:])
            if not after:
                continue
            before = self._decode(self._window[:cut])
            if before + after == text and len(before) >= len(self._prefix_text):
                delta = before[len(self._prefix_text):]
                self._window, self._read_offset, self._prefix_text = self._window[cut:], 0, ""
                return delta
        return ""

    def _emit(self, new_text: str, final: bool, num_tokens: int = 0) -> DetokenizerUpdate:
        # Sent text never holds the start of a stop string (that part is held), so a match can
        # only lie in held + new text: the search never looks at the whole output.
        text = self._held + new_text
        match = self._find_stop(text)
        if match is not None:
            start, self.stop_string = match
            self.stopped = True
            delta, self._held = text[:start], ""
        else:
            keep = 0 if final else self._stop_prefix_len(text)
            delta, self._held = text[:len(text) - keep], text[len(text) - keep:]
        if delta:
            self._sent.append(delta)
        return DetokenizerUpdate(delta, self.stopped, self.stop_string, num_tokens)

    def _find_stop(self, text: str) -> tuple[int, str] | None:
        """(start, stop string) of the one ending first in `text` (ties: the longer), as a
        character scan sees it, so the cut does not depend on how tokens were grouped."""
        best: tuple[int, str] | None = None
        for stop in self.stop:
            start = text.find(stop)
            if start < 0:
                continue
            if best is None or (start + len(stop), start) < (best[0] + len(best[1]), best[0]):
                best = (start, stop)
        return best

    def _stop_prefix_len(self, text: str) -> int:
        """Length of the longest tail of `text` that some stop string starts with."""
        for size in range(min(self._max_held, len(text)), 0, -1):
            tail = text[-size:]
            if any(stop.startswith(tail) for stop in self.stop):
                return size
        return 0


def tokenizer_if_present(model_dir: str) -> Tokenizer | None:
    """The directory's tokenizer, or None: a --load-format dummy directory may hold only
    config.json (token ids in and out)."""
    has_tokenizer = (Path(model_dir) / "tokenizer.json").is_file()
    return Tokenizer.from_dir(model_dir) if has_tokenizer else None


@dataclass(slots=True)
class OutputStep:
    """One step's output of a request, as its client sees it."""

    num_tokens: int  # of the step's new tokens, those kept (fewer when a stop string ends it)
    text: str  # text delta
    finished: bool
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    stopped_by_text: bool = False  # a stop string ended it, so the engine must abort it


def apply_output(detok: IncrementalDetokenizer | None, out) -> OutputStep:
    """Detokenize one step's RequestOutput `out` (without a tokenizer, no text) and tell
    whether it ends the request: a stop string in its text, or the engine's own finish."""
    upd = detok.update(out.new_token_ids) if detok is not None else None
    if upd is not None and upd.stopped:
        return OutputStep(upd.num_tokens, upd.text_delta, True, "stop", upd.stop_string, True)
    step = OutputStep(len(out.new_token_ids) if upd is None else upd.num_tokens,
                      "" if upd is None else upd.text_delta, out.finished)
    if out.finished:
        step.text += detok.finish() if detok is not None else ""
        step.finish_reason, step.stop_reason = out.finish_reason, out.stop_reason
    return step
