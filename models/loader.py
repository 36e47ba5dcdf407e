"""Load Hugging Face safetensors checkpoints into the (tensor-parallel) model: each tensor is
opened lazily and handed to its parameter's `weight_loader`, which reads only this rank's shard;
a family whose checkpoint names its modules otherwise (LLaDA) renames them to Llama's through
its `weights_mapper`, and separate projections map onto fused parameters through the model's
`packed_modules_mapping`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from models.layers.fused_moe import FusedMoE
from models.layers.layernorm import RMSNorm
from models.parallel import WeightSource, check_shape, full_weight

INDEX_FILE = "model.safetensors.index.json"


@dataclass(frozen=True)
class WeightsMapper:
    """Checkpoint tensor names -> the model's (HF Llama-style) names: the first matching prefix
    rule, then the first matching substring rule. With prefix rules, a name under none of them
    is not the family's (None: unexpected). Each side of a rule must be unique, so
    `to_checkpoint` undoes `to_model` (errors name tensors as the checkpoint does)."""

    orig_to_new_prefix: dict[str, str] = field(default_factory=dict)
    orig_to_new_substr: dict[str, str] = field(default_factory=dict)

    def to_model(self, name: str) -> str | None:
        return self._map(name, list(self.orig_to_new_prefix.items()),
                         list(self.orig_to_new_substr.items()))

    def to_checkpoint(self, name: str) -> str:
        mapped = self._map(name, [(new, old) for old, new in self.orig_to_new_prefix.items()],
                           [(new, old) for old, new in self.orig_to_new_substr.items()])
        return mapped or name

    @staticmethod
    def _map(name: str, prefixes: list[tuple[str, str]],
             substrings: list[tuple[str, str]]) -> str | None:
        if prefixes:
            rule = next(((o, n) for o, n in prefixes if name.startswith(o)), None)
            if rule is None:
                return None
            name = rule[1] + name[len(rule[0]):]
        for old, new in substrings:
            if old in name:
                return name.replace(old, new, 1)
        return name


_IDENTITY = WeightsMapper()


def default_weight_loader(param: nn.Parameter, loaded_weight: WeightSource,
                          shard_id: str | int | None = None) -> None:
    """Replicated parameters (norms): copy the whole tensor."""
    check_shape(param, tuple(param.shape), loaded_weight, "replicated parameter")
    param.data.copy_(full_weight(loaded_weight))


def checkpoint_files(model_dir: str | Path) -> list[Path]:
    """The checkpoint's safetensors files: those the index names, else every *.safetensors."""
    model_dir = Path(model_dir)
    index = model_dir / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
        absent = [str(f) for f in files if not f.is_file()]
        if absent:
            raise ValueError(f"{index} names files that do not exist: {absent}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors files in model directory {str(model_dir)!r}")
    return files


def _target(name: str, mapping: dict[str, tuple[str, str | int]]
            ) -> tuple[str, str | int | tuple[int, str] | None]:
    """HF tensor name -> (model parameter name, shard id or None)."""
    expert = FusedMoE.checkpoint_target(name)
    if expert is not None:
        return expert
    for hf_module, (fused, shard_id) in mapping.items():
        key = f".{hf_module}."
        if key in name:
            return name.replace(key, f".{fused}."), shard_id
    return name, None


def _expected_sources(params: dict[str, nn.Parameter],
                      mapping: dict[str, tuple[str, str | int]],
                      num_experts: int) -> dict[tuple, str]:
    """Every (parameter, shard id) the checkpoint must provide -> the HF name it comes from."""
    expected: dict[tuple, str] = {}
    by_param = {param: [(hf, which) for hf, (p, which) in FusedMoE.PROJECTIONS.items()
                        if p == param] for param, _ in FusedMoE.PROJECTIONS.values()}
    for name in params:
        prefix, _, leaf = name.rpartition(".experts.")
        if leaf in by_param:  # every expert, also those another rank holds
            for e in range(num_experts):
                for hf, which in by_param[leaf]:
                    expected[(name, (e, which))] = f"{prefix}.experts.{e}.{hf}.weight"
            continue
        fused_hits = [(hf, shard) for hf, (fused, shard) in mapping.items()
                      if f".{fused}." in name]
        if not fused_hits:
            expected[(name, None)] = name
        for hf_module, shard_id in fused_hits:
            fused = mapping[hf_module][0]
            expected[(name, shard_id)] = name.replace(f".{fused}.", f".{hf_module}.")
    return expected


@torch.no_grad()
def load_weights(model: nn.Module, model_dir: str | Path) -> None:
    """Fill every parameter of `model` from the checkpoint in `model_dir`; ValueError names
    the missing, unexpected or misshapen tensors."""
    mapping: dict[str, tuple[str, str | int]] = getattr(model, "packed_modules_mapping", {})
    mapper: WeightsMapper = getattr(model, "weights_mapper", None) or _IDENTITY
    config = getattr(model, "config", None)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    params = dict(model.named_parameters())  # a tied lm_head.weight appears once, as embed
    expected = _expected_sources(params, mapping, getattr(config, "num_experts", 0))
    loaded: set[tuple] = set()
    unexpected: list[str] = []
    for path in checkpoint_files(model_dir):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for hf_name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                model_name = mapper.to_model(hf_name)
                if model_name is None:
                    unexpected.append(hf_name)
                    continue
                if tied and model_name == "lm_head.weight":
                    continue  # some tied checkpoints store the copy anyway
                if "rotary_emb.inv_freq" in hf_name:
                    continue  # old checkpoints saved this recomputed buffer
                name, shard_id = _target(model_name, mapping)
                param = params.get(name)
                if param is None or (name, shard_id) not in expected:
                    unexpected.append(hf_name)
                    continue
                loader = getattr(param, "weight_loader", default_weight_loader)
                try:
                    if shard_id is None:
                        loader(param, f.get_slice(hf_name))
                    else:
                        loader(param, f.get_slice(hf_name), shard_id)
                except ValueError as exc:
                    raise ValueError(f"{path.name}: tensor {hf_name!r}: {exc}") from exc
                loaded.add((name, shard_id))
    missing = sorted(mapper.to_checkpoint(src) for key, src in expected.items()
                     if key not in loaded)
    problems = []
    if missing:
        problems.append(f"missing tensors: {', '.join(missing)}")
    if unexpected:
        problems.append(f"unexpected tensors: {', '.join(sorted(unexpected))}")
    if problems:
        raise ValueError(f"checkpoint in {str(model_dir)!r} does not match "
                         f"{type(model).__name__}: " + "; ".join(problems))


@torch.no_grad()
def init_dummy_weights(model: nn.Module, seed: int = 0) -> None:
    """Random weights for `--load-format dummy` (benchmarks): uniform(-1e-3, 1e-3) as vLLM
    draws them, RMSNorm weights 1. Greedy output then falls into loops, as a real model's
    can, which gives prompt lookup work. Deterministic for a seed (each rank draws for its
    own shard)."""
    norm_weights = {id(m.weight) for m in model.modules() if isinstance(m, RMSNorm)}
    generators: dict[torch.device, torch.Generator] = {}
    for _, param in sorted(model.named_parameters()):
        if id(param) in norm_weights:
            param.data.fill_(1.0)
            continue
        gen = generators.get(param.device)
        if gen is None:
            gen = generators[param.device] = torch.Generator(param.device).manual_seed(seed)
        param.data.uniform_(-1e-3, 1e-3, generator=gen)
