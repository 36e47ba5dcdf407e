"""Speculative decoding: proposers (prompt lookup, a draft model) and the engine's rules."""
