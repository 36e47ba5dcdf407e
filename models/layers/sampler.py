"""Batched sampler: penalties, suppression, temperature, top-k, top-p, min-p and seeded
sampling for a whole batch on the model's device, with no host synchronisation.

Every draw is a counter-based hash of (seed, step, vocab index), so a request's tokens depend
only on its own seed and output position, never on its batch. The torch ops here are the CPU
path and the reference of the fused CUDA kernel (`models/kernels/sample.py`), which makes the
same hash words; their float logs may differ by an ulp.
"""

from __future__ import annotations

import functools
import importlib.util
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from models.host_copy import to_device
from models.parallel import tp_argmax
from models.sampling_hash import GAMMA, MIX1, MIX2, NO_INDEX, SEED_SALT

# Temperatures below this are treated as greedy: dividing by them overflows the logits.
SAMPLING_EPS = 1e-5


def effective_temperature(temperature: float) -> float:
    """The temperature a row draws with: 0 (greedy) below SAMPLING_EPS."""
    return 0.0 if temperature < SAMPLING_EPS else temperature

# Slack on the top-p boundary: a token whose preceding mass reaches top_p within float32
# rounding of the softmax/cumsum is outside the nucleus (the smallest set with mass >= top_p).
TOP_P_EPS = 1e-6


def _shr(x: torch.Tensor, s: int) -> torch.Tensor:
    # torch's >> on int64 is arithmetic; masking off the copied sign bits makes it logical.
    return (x >> s) & ((1 << (64 - s)) - 1)


def mix64(z: torch.Tensor) -> torch.Tensor:
    """splitmix64 finaliser on int64 tensors (a bijection of 64-bit words; multiplies wrap)."""
    z = (z ^ _shr(z, 30)) * MIX1
    z = (z ^ _shr(z, 27)) * MIX2
    return z ^ _shr(z, 31)


def hashed_uniform(seeds: torch.Tensor, steps: torch.Tensor, vocab_size: int,
                   vocab_offset: int = 0) -> torch.Tensor:
    """float32 [B, vocab_size]: u in (0, 1) for (seed, step, vocab index) with seeds, steps
    int64 [B] and indices from vocab_offset; u = (m + 0.5) / 2**23 for the top 23 hash bits."""
    # A splitmix64 stream per (seed, step): the key is its state, the vocab index its counter.
    key = mix64(mix64(seeds ^ SEED_SALT) + steps * GAMMA)  # [B]
    offsets = (torch.arange(vocab_offset + 1, vocab_offset + vocab_size + 1,
                            dtype=torch.int64, device=seeds.device) * GAMMA)  # [V]
    bits = mix64(key[:, None] + offsets[None, :])  # [B, V]
    mantissa = _shr(bits, 41).to(torch.float32)  # [B, V] in [0, 2**23)
    return (mantissa + 0.5) * (1.0 / (1 << 23))


def race_perturbed(logits: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor,
                   vocab_offset: int = 0) -> torch.Tensor:
    """logits - log(E) with E = -log(u) ~ Exp(1): its argmax is a draw from softmax(logits).
    Column j is vocab index vocab_offset + j."""
    u = hashed_uniform(seeds, steps, logits.shape[-1], vocab_offset)  # [B, V]
    return logits - (-u.log()).log()


def _coords(token_lists: Sequence[Sequence[int]]) -> tuple[list[int], list[int]]:
    """(row, token id) pairs of every token in every row, as two flat lists."""
    rows: list[int] = []
    cols: list[int] = []
    for i, ids in enumerate(token_lists):
        rows.extend([i] * len(ids))
        cols.extend(ids)
    return rows, cols


@dataclass
class SamplingTensors:
    """Per-row sampling settings of one batch, on the model's device. B = rows to sample."""

    temperatures: torch.Tensor  # float32 [B], 0 = greedy
    top_ks: torch.Tensor  # int32 [B], vocab_size when off
    top_ps: torch.Tensor  # float32 [B], 1 = off
    min_ps: torch.Tensor  # float32 [B], 0 = off
    seeds: torch.Tensor  # int64 [B]
    sample_steps: torch.Tensor  # int64 [B], index of the output token being sampled
    repetition_penalties: torch.Tensor  # float32 [B], 1 = off
    presence_penalties: torch.Tensor  # float32 [B], 0 = off
    frequency_penalties: torch.Tensor  # float32 [B], 0 = off
    prompt_mask: torch.Tensor | None = None  # bool [B, V], only when any_penalty
    output_counts: torch.Tensor | None = None  # int32 [B, V], only when any_penalty
    suppress_token_ids: torch.Tensor | None = None  # int64 [K, 2] (row, token id) -> -inf
    logit_bias_ids: torch.Tensor | None = None  # int64 [2, L] (row, token id) += bias
    logit_bias: torch.Tensor | None = None  # float32 [L]
    # int32 [B, ceil(V / 32)], bit t % 32 of word t // 32 set where token t may be drawn. It is
    # filled after the forward pass is queued (the runner sets it), so `any_token_mask` says
    # at build time that one will come.
    token_bitmask: torch.Tensor | None = None
    any_token_mask: bool = False
    max_num_logprobs: int = -1  # top-n logprobs to return; -1 = no row wants logprobs
    all_greedy: bool = False
    any_top_k: bool = False
    any_top_p: bool = False
    any_min_p: bool = False
    any_penalty: bool = False

    @property
    def edits_logits(self) -> bool:
        """Something other than temperature and a token mask shapes the draws, or logprobs
        are wanted: the sampler works on a float32 copy of the logits."""
        return (self.any_penalty or self.suppress_token_ids is not None or self.any_top_k
                or self.any_top_p or self.any_min_p or self.max_num_logprobs >= 0
                or self.logit_bias is not None)

    @property
    def temperature_only(self) -> bool:
        """Only temperature shapes the draws and no logprobs are wanted, so vocab shards can
        each take the argmax over their own columns (`Sampler.sample_shard`)."""
        return not (self.edits_logits or self.any_token_mask)

    @classmethod
    def build(
        cls,
        params: Sequence[object],
        seeds: Sequence[int],
        steps: Sequence[int],
        prompt_token_ids: Sequence[Sequence[int]] | None,
        output_token_ids: Sequence[Sequence[int]] | None,
        suppress: Sequence[tuple[int, int]],
        vocab_size: int,
        device: torch.device | str,
        bias: Sequence[tuple[int, int, float]] = (),
        any_token_mask: bool = False,
    ) -> SamplingTensors:
        """Settings from SamplingParams in at most 5 host->device copies. bias: (row, token
        id, logit bias) triples."""
        device = torch.device(device)
        b = len(params)
        if len(seeds) != b or len(steps) != b:
            raise ValueError(f"need one seed and one step per row ({b}), "
                             f"got {len(seeds)} seeds and {len(steps)} steps")
        # LLM.generate gives every row the same SamplingParams object: convert it once.
        uniform = b > 1 and all(p is params[0] for p in params)  # stops at the first other
        src = params[:1] if uniform else params
        temps = [effective_temperature(float(p.temperature)) for p in src]
        top_ks = [int(p.top_k) for p in src]
        top_ks = [vocab_size if k <= 0 or k >= vocab_size else k for k in top_ks]
        top_ps, min_ps, reps, pres, freqs = (
            [float(getattr(p, name)) for p in src] for name in
            ("top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"))
        wanted = [int(p.logprobs) for p in src if p.logprobs is not None]

        sampled = [t > 0 for t in temps]
        any_penalty = any(r != 1.0 or p != 0.0 or f != 0.0
                          for r, p, f in zip(reps, pres, freqs, strict=True))
        all_greedy = not any(sampled)
        any_top_k = any(s and k < vocab_size for s, k in zip(sampled, top_ks, strict=True))
        any_top_p = any(s and p < 1.0 for s, p in zip(sampled, top_ps, strict=True))
        any_min_p = any(s and m > 0.0 for s, m in zip(sampled, min_ps, strict=True))
        if uniform:
            temps, top_ks, top_ps, min_ps, reps, pres, freqs = (
                column * b for column in (temps, top_ks, top_ps, min_ps, reps, pres, freqs))

        # One flat list each: the array-backed copy is much faster than nested lists.
        floats = to_device(temps + top_ps + min_ps + reps + pres + freqs, torch.float32,
                           device).view(6, b)
        ints = to_device(top_ks + list(seeds) + list(steps), torch.int64, device).view(3, b)

        prompt_mask = output_counts = None
        if any_penalty:
            if prompt_token_ids is None or output_token_ids is None:
                raise ValueError("penalties need prompt_token_ids and output_token_ids")
            if len(prompt_token_ids) != b or len(output_token_ids) != b:
                raise ValueError(f"need prompt and output token ids for each of {b} rows")
            p_rows, p_cols = _coords(prompt_token_ids)
            o_rows, o_cols = _coords(output_token_ids)
            coords = to_device([p_rows + o_rows, p_cols + o_cols], torch.int64, device)
            n_prompt = len(p_rows)
            prompt_mask = torch.zeros(b, vocab_size, dtype=torch.bool, device=device)
            prompt_mask[coords[0, :n_prompt], coords[1, :n_prompt]] = True
            output_counts = torch.zeros(b, vocab_size, dtype=torch.int32, device=device)
            output_counts.index_put_(
                (coords[0, n_prompt:], coords[1, n_prompt:]),
                torch.ones(len(o_rows), dtype=torch.int32, device=device), accumulate=True)

        suppress_ids = (to_device([list(pair) for pair in suppress], torch.int64, device)
                        if suppress else None)
        bias_ids = bias_values = None
        if bias:
            rows, ids, values = zip(*bias, strict=True)
            flat = to_device(list(rows) + list(ids) + list(values), torch.float64, device)
            bias_ids = flat[:2 * len(bias)].view(2, -1).long()  # ids < 2**53: exact
            bias_values = flat[2 * len(bias):].float()
        return cls(
            temperatures=floats[0], top_ps=floats[1], min_ps=floats[2],
            repetition_penalties=floats[3], presence_penalties=floats[4],
            frequency_penalties=floats[5],
            top_ks=ints[0].to(torch.int32), seeds=ints[1], sample_steps=ints[2],
            prompt_mask=prompt_mask, output_counts=output_counts,
            suppress_token_ids=suppress_ids, logit_bias_ids=bias_ids, logit_bias=bias_values,
            any_token_mask=any_token_mask, max_num_logprobs=max(wanted, default=-1),
            all_greedy=all_greedy, any_top_k=any_top_k, any_top_p=any_top_p,
            any_min_p=any_min_p, any_penalty=any_penalty)


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # int64 [B]
    logprobs: torch.Tensor | None = None  # float32 [B], raw logprob of the sampled token
    top_logprobs: torch.Tensor | None = None  # float32 [B, n], n = max_num_logprobs
    top_token_ids: torch.Tensor | None = None  # int64 [B, n]


def apply_penalties(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    """Repetition (prompt and output tokens), presence and frequency (output tokens) penalties.
    logits: float32 [B, V]; returns a new tensor, bit-identical for neutral rows."""
    assert t.prompt_mask is not None and t.output_counts is not None
    counts = t.output_counts.to(logits.dtype)  # [B, V]
    rep = t.repetition_penalties[:, None]  # [B, 1]
    seen = t.prompt_mask | (t.output_counts > 0)  # [B, V]
    penalised = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, penalised, logits)
    logits = logits - t.presence_penalties[:, None] * (counts > 0).to(logits.dtype)
    return logits - t.frequency_penalties[:, None] * counts


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """-inf where a row's bitmask bit is clear. logits float32 [B, V]; bitmask int32 [B, W]
    with W * 32 >= V. Read as bytes (little-endian words): a [B, V] uint8 temporary at most."""
    b, v = logits.shape
    bytes_ = bitmask.view(torch.uint8)  # [B, 4W]: byte k holds tokens 8k .. 8k + 7
    shifts = torch.arange(8, dtype=torch.uint8, device=logits.device)  # made on the device
    allowed = ((bytes_[:, :, None] >> shifts) & 1).bool()  # [B, 4W, 8]
    return logits.masked_fill(~allowed.view(b, -1)[:, :v], -math.inf)


def apply_top_k_top_p(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    """Mask (to -inf) tokens outside each row's top-k, then outside its top-p nucleus of the
    top-k-renormalised distribution. One sort; each mask is a per-row threshold value, so ties
    at the threshold are kept and nothing is scattered back. logits: float32 [B, V]."""
    sorted_logits = logits.sort(dim=-1, descending=True).values  # [B, V]
    if t.any_top_k:
        kth = sorted_logits.gather(1, (t.top_ks.long() - 1)[:, None])  # [B, 1]
        logits = logits.masked_fill(logits < kth, -math.inf)
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, -math.inf)
    if t.any_top_p:
        probs = sorted_logits.softmax(dim=-1)  # [B, V]
        mass_before = probs.cumsum(dim=-1) - probs  # [B, V], mass of strictly better tokens
        keep = mass_before < (t.top_ps[:, None] - TOP_P_EPS)
        keep[:, 0] = True  # the top token always survives
        keep |= (t.top_ps >= 1.0)[:, None]  # top_p = 1 must be an exact no-op
        num_kept = keep.sum(dim=-1, keepdim=True)  # [B, 1]
        threshold = sorted_logits.gather(1, num_kept - 1)  # [B, 1]
        logits = logits.masked_fill(logits < threshold, -math.inf)
    return logits


def apply_min_p(logits: torch.Tensor, min_ps: torch.Tensor) -> torch.Tensor:
    """Drop tokens with prob < min_p * max prob, in log space: logit < max logit + log(min_p).
    min_p = 0 gives log 0 = -inf, an exact no-op."""
    max_logit = logits.amax(dim=-1, keepdim=True)  # [B, 1]
    return logits.masked_fill(logits < max_logit + min_ps.log()[:, None], -math.inf)


@functools.cache
def _triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None  # asked every step: cached


def _race_argmax(logits: torch.Tensor, t: SamplingTensors, temps: torch.Tensor,
                 bitmask: torch.Tensor | None = None) -> torch.Tensor:
    # Imported on first CUDA use only: CPU installs may lack triton.
    from models.kernels.sample import race_argmax

    return race_argmax(logits, temps, t.seeds, t.sample_steps, bitmask=bitmask)


def _shard_best(logits: torch.Tensor, t: SamplingTensors, vocab_offset: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch path of sharded sampling: each row's best (value float32 [B, 1], global index
    int32 [B, 1]) over this shard; NO_INDEX where nothing is above -inf."""
    perturbed = race_perturbed(Sampler._scale_and_mask(logits, t), t.seeds, t.sample_steps,
                               vocab_offset)
    x = torch.where((t.temperatures > 0)[:, None], perturbed, logits)  # [B, V_rank]
    x = x.masked_fill(x.isnan(), -math.inf)
    best = x.argmax(dim=-1, keepdim=True)  # [B, 1], the first of equal values
    values = x.gather(1, best)
    indices = torch.where(values > -math.inf, best + vocab_offset, NO_INDEX)
    return values, indices.to(torch.int32)


class Sampler(nn.Module):
    """logits [B, V] -> one token per row (plus raw logprobs when asked), on the device.
    use_kernel: draw through the fused Triton kernel on CUDA; False: the torch reference."""

    def __init__(self, use_kernel: bool = True) -> None:
        super().__init__()
        self.use_kernel = use_kernel

    def warm_up(self, vocab_size: int, dtype: torch.dtype, device: torch.device) -> None:
        """Compile the draw kernel for the model's logits and for float32 ones (the penalty
        and mask paths), for odd and even batches, now: not in the middle of serving."""
        if not (self.use_kernel and device.type == "cuda" and _triton_installed()):
            return
        from models.kernels.sample import race_argmax

        for logits_dtype in {dtype, torch.float32}:
            # SamplingTensors.build hands out seeds and steps as rows of one [3, B] int64
            # tensor: 16-byte aligned for even B only, and alignment is a compile key.
            for num_rows in (1, 2):
                ints = torch.ones(3, num_rows, dtype=torch.int64, device=device)
                logits = torch.zeros(num_rows, vocab_size, dtype=logits_dtype, device=device)
                race_argmax(logits, ints[0].float(), ints[1], ints[2])
                if logits_dtype == dtype:  # structured output's masked draw
                    mask = torch.full((num_rows, -(-vocab_size // 32)), -1, dtype=torch.int32,
                                      device=device)
                    race_argmax(logits, ints[0].float(), ints[1], ints[2], bitmask=mask)

    def _kernel_for(self, logits: torch.Tensor) -> bool:
        """Whether the Triton draw serves these logits (CUDA, triton installed, not off)."""
        return self.use_kernel and logits.is_cuda and _triton_installed()

    def forward(self, logits: torch.Tensor, t: SamplingTensors) -> SamplerOutput:
        kernel = self._kernel_for(logits)
        if kernel and not t.edits_logits:
            # Nothing edits the logits: no float32 copy, read in the model's dtype (exact);
            # the kernel reads a token mask itself.
            if t.all_greedy and t.token_bitmask is None:
                return SamplerOutput(sampled_token_ids=logits.argmax(dim=-1))
            return SamplerOutput(sampled_token_ids=_race_argmax(logits, t, t.temperatures,
                                                                t.token_bitmask))
        logits = logits.float()  # [B, V]
        raw = logits
        if t.any_penalty:
            logits = apply_penalties(logits, t)
        if t.logit_bias is not None:
            assert t.logit_bias_ids is not None
            logits = logits.index_put((t.logit_bias_ids[0], t.logit_bias_ids[1]), t.logit_bias,
                                      accumulate=True)
        if t.suppress_token_ids is not None:
            sup = t.suppress_token_ids
            # The fill value is made on the device: a host scalar tensor would mean a copy.
            logits = logits.index_put((sup[:, 0], sup[:, 1]),
                                      logits.new_full((sup.shape[0],), -math.inf))
        if t.token_bitmask is not None:
            logits = apply_token_bitmask(logits, t.token_bitmask)
        if t.all_greedy:
            tokens = logits.argmax(dim=-1)  # [B]
        elif kernel:
            tokens = self._sample_kernel(logits, t)
        else:
            greedy = logits.argmax(dim=-1)  # [B]
            tokens = torch.where(t.temperatures > 0, self._sample(logits, t), greedy)
        return self._logprobs(raw, tokens, t.max_num_logprobs)

    def sample_shard(self, logits: torch.Tensor, t: SamplingTensors, vocab_offset: int,
                     out: torch.Tensor | None = None) -> torch.Tensor:
        """Collective: this rank's logits [B, V_rank] (column j is vocab index vocab_offset + j)
        -> int64 [B], the same on every rank and as `forward` over the whole row. Each rank
        takes its shard's best and the ranks exchange one (value, index) per row."""
        assert t.temperature_only, "sharded sampling draws with temperature alone"
        if self._kernel_for(logits):
            from models.kernels.sample import race_partials

            values, indices = race_partials(logits, t.temperatures, t.seeds, t.sample_steps,
                                            vocab_offset=vocab_offset)  # [B, splits] each
        else:
            values, indices = _shard_best(logits.float(), t, vocab_offset)  # [B, 1] each
        return tp_argmax(values, indices, out)

    @staticmethod
    def _scale_and_mask(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
        """logits / T (greedy rows / 1), then the top-k, top-p and min-p masks."""
        temps = torch.where(t.temperatures > 0, t.temperatures, 1.0)  # [B]
        logits = logits / temps[:, None]  # [B, V]
        if t.any_top_k or t.any_top_p:
            logits = apply_top_k_top_p(logits, t)
        if t.any_min_p:
            logits = apply_min_p(logits, t.min_ps)
        return logits

    @staticmethod
    def _sample(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
        # Greedy rows divide by 1; their draw is discarded by the caller.
        logits = Sampler._scale_and_mask(logits, t)
        # Exponential race: argmax_i logit_i - log E_i, E_i ~ Exp(1), draws from softmax; masked
        # tokens (-inf) never win.
        return race_perturbed(logits, t.seeds, t.sample_steps).argmax(dim=-1)  # [B]

    @staticmethod
    def _sample_kernel(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
        """The draw and the greedy merge in one kernel; greedy rows (T = 0) get the argmax."""
        if not (t.any_top_k or t.any_top_p or t.any_min_p):
            return _race_argmax(logits, t, t.temperatures)
        # The masks need logits / T: divide here and let the kernel divide by 1 (exact). Every
        # mask keeps a row's maximum, so greedy rows' argmax is unchanged.
        unit = (t.temperatures > 0).to(torch.float32)  # [B], 1 sampled / 0 greedy
        return _race_argmax(Sampler._scale_and_mask(logits, t), t, unit)

    @staticmethod
    def _logprobs(raw: torch.Tensor, tokens: torch.Tensor, n: int) -> SamplerOutput:
        if n < 0:
            return SamplerOutput(sampled_token_ids=tokens)
        # Logprobs of the model's own distribution, before penalties and sampling settings.
        logp = raw.log_softmax(dim=-1)  # [B, V]
        top = logp.topk(n, dim=-1)
        return SamplerOutput(
            sampled_token_ids=tokens,
            logprobs=logp.gather(1, tokens[:, None]).squeeze(1),
            top_logprobs=top.values,
            top_token_ids=top.indices,
        )
