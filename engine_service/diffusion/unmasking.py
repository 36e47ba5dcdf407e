"""What one forward pass of a masked-diffusion model decides: a prediction and a confidence
for every position of a request's current block (on the device), and which masked positions
take their prediction (on the host), by the LLaDA paper's schedule or Fast-dLLM's threshold.
"""

from __future__ import annotations

import torch

from models.layers.sampler import hashed_uniform, race_perturbed

# Draw keys of a pass: (pass, position) -> a step of the seed's hash stream; the random
# remasking rule's keys are offset so its draws never repeat the Gumbel noise's.
_PASS_STRIDE = 1 << 20
_RANDOM_REMASKING_SALT = 1 << 40


def num_transfer_tokens(num_masked: int, steps: int) -> list[int]:
    """Positions to unmask at each of `steps` passes of a block with `num_masked` masks: an
    even split, the remainder one each on the first passes (LLaDA's schedule)."""
    base, extra = divmod(num_masked, steps)
    return [base + (i < extra) for i in range(steps)]


def predict(logits: torch.Tensor, temperature: torch.Tensor, random_remasking: torch.Tensor,
            seeds: torch.Tensor, keys: torch.Tensor, any_noise: bool
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """logits float32 [N, V] of N block positions -> (predicted ids int64 [N], confidence
    float32 [N]). temperature [N] > 0 draws with Gumbel noise (softmax(logits / T)), else
    the argmax; confidence is the prediction's softmax probability, or a uniform draw where
    random_remasking [N] is set. seeds, keys int64 [N] key the draws. `any_noise` (some
    temperature > 0, known on the host) is when the [N, V] noise is worth making."""
    predicted = logits.argmax(-1)  # [N]
    if any_noise:
        noisy = race_perturbed(logits / temperature.clamp_min(1e-5)[:, None], seeds, keys)
        predicted = torch.where(temperature > 0, noisy.argmax(-1), predicted)
    chosen = logits.gather(1, predicted[:, None]).squeeze(1)
    confidence = (chosen - logits.logsumexp(-1)).exp()  # [N]
    drawn = hashed_uniform(seeds, keys + _RANDOM_REMASKING_SALT, 1).squeeze(1)  # [N]
    return predicted, torch.where(random_remasking, drawn, confidence)


def draw_keys(num_passes: int, positions: list[int]) -> list[int]:
    """The hash steps of a request's pass at these gen positions."""
    return [num_passes * _PASS_STRIDE + p for p in positions]


def choose(confidence: list[float], masked: list[bool], count: int | None,
           threshold: float | None) -> list[int]:
    """Indices of the block positions to unmask: the `count` most confident masked ones, or
    with a threshold every masked one above it and at least the most confident."""
    order = sorted((i for i, m in enumerate(masked) if m), key=lambda i: -confidence[i])
    if threshold is None:
        assert count is not None
        return order[:count]
    return order[:1] + [i for i in order[1:] if confidence[i] >= threshold]
