"""The diffusion LLMs' model layer (LLaDA, Dream): tiny checkpoints in their published formats
(tests/tiny_checkpoints.py) load through nanoserve's loader, and one flat varlen batch, without a
KV cache and over the paged one, gives transformers' logits on the same weights renamed:
LlamaForCausalLM (LLaDA; Qwen2ForCausalLM for a LLaDA with q/k/v biases) and
Qwen2ForCausalLM (Dream), run with a full, non-causal 4-D attention mask. Also: the causal
flag changes the output (and causal=True gives the causal reference), TP=2 (gloo) matches
too, checkpoints with wrong tensor names and configs nanoserve cannot run are refused.
"""

from __future__ import annotations

import dataclasses
import json
import random
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from models.attention_metadata import make_attention_metadata
from models.backends.torch_backend import TorchAttentionBackend
from models.config import ModelConfig
from models.kv_cache import allocate_kv_cache
from models.layers.attention import Attention
from models.registry import build_model, get_model_class
from tests.ranks import launch
from tests.tiny_checkpoints import DIFFUSION_MASK_TOKEN_ID, make_tiny_dream, make_tiny_llada

BLOCK_SIZE = 4
SEQ_LENS = (7, 1, 13, 20)  # one flat batch: a single token, lengths across block edges
ATOL = RTOL = 1e-4

# LLaDA's module names (modeling_llada.py's LLaDALlamaBlock) -> transformers' Llama names,
# written out here independently of models/llada.py's mapper.
_LLADA_BLOCK_TO_HF = {
    "q_proj": "self_attn.q_proj", "k_proj": "self_attn.k_proj", "v_proj": "self_attn.v_proj",
    "attn_out": "self_attn.o_proj", "attn_norm": "input_layernorm",
    "ff_norm": "post_attention_layernorm", "ff_proj": "mlp.gate_proj", "up_proj": "mlp.up_proj",
    "ff_out": "mlp.down_proj",
}
_LLADA_TOP_TO_HF = {
    "model.transformer.wte.weight": "model.embed_tokens.weight",
    "model.transformer.ln_f.weight": "model.norm.weight",
    "model.transformer.ff_out.weight": "lm_head.weight",
}


def llada_to_hf_name(name: str) -> str:
    if name in _LLADA_TOP_TO_HF:
        return _LLADA_TOP_TO_HF[name]
    match = re.fullmatch(r"model\.transformer\.blocks\.(\d+)\.(\w+)\.(weight|bias)", name)
    assert match, name
    layer, module, kind = match.groups()
    return f"model.layers.{layer}.{_LLADA_BLOCK_TO_HF[module]}.{kind}"


def llada_hf_config(raw: dict) -> tuple[str, dict]:
    """transformers' class and config for a LLaDA config.json: Llama, or Qwen2 (biases on
    q/k/v only) when include_qkv_bias."""
    arch = "Qwen2ForCausalLM" if raw["include_qkv_bias"] else "LlamaForCausalLM"
    return arch, dict(
        vocab_size=raw["embedding_size"], hidden_size=raw["d_model"],
        intermediate_size=raw["mlp_hidden_size"], num_hidden_layers=raw["n_layers"],
        num_attention_heads=raw["n_heads"], num_key_value_heads=raw["n_kv_heads"],
        max_position_embeddings=raw["max_sequence_length"], rms_norm_eps=raw["rms_norm_eps"],
        rope_parameters={"rope_type": "default", "rope_theta": raw["rope_theta"]},
        tie_word_embeddings=raw["weight_tying"], hidden_act="silu")


def dream_hf_config(raw: dict) -> tuple[str, dict]:
    keys = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads", "num_key_value_heads", "max_position_embeddings",
            "rms_norm_eps", "tie_word_embeddings", "hidden_act")
    return "Qwen2ForCausalLM", dict(
        {k: raw[k] for k in keys},
        rope_parameters={"rope_type": "default", "rope_theta": raw["rope_theta"]})


@dataclasses.dataclass(frozen=True)
class Family:
    id: str
    make: Callable[..., Path]
    make_kwargs: dict
    hf_config: Callable[[dict], tuple[str, dict]]
    to_hf_name: Callable[[str], str]
    predicts_next_token: bool


FAMILIES = [
    Family("llada", make_tiny_llada, {}, llada_hf_config, llada_to_hf_name, False),
    # GQA, q/k/v biases and a tied output layer (no model.transformer.ff_out).
    Family("llada-gqa_qkv_bias_tied", make_tiny_llada,
           dict(n_kv_heads=2, include_qkv_bias=True, weight_tying=True),
           llada_hf_config, llada_to_hf_name, False),
    Family("dream", make_tiny_dream, {}, dream_hf_config, lambda name: name, True),
]


@dataclasses.dataclass
class Built:
    family: Family
    model_dir: Path
    seqs: list[list[int]]
    reference: list[torch.Tensor]  # transformers' non-causal logits per sequence [L, vocab]
    causal_reference: list[torch.Tensor]  # the same with its default causal mask


def hf_model(family: Family, model_dir: Path) -> torch.nn.Module:
    import transformers

    raw = json.loads((model_dir / "config.json").read_text())
    arch, kwargs = family.hf_config(raw)
    config = getattr(transformers, arch.replace("ForCausalLM", "Config"))(**kwargs)
    model = getattr(transformers, arch)(config).float().eval()
    state = {family.to_hf_name(k): v for k, v in load_file(model_dir / "model.safetensors").items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected, unexpected
    assert set(missing) <= ({"lm_head.weight"} if config.tie_word_embeddings else set()), missing
    assert torch.equal(model.lm_head.weight, state.get("lm_head.weight",
                                                      state["model.embed_tokens.weight"]))
    return model


@torch.no_grad()
def hf_logits(model: torch.nn.Module, seq: list[int], causal: bool) -> torch.Tensor:
    ids = torch.tensor([seq])
    # A prepared 4-D float mask is used as is: zeros let every token see every other one.
    mask = None if causal else torch.zeros(1, 1, len(seq), len(seq))
    out = model(input_ids=ids, attention_mask=mask, position_ids=torch.arange(len(seq))[None])
    return out.logits[0]


def make_built(family: Family, root: Path) -> Built:
    model_dir = family.make(root / family.id, seed=7, **family.make_kwargs)
    rng = random.Random(family.id)
    # Ordinary ids with some mask tokens among them, as a diffusion step sees them.
    seqs = [[rng.choice([rng.randrange(DIFFUSION_MASK_TOKEN_ID), DIFFUSION_MASK_TOKEN_ID])
             for _ in range(n)] for n in SEQ_LENS]
    model = hf_model(family, model_dir)
    return Built(family, model_dir, seqs, [hf_logits(model, s, causal=False) for s in seqs],
                 [hf_logits(model, s, causal=True) for s in seqs])


@pytest.fixture(scope="module")
def every_family(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Built]:
    root = tmp_path_factory.mktemp("diffusion")
    return {family.id: make_built(family, root) for family in FAMILIES}


@pytest.fixture(params=[f.id for f in FAMILIES])
def built(request: pytest.FixtureRequest, every_family: dict[str, Built]) -> Built:
    return every_family[request.param]


def build(model_dir: Path, causal: bool | None = None) -> torch.nn.Module:
    config = ModelConfig.from_dir(model_dir)
    if causal is not None:
        config = dataclasses.replace(config, causal=causal)
    return build_model(config, str(model_dir), TorchAttentionBackend(), torch.device("cpu"),
                       torch.float32, seed=0, load_format="safetensors")


def flat_batch(seqs: list[list[int]], starts: list[int], tables: list[list[int]]
               ) -> tuple[torch.Tensor, torch.Tensor, object]:
    """input_ids, positions and metadata of one flat step: row b's tokens starts[b]: (the
    last ones of its context) over the context seqs[b]."""
    ids = torch.tensor([t for seq, s in zip(seqs, starts, strict=True) for t in seq[s:]])
    positions = torch.cat([torch.arange(s, len(seq)) for seq, s in zip(seqs, starts,
                                                                       strict=True)])
    meta = make_attention_metadata([len(seq) - s for seq, s in zip(seqs, starts, strict=True)],
                                   [len(seq) for seq in seqs], tables, BLOCK_SIZE)
    return ids, positions, meta


@torch.no_grad()
def run(model: torch.nn.Module, seqs: list[list[int]], starts: list[int] | None = None,
        tables: list[list[int]] | None = None) -> list[torch.Tensor]:
    """Each row's logits [len - start, vocab] from one forward over the flat batch."""
    starts = starts or [0] * len(seqs)
    if tables is None:  # no cache: the tables only feed the unused slot mapping
        tables = [list(range(-(-len(seq) // BLOCK_SIZE))) for seq in seqs]
    ids, positions, meta = flat_batch(seqs, starts, tables)
    logits = model.compute_logits(model(ids, positions, meta))
    return list(logits.split([len(seq) - s for seq, s in zip(seqs, starts, strict=True)]))


def assert_rows_close(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    for row, (g, w) in enumerate(zip(got, want, strict=True)):
        torch.testing.assert_close(g, w, atol=ATOL, rtol=RTOL, msg=lambda m, r=row: f"row {r}: {m}")


def test_config_exposes_diffusion(built: Built) -> None:
    config = ModelConfig.from_dir(built.model_dir)
    assert config.is_diffusion and not config.causal
    assert config.mask_token_id == DIFFUSION_MASK_TOKEN_ID
    model_cls = get_model_class(config)
    assert model_cls.predicts_next_token is built.family.predicts_next_token
    assert all(not attn.causal for attn in build(built.model_dir).attention_layers())
    plain = ModelConfig(vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
                        num_attention_heads=1, num_key_value_heads=1, head_dim=8)
    assert not plain.is_diffusion and plain.causal and plain.mask_token_id is None


def test_no_cache_matches_transformers(built: Built) -> None:
    """The profiling-pass path (Attention.kv_cache None): one flat batch of every row."""
    assert_rows_close(run(build(built.model_dir), built.seqs), built.reference)


def test_paged_cache_matches_transformers(built: Built) -> None:
    """Over a paged KV cache set up as the engine does, with shuffled block tables: the whole
    rows, then a second step of each row's last tokens (a single one for some) attending to
    the cached context before them and to each other."""
    model = build(built.model_dir)
    need = [-(-len(seq) // BLOCK_SIZE) for seq in built.seqs]
    blocks = list(range(sum(need) + 3))
    random.Random(0).shuffle(blocks)
    tables = [blocks[sum(need[:i]):sum(need[:i + 1])] for i in range(len(need))]
    allocate_kv_cache(model, len(blocks), BLOCK_SIZE, torch.float32, torch.device("cpu"))
    assert_rows_close(run(model, built.seqs, tables=tables), built.reference)
    starts = [len(seq) - q for seq, q in zip(built.seqs, (3, 1, 5, 1), strict=True)]
    want = [ref[s:] for ref, s in zip(built.reference, starts, strict=True)]
    assert_rows_close(run(model, built.seqs, starts, tables), want)


def test_causal_flag_matters(built: Built) -> None:
    """Built causal, the same checkpoint gives transformers' causal logits, which differ from
    the bidirectional ones on every row longer than one token."""
    causal = run(build(built.model_dir, causal=True), built.seqs)
    assert_rows_close(causal, built.causal_reference)
    for seq, c, ref in zip(built.seqs, causal, built.reference, strict=True):
        if len(seq) > 1:
            assert (c - ref).abs().max() > 1e-2


def _tp_rank(rank: int, world_size: int, cases: list[tuple[str, list[list[int]]]],
             out_path: str) -> None:
    logits = [run(build(Path(model_dir)), seqs) for model_dir, seqs in cases]
    if rank == 0:  # a file: launch's result pipe would block on this much data
        torch.save(logits, out_path)


@pytest.mark.slow
def test_tensor_parallel_matches(every_family: dict[str, Built], tmp_path: Path) -> None:
    """TP=2 on gloo (one launch for every family): heads, FFN and vocabulary split over two
    ranks give transformers' logits too."""
    builts = list(every_family.values())
    out_path = tmp_path / "logits.pt"
    launch(_tp_rank, 2, [(str(b.model_dir), b.seqs) for b in builts], str(out_path),
           backend="gloo")
    for b, rows in zip(builts, torch.load(out_path), strict=True):
        assert_rows_close(rows, b.reference)


# ---------------------------------------------------------------- refusals


_DELETE = object()  # _copy_checkpoint: remove this config key


def _copy_checkpoint(src: Path, dst: Path, edit_tensors: Callable[[dict], None] | None = None,
                     **config_changes: object) -> Path:
    shutil.copytree(src, dst)
    if edit_tensors is not None:
        tensors = load_file(dst / "model.safetensors")
        edit_tensors(tensors)
        save_file(tensors, dst / "model.safetensors")
    raw = json.loads((dst / "config.json").read_text())
    for key, value in config_changes.items():
        if value is _DELETE:
            raw.pop(key)
        else:
            raw[key] = value
    (dst / "config.json").write_text(json.dumps(raw))
    return dst


def _rename(old: str, new: str) -> Callable[[dict], None]:
    def edit(tensors: dict) -> None:
        tensors[new] = tensors.pop(old)
    return edit


@pytest.mark.parametrize("family_id, old, new", [
    ("llada", "model.transformer.blocks.1.ff_proj.weight",
     "model.transformer.blocks.1.ff_gate.weight"),
    ("llada", "model.transformer.ff_out.weight", "lm_head.weight"),
    ("dream", "model.layers.0.self_attn.k_proj.bias", "model.layers.0.self_attn.k_bias"),
])
def test_wrong_tensor_name_is_refused(family_id: str, old: str, new: str,
                                      tmp_path: Path) -> None:
    family = next(f for f in FAMILIES if f.id == family_id)
    src = family.make(tmp_path / "src", seed=1, **family.make_kwargs)
    bad = _copy_checkpoint(src, tmp_path / "bad", _rename(old, new))
    with pytest.raises(ValueError) as err:
        build(bad)
    message = str(err.value)
    assert f"missing tensors: {old}" in message, message
    assert f"unexpected tensors: {new}" in message, message


@pytest.mark.parametrize("family_id, changes, match", [
    ("llada", dict(block_type="sequential"), "block_type=\"sequential\""),
    ("llada", dict(block_type=_DELETE), "block_type=\"sequential\""),  # LLaDA's default
    ("llada", dict(activation_type="swiglu"), "activation_type"),
    ("llada", dict(layer_norm_type="default"), "layer_norm_type"),
    ("llada", dict(rope=False), "rope=false"),
    ("llada", dict(alibi=True), "alibi=true"),
    ("llada", dict(include_bias=True), "include_bias=true"),
    ("llada", dict(bias_for_layer_norm=True), "bias_for_layer_norm=true"),
    ("llada", dict(attention_layer_norm=True), "attention_layer_norm=true"),
    ("llada", dict(input_emb_norm=True), "input_emb_norm=true"),
    ("llada", dict(scale_logits=True), "scale_logits=true"),
    ("llada", dict(block_group_size=2), "block_group_size=2"),
    ("llada", dict(multi_query_attention=True), "n_kv_heads=4 contradicts"),
    ("llada", dict(embedding_size=64), "embedding_size \\(64\\) must be at least"),
    ("llada", dict(mask_token_id=999), "mask_token_id 999 is outside"),
    ("llada", dict(mask_token_id=_DELETE), "mask_token_id 50256 is outside"),
    ("llada", dict(d_model=_DELETE), "config has no d_model"),
    ("dream", dict(head_dim=32), "head_dim=32 is not supported for DreamModel"),
    ("dream", dict(use_sliding_window=True, sliding_window=16), "sliding_window=16"),
    ("dream", dict(mask_token_id=129), "mask_token_id 129 is outside"),
])
def test_unsupported_config_is_refused(family_id: str, changes: dict, match: str,
                                       tmp_path: Path) -> None:
    family = next(f for f in FAMILIES if f.id == family_id)
    src = family.make(tmp_path / "src", seed=1, **family.make_kwargs)
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_dir(_copy_checkpoint(src, tmp_path / "bad", **changes))


def test_backend_without_non_causal_is_refused_at_build() -> None:
    class CausalOnly:
        name = "causal-only"

    Attention(4, 2, 16, 0.25, CausalOnly())  # causal: fine
    with pytest.raises(ValueError, match="attention_backend='causal-only' does not support"):
        Attention(4, 2, 16, 0.25, CausalOnly(), causal=False)
