"""Incremental detokenization with stop strings, for streamed generation.

Torch-free. Tokens arrive a few at a time; each update returns only text that is final: no
trailing U+FFFD from a character whose UTF-8 bytes are split over tokens that have not all
arrived, and nothing that could still turn out to be the start of a stop string. The deltas
concatenate to exactly `tokenizer.decode(output ids)` (when no stop string cuts the text).

Decoding follows vLLM's prefix_offset/read_offset scheme: the tokens up to read_offset are
final; each step decodes only the window from prefix_offset (the previous read_offset) and
subtracts the window's already-final text, so a step costs the same at token 10 and token
10 000, and tokenizers whose first token decodes differently (SentencePiece's stripped leading
space) still come out right.

One limit: tokenizers' ByteFallback decoder (Llama-2 style <0xNN> tokens) turns a whole run of
byte tokens into U+FFFDs when any byte in it is invalid, even bytes that already formed a
character; text already streamed cannot follow that, so for such tokenizers the deltas equal
decode() whenever the byte tokens form valid UTF-8 (always, for real text).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from engine_service.common.tokenizer import Tokenizer

_REPLACEMENT = "\ufffd"  # what lossy UTF-8 decoding puts where bytes are missing or invalid
# Undecodable tokens allowed to pile up before a byte-level window looks for a cut point. Real
# text never gets near it (a character is at most 4 bytes); random or garbage ids do.
_MAX_PENDING = 8


@dataclass(frozen=True)
class DetokenizerUpdate:
    text_delta: str
    stopped: bool = False
    stop_string: str | None = None


class IncrementalDetokenizer:
    """Turns one request's output token ids into text deltas and watches its stop strings.

    The text deliberately starts at the first output token (no prompt context): the streamed
    text must equal decode(output ids), which is what a unary reply and transformers give.
    Decoding across the prompt would glue a character split at the prompt boundary, or a
    SentencePiece leading space, onto the output.
    """

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
        new_text = self._decode_new(new_token_ids) if new_token_ids else ""
        return self._emit(new_text, final=False)

    def finish(self) -> str:
        """The request ended for another reason (eos, length, abort): release all held text.

        A stop string completed by the released text still cuts it (and sets `stopped`).
        """
        if self.stopped:
            return ""
        text = self._decode(self._window)
        tail = text[len(self._prefix_text):]
        self._window, self._read_offset, self._prefix_text = [], 0, ""
        return self._emit(tail, final=True).text_delta

    # ---- tokens -> final text ---------------------------------------------------------------

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _decode_new(self, new_token_ids: Sequence[int]) -> str:
        """Text that became final with these tokens ("" while a character is incomplete)."""
        # Tokens decode() drops anyway never enter the window, so its first token always shows:
        # decoders that treat the first token specially (SentencePiece strips its leading
        # space) must see the same first token in every decode of the window.
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
        """Garbage bytes keep the window ending in U+FFFD; find a token boundary whose text is
        final anyway, so the window (and the cost of a step) stays bounded.

        For lossy UTF-8 a boundary `cut` with non-empty text after it is final exactly when
        decode(before) + decode(after) == decode(all): were a character still open at `cut`, the
        bytes after it would either complete it or decode to extra U+FFFDs, and the two sides
        would differ. Only byte-level decoders get here: ByteFallback decodes a whole run of
        byte tokens to U+FFFDs when any of them is bad, which breaks that argument.
        """
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

    # ---- final text -> deltas, stop strings --------------------------------------------------

    def _emit(self, new_text: str, final: bool) -> DetokenizerUpdate:
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
        return DetokenizerUpdate(delta, self.stopped, self.stop_string)

    def _find_stop(self, text: str) -> tuple[int, str] | None:
        """The stop string that ends first in `text` (ties: the longer one), and where it starts.

        Ending first is what a character-by-character scan sees, so the cut does not depend on
        how the tokens were grouped into updates.
        """
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
