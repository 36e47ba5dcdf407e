"""Masked-diffusion LLMs (LLaDA, Dream): the decoding engine and its unmasking rules."""
