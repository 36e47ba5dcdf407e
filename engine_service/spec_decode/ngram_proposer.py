"""Prompt lookup: propose the tokens that followed the latest earlier occurrence of a
sequence's last n tokens (n from prompt_lookup_max down to prompt_lookup_min)."""

from __future__ import annotations

from array import array

from engine_service.sequence import Sequence

_WORD = array("i").itemsize  # token ids as int32 bytes, searched with bytes.rfind


def propose_ngram(token_ids: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Up to k tokens following an earlier match of the longest matching suffix (min_n <=
    n <= max_n) of token_ids: the latest match with k tokens after it, else the latest
    (a run of one repeated token would otherwise only ever propose one); [] when no
    suffix recurs."""
    num_tokens = len(token_ids)
    if k < 1 or num_tokens < min_n + 1:
        return []
    data = array("i", token_ids).tobytes()
    for n in range(min(max_n, num_tokens - 1), min_n - 1, -1):
        suffix = data[(num_tokens - n) * _WORD:]
        # A match must end before the last token, so that a token follows it.
        for last in (num_tokens - k, num_tokens - 1):
            start = _rfind_token_aligned(data, suffix, last * _WORD)
            if start >= 0:
                return token_ids[start + n:start + n + k]
    return []


def _rfind_token_aligned(data: bytes, sub: bytes, end: int) -> int:
    """The token index of the last occurrence of sub in data[:end] that starts at a token
    boundary (not across two ids), or -1."""
    while end >= len(sub):
        at = data.rfind(sub, 0, end)
        if at < 0:
            return -1
        if at % _WORD == 0:
            return at // _WORD
        end = at + len(sub) - 1
    return -1


class NgramProposer:
    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n

    def propose(self, seqs: list[Sequence], limits: list[int]) -> list[list[int]]:
        """For each sequence, at most its limit of proposed tokens."""
        return [propose_ngram(seq.token_ids, k, self.min_n, self.max_n) if k else []
                for seq, k in zip(seqs, limits, strict=True)]

    def may_propose(self, seqs: list[Sequence]) -> bool:
        """Whether some sequence's last tokens recur: output that repeats keeps repeating,
        and output that does not seldom starts within one step."""
        return any(propose_ngram(seq.token_ids, 1, self.min_n, self.max_n) for seq in seqs)
