"""Constants of the exponential race that the torch sampler, its Triton kernel and the
tensor-parallel argmax share. No imports, so any of them can use it without a cycle."""

from __future__ import annotations


def _i64(c: int) -> int:
    """An unsigned 64-bit constant as the signed int64 with the same bits."""
    return c - (1 << 64) if c >= 1 << 63 else c


# splitmix64 (Steele, Lea, Flood 2014): golden-ratio increment and finaliser multipliers.
GAMMA = _i64(0x9E3779B97F4A7C15)
MIX1 = _i64(0xBF58476D1CE4E5B9)
MIX2 = _i64(0x94D049BB133111EB)
SEED_SALT = _i64(0xD1B54A32D192ED03)

# An index no candidate ever holds: "no value above -inf seen" (all -inf / NaN, or an empty
# vocab chunk). A plain int: the kernels use it as a constexpr.
NO_INDEX = 2**31 - 1
