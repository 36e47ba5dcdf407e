"""`nanoserve bench diffusion`: tokens/s of a masked-diffusion LLM (LLaDA) decoded block by
block, greedy with low_confidence remasking, by the plain reference loop (LLaDA's generate.py:
the dense canvas recomputed every pass, on the engine's own weights) and by the diffusion
engine under each of VARIANTS; also forward passes per token, and agreement with the engine's
exact ('none') run of the same batch size. Each run follows a warm-up of the same shapes.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import random
import time
from dataclasses import dataclass

import torch

from benchmarks.model_configs import PRESETS, resolve_model
from benchmarks.results import record
from engine_service.common.sampling_params import DiffusionParams
from engine_service.config import ATTENTION_BACKENDS, DEVICES, DTYPES, LOAD_FORMATS

PLAIN = "plain"
# Engine variants: DiffusionParams fields over the run's gen_length, steps and block_length.
VARIANTS: dict[str, dict] = {
    "none": {"dllm_cache": "none"},
    "prefix": {"dllm_cache": "prefix"},
    "dual": {"dllm_cache": "dual"},
    "threshold": {"confidence_threshold": 0.9},
    "sparse": {"dllm_cache": "dual", "retention_ratio": 0.5, "delay_step": 1},
}
REFERENCE = "none"  # agreement is measured against the exact engine run
RANDOM_WEIGHTS_NOTE = ("random weights: the confidences are unlike a trained model's (near "
                       "uniform, so a threshold hardly ever fires and rounding alone can flip a "
                       "prediction): forward passes per token and agreement between variants "
                       "do not carry over to a trained LLaDA")


@dataclass
class Run:
    batch: int
    variant: str
    tokens: list[list[int]]  # generated tokens per request
    seconds: float
    passes: int  # forward passes, summed over the requests
    agreement: float | None = None  # with the REFERENCE run of the same batch size

    @property
    def num_tokens(self) -> int:
        return sum(map(len, self.tokens))

    @property
    def tokens_per_s(self) -> float:
        return self.num_tokens / max(self.seconds, 1e-9)

    @property
    def passes_per_token(self) -> float:
        return self.passes / max(self.num_tokens, 1)

    def line(self) -> str:
        agree = "" if self.agreement is None else \
            f", agreement with {REFERENCE} {self.agreement:.4f}"
        return (f"batch {self.batch} {self.variant}: {self.tokens_per_s:.1f} tok/s "
                f"({self.num_tokens} tokens in {self.seconds:.2f} s), "
                f"{self.passes_per_token:.3f} forward passes/token{agree}")


def _csv_ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def _variants(text: str) -> list[str]:
    names = [x for x in text.split(",") if x]
    if not names or not set(names) <= {PLAIN, *VARIANTS}:
        raise argparse.ArgumentTypeError(f"choose from {[PLAIN, *VARIANTS]}")
    return names


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.ArgumentDefaultsHelpFormatter
    add = parser.add_argument
    add("--model", required=True,
        help=f"a LLaDA model directory, or a preset with dummy weights: {', '.join(PRESETS)}")
    add("--batch-sizes", type=_csv_ints, default=[1, 32], metavar="B,B",
        help="requests decoded at once, one set of runs each")
    add("--gen-length", type=int, default=256)
    add("--steps", type=int, default=256)
    add("--block-length", type=int, default=32)
    add("--prompt-len", type=int, default=64, help="random prompt ids (fixed seed)")
    add("--variants", type=_variants, default=[PLAIN, *VARIANTS], metavar="V,V",
        help=f"of {', '.join([PLAIN, *VARIANTS])}")
    add("--device", default="auto", choices=DEVICES)
    add("--dtype", default="auto", choices=DTYPES)
    add("--attention-backend", default="auto", choices=ATTENTION_BACKENDS)
    add("--load-format", default="auto", choices=LOAD_FORMATS,
        help="dummy: random weights (a preset always runs with them)")
    add("--kv-block-size", type=int, default=16)
    add("--seed", type=int, default=0, help="of the prompts and the dummy weights")
    add("--no-record", action="store_true", help="do not log the figures")


# ---------------------------------------------------------------- the engine


def build_llm(args: argparse.Namespace):
    """One LLM for every engine run: KV blocks, batch and token budget for the largest batch
    of whole canvases (caches off forwards every canvas every pass)."""
    from engine_service import LLM

    canvas = args.prompt_len + args.gen_length
    batch = max(args.batch_sizes)
    return LLM(args.model, device=args.device, dtype=args.dtype,
               attention_backend=args.attention_backend, load_format=args.load_format,
               kv_block_size=args.kv_block_size, max_model_len=canvas, max_num_seqs=batch,
               # Dream's cached passes may query one scoring row more per request.
               max_num_batched_tokens=batch * (canvas + 1),
               num_kv_blocks=batch * -(-canvas // args.kv_block_size), seed=args.seed)


def engine_run(llm, prompts: list[list[int]], params: DiffusionParams
               ) -> tuple[list[list[int]], int, float]:
    """(generated tokens per request, forward passes summed over them, wall seconds) of one
    batch through the engine's step loop, every request added at once."""
    from engine_service import SamplingParams
    from engine_service.block_manager import BlockManager

    engine = llm.engine
    assert not engine.has_unfinished() and engine.block_manager.all_free()
    # Cold prefix cache: no run may reuse the prompt KV an earlier run left cached.
    bm = engine.block_manager
    engine.block_manager = BlockManager(bm.num_blocks, bm.block_size)
    sp = SamplingParams(diffusion=params, ignore_eos=True, seed=0)
    ids = [f"diffusion-bench-{next(_request_ids)}" for _ in prompts]
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    passes: dict[str, int] = {}
    _sync(llm.engine.model_runner.device)
    t0 = time.perf_counter()
    for rid, prompt in zip(ids, prompts, strict=True):
        engine.add_request(rid, prompt, sp)
    while engine.has_unfinished():
        for out in engine.step():  # host lists: each step has finished on the device
            tokens[out.request_id] += out.new_token_ids
            passes[out.request_id] = out.num_forward_passes
    seconds = time.perf_counter() - t0
    return [tokens[rid] for rid in ids], sum(passes.values()), seconds


_request_ids = itertools.count()


# ---------------------------------------------------------------- the plain reference loop


def dense_model(llm) -> torch.nn.Module:
    """transformers' Llama (Qwen2 where q/k/v carry biases) over the engine's LLaDA weights,
    as views of its fused tensors: nothing copied, so both run the very same weights."""
    import transformers

    runner = llm.engine.model_runner
    mc = runner.model_config
    if mc.architecture != "LLaDAModelLM":
        raise ValueError(f"the plain loop runs LLaDA (logits at i score i), not "
                         f"{mc.architecture}")
    if runner.tp is not None:
        raise ValueError("the plain loop needs the whole model on one device (no TP)")
    family = "Qwen2" if mc.attention_bias else "Llama"
    config = getattr(transformers, f"{family}Config")(
        vocab_size=mc.vocab_size, hidden_size=mc.hidden_size,
        intermediate_size=mc.intermediate_size, num_hidden_layers=mc.num_hidden_layers,
        num_attention_heads=mc.num_attention_heads, num_key_value_heads=mc.num_key_value_heads,
        head_dim=mc.head_dim, max_position_embeddings=mc.max_position_embeddings,
        rms_norm_eps=mc.rms_norm_eps, hidden_act="silu",
        rope_parameters={"rope_type": "default", "rope_theta": mc.rope_theta},
        tie_word_embeddings=mc.tie_word_embeddings, attn_implementation="sdpa")
    with torch.device("meta"):
        dense = getattr(transformers, f"{family}ForCausalLM")(config)
    dense.load_state_dict(_dense_state(runner.model, mc), assign=True)
    # Its rotary buffers are not weights: build them for real, where the weights are.
    dense.model.rotary_emb = type(dense.model.rotary_emb)(config).to(runner.device)
    return dense.eval()


def _dense_state(model: torch.nn.Module, mc) -> dict[str, torch.Tensor]:
    """transformers' parameter names -> views of nanoserve's (q/k/v and gate/up unfused)."""
    q, kv = mc.num_attention_heads * mc.head_dim, mc.num_key_value_heads * mc.head_dim
    state = {"model.embed_tokens.weight": model.model.embed_tokens.weight,
             "model.norm.weight": model.model.norm.weight,
             "lm_head.weight": model.lm_head.weight}
    for i, layer in enumerate(model.model.layers):
        pre = f"model.layers.{i}."
        attn, mlp = layer.self_attn, layer.mlp
        for kind in ("weight", "bias"):
            fused = getattr(attn.qkv_proj, kind, None)
            if fused is not None:
                for name, part in zip("qkv", fused.split([q, kv, kv]), strict=True):
                    state[f"{pre}self_attn.{name}_proj.{kind}"] = part
        gate, up = mlp.gate_up_proj.weight.split(mc.intermediate_size)
        state |= {f"{pre}self_attn.o_proj.weight": attn.o_proj.weight,
                  f"{pre}mlp.gate_proj.weight": gate, f"{pre}mlp.up_proj.weight": up,
                  f"{pre}mlp.down_proj.weight": mlp.down_proj.weight,
                  f"{pre}input_layernorm.weight": layer.input_layernorm.weight,
                  f"{pre}post_attention_layernorm.weight":
                      layer.post_attention_layernorm.weight}
    return state


@torch.inference_mode()
def plain_loop(model: torch.nn.Module, prompts: list[list[int]], p: DiffusionParams,
               mask_id: int) -> tuple[list[list[int]], int]:
    """(generated tokens per request, forward passes summed over them) by LLaDA's block-wise
    loop, greedy with low_confidence remasking: every pass recomputes the whole [B, L] canvas
    and unmasks, in the current block, the most confident masked positions (ties: the lower
    position, as the engine breaks them), as many as LLaDA's even schedule gives that pass."""
    device = model.lm_head.weight.device
    num_prompt = len(prompts[0])
    assert all(len(x) == num_prompt for x in prompts), "a dense batch: equal prompt lengths"
    x = torch.full((len(prompts), num_prompt + p.gen_length), mask_id, dtype=torch.long,
                   device=device)  # [B, L]
    x[:, :num_prompt] = torch.tensor(prompts, device=device)
    b, length = x.shape
    # A 4-D additive mask of zeros is used as given: every position attends to every other.
    mask = torch.zeros(b, 1, length, length, dtype=model.lm_head.weight.dtype, device=device)
    positions = torch.arange(length, device=device).expand(b, length)
    base, extra = divmod(p.block_length, p.steps_per_block)
    schedule = [base + (i < extra) for i in range(p.steps_per_block)]
    for block in range(p.num_blocks):
        start = num_prompt + block * p.block_length
        canvas = x[:, start:start + p.block_length]  # [B, n], a view: writes land in x
        for count in schedule:
            logits = model(input_ids=x, attention_mask=mask, position_ids=positions,
                           use_cache=False).logits  # [B, L, V]
            scores = logits[:, start:start + p.block_length].float()  # [B, n, V]
            scores[..., mask_id] = -torch.inf  # never predict the mask itself
            predicted = scores.argmax(-1)  # [B, n]
            chosen = scores.gather(-1, predicted[..., None]).squeeze(-1)
            confidence = (chosen - scores.logsumexp(-1)).exp()  # [B, n]
            confidence = confidence.masked_fill(canvas != mask_id, -torch.inf)
            order = confidence.sort(dim=-1, descending=True, stable=True).indices[:, :count]
            canvas.scatter_(1, order, predicted.gather(1, order))
    return x[:, num_prompt:].tolist(), b * p.steps


# ---------------------------------------------------------------- runs


def make_prompts(batch: int, length: int, mask_id: int, seed: int, tag: str
                 ) -> list[list[int]]:
    """Random ids below the mask token (LLaDA's ordinary tokens), one set per tag."""
    rng = random.Random(f"{tag}-{seed}-{batch}-{length}")
    return [[rng.randrange(mask_id) for _ in range(length)] for _ in range(batch)]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _warm_up_params(p: DiffusionParams) -> DiffusionParams:
    """The same canvas and blocks in two passes a block (a refresh and a cached pass under a
    dLLM cache): every shape of the run, a fraction of its passes."""
    return dataclasses.replace(p, steps=min(p.steps, 2 * p.num_blocks))


def one_run(llm, dense: torch.nn.Module | None, variant: str, batch: int,
            args: argparse.Namespace) -> Run:
    """A warm-up on other prompts, then the timed run."""
    mask_id = llm.engine.mask_token_id
    base = DiffusionParams(gen_length=args.gen_length, steps=args.steps,
                           block_length=args.block_length)
    params = base if variant == PLAIN else dataclasses.replace(base, **VARIANTS[variant])
    device = llm.engine.model_runner.device

    def go(prompts: list[list[int]], p: DiffusionParams) -> tuple[list[list[int]], int, float]:
        if variant != PLAIN:
            return engine_run(llm, prompts, p)
        _sync(device)
        t0 = time.perf_counter()
        tokens, passes = plain_loop(dense, prompts, p, mask_id)  # ends on the host
        return tokens, passes, time.perf_counter() - t0

    go(make_prompts(batch, args.prompt_len, mask_id, args.seed, "warm-up"),
       _warm_up_params(params))
    tokens, passes, seconds = go(make_prompts(batch, args.prompt_len, mask_id, args.seed,
                                              "timed"), params)
    assert all(len(t) == args.gen_length for t in tokens), \
        f"expected {args.gen_length} tokens a request (ignore_eos)"
    return Run(batch, variant, tokens, seconds, passes)


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Fraction of generated positions holding the same token."""
    pairs = [(x, y) for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=True)]
    return sum(x == y for x, y in pairs) / max(len(pairs), 1)


def run(args: argparse.Namespace) -> list[Run]:
    """Every batch size x variant, the exact engine run first (agreement's reference); a
    line per run as it ends."""
    args.model, is_preset = resolve_model(args.model)
    if is_preset:
        args.load_format = "dummy"
    llm = build_llm(args)
    dense = dense_model(llm) if PLAIN in args.variants else None
    order = sorted(args.variants, key=lambda v: v != REFERENCE)  # stable: the rest as given
    if args.load_format == "dummy":
        print(RANDOM_WEIGHTS_NOTE, flush=True)
    runs: list[Run] = []
    for batch in args.batch_sizes:
        reference = None
        for variant in order:
            result = one_run(llm, dense, variant, batch, args)
            if variant == REFERENCE:
                reference = result
            elif reference is not None:
                result.agreement = agreement(result.tokens, reference.tokens)
            runs.append(result)
            print(result.line(), flush=True)
    return runs


def main(args: argparse.Namespace) -> int:
    runs = run(args)
    if not args.no_record:
        figures = {f"batch {r.batch} {r.variant}": r.line().split(": ", 1)[1] for r in runs}
        if args.load_format == "dummy":
            figures["note"] = RANDOM_WEIGHTS_NOTE
        record(f"diffusion decoding (gen_length {args.gen_length}, steps {args.steps}, "
               f"block_length {args.block_length}, prompt {args.prompt_len})", figures)
    return 0
