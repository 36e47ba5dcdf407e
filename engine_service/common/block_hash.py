"""Prefix-cache block hashes, shared by the block manager and the (torch-free) router. A
block's hash chains its parent's with its token ids, so equal hashes mean an equal prefix (up
to xxh3 collisions, which the block manager checks against stored token ids).
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

import xxhash

HASH_SCHEME = "xxh3_64-chain-v1"
_NO_PARENT = 0xFFFFFFFFFFFFFFFF


def hash_block(parent_hash: int | None, token_ids: Sequence[int]) -> int:
    """xxh3_64 of (parent hash as 8 little-endian bytes, token ids as uint32 LE)."""
    h = xxhash.xxh3_64()
    parent = _NO_PARENT if parent_hash is None else parent_hash
    h.update(parent.to_bytes(8, "little"))
    tokens = array("I", token_ids)
    if tokens.itemsize != 4:  # pragma: no cover - every supported platform has 4-byte "I"
        raise RuntimeError("uint32 array expected")
    h.update(tokens.tobytes())
    return h.intdigest()


def hash_prompt_blocks(token_ids: Sequence[int], block_size: int) -> list[int]:
    """Chained hashes of every full block of `token_ids` (a partial tail is not hashed)."""
    hashes: list[int] = []
    parent: int | None = None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[start:start + block_size])
        hashes.append(parent)
    return hashes
