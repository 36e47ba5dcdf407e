"""Tokenizer (tokenizers + jinja2, no transformers) and the incremental detokenizer.

References: transformers.AutoTokenizer on the same files, tokenizer.decode on the whole id
list, and plain string scanning for stop strings.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import jinja2
import pytest
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders, models, normalizers, pre_tokenizers, processors, trainers

from engine_service.common.detokenizer import DetokenizerUpdate, IncrementalDetokenizer
from engine_service.common.tokenizer import TOKENIZER_FILES, Tokenizer

MULTIBYTE = "héllo wörld 你好 🙂"
TEXTS = [
    "Hello, world! How are you today?",
    MULTIBYTE,
    "Grüße aus Zürich — naïve café, 日本語のテキスト, emoji 🙂🙃🚀 and 𝔘𝔫𝔦𝔠𝔬𝔡𝔢.",
    "def add(a, b):\n    return a + b\n\n\tindented\r\nlines   with  spaces ",
    "<|im_start|>user\nspecial tokens inside text<|im_end|>\n",
]
CORPUS = [
    "héllo wörld 你好 🙂 hello world",
    "Grüße aus Zürich, naïve café, crème brûlée.",
    "日本語のテキストと中文的文本, 你好世界, 再见.",
    "emoji party 🙂🙃🚀🎉 with friends and family",
    "The quick brown fox jumps over the lazy dog. Stop here, then go on.",
    "def add(a, b):\n    return a + b\n",
] * 4
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<s>"]

# Exercises the environment transformers renders with: trim/lstrip blocks, loop controls,
# namespace, raise_exception, a non-escaping tojson, the {% generation %} tag, bos_token, kwargs.
RICH_TEMPLATE = """{{ bos_token }}
{%- set ns = namespace(n=0) %}
{%- for m in messages %}
    {%- if m['role'] not in ['system', 'user', 'assistant'] %}
        {{- raise_exception('unknown role: ' + m['role']) }}
    {%- endif %}
    {%- if m['content'] == '' %}{% continue %}{% endif %}
    {%- set ns.n = ns.n + 1 %}
<|im_start|>{{ m['role'] }}
    {% if m['name'] is defined %}({{ m['name'] }}){% endif %}
{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}{% endgeneration %}
{%- else %}{{ m['content'] }}{% endif %}<|im_end|>
{% endfor %}
{%- if tools %}
<|im_start|>tools
{{ tools | tojson }}<|im_end|>
{% endif %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and not enable_thinking %}<think>

</think>

{% endif %}
{%- endif %}
[{{ ns.n }} messages]"""

CHATS = [
    [{"role": "user", "content": "Hi there! 你好 🙂"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is 2+2?", "name": None},
        {"role": "user", "content": "hello", "name": "ann"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": ""},
        {"role": "user", "content": "And <b>3+3</b>?"},
    ],
]


# ---- tokenizer directories ------------------------------------------------------------------


def _write_dir(out: Path, backend: BackendTokenizer, config: dict,
               extra: dict | None = None) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    backend.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    for name, obj in (extra or {}).items():
        (out / name).write_text(obj if isinstance(obj, str) else json.dumps(obj))
    return out


def _byte_level_dir(out: Path) -> Path:
    """Byte-level BPE with merged multi-byte tokens (some end mid-character), a BOS-adding post
    processor, special tokens the config names but tokenizer.json lacks, and a rich template."""
    tok = BackendTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=700, special_tokens=SPECIALS, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS, trainer=trainer)
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A $B", special_tokens=[("<s>", bos)]
    )
    # Padding saved in tokenizer.json: transformers does not pad a single encode; neither may we.
    pad = tok.token_to_id("<|endoftext|>")
    tok.enable_padding(pad_id=pad, pad_token="<|endoftext|>", length=64)
    decoder_entries = {
        str(tok.token_to_id(t)): {"content": t, "lstrip": False, "rstrip": False,
                                  "normalized": False, "single_word": False, "special": True}
        for t in SPECIALS
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": {"__type": "AddedToken", "content": "<|im_end|>", "lstrip": False,
                      "rstrip": False, "normalized": False, "single_word": False},
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>", "<tool_call>"],
        "added_tokens_decoder": decoder_entries,
        "clean_up_tokenization_spaces": False,
        "chat_template": RICH_TEMPLATE,
    }
    gen = {"eos_token_id": [tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")]}
    return _write_dir(out, tok, config, {"generation_config.json": gen})


def _metaspace_backend(byte_fallback: bool) -> BackendTokenizer:
    tok = BackendTokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False
    )
    tok.train_from_iterator(CORPUS, trainer=trainer)
    if not byte_fallback:
        return tok
    # Llama-2 layout: <0xNN> byte tokens in the model vocab, spaces as ▁ via the normalizer.
    model = json.loads(tok.to_str())["model"]
    vocab = dict(model["vocab"])
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    llama = BackendTokenizer(models.BPE(
        vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True
    ))
    llama.normalizer = normalizers.Sequence(
        [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
    )
    llama.decoder = decoders.Sequence([
        decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
        decoders.Strip(" ", 1, 0),
    ])
    llama.add_special_tokens(["<unk>", "<s>", "</s>"])
    return llama


def _sentencepiece_dir(out: Path, byte_fallback: bool) -> Path:
    tok = _metaspace_backend(byte_fallback)
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)]
    )
    # Legacy layout: special tokens only in special_tokens_map.json, no added_tokens_decoder.
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False}
    stm = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
    return _write_dir(out, tok, config, {"special_tokens_map.json": stm})


def _tiny_model_dir(out: Path) -> Path:
    from models.tiny_model import make_tiny_model

    return make_tiny_model(out, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                           num_attention_heads=2, num_key_value_heads=1, head_dim=8)


KINDS = ["tiny_model", "byte_level", "metaspace", "byte_fallback"]


@pytest.fixture(scope="module")
def tok_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tokenizers")
    return {
        "tiny_model": _tiny_model_dir(root / "tiny_model"),
        "byte_level": _byte_level_dir(root / "byte_level"),
        "metaspace": _sentencepiece_dir(root / "metaspace", byte_fallback=False),
        "byte_fallback": _sentencepiece_dir(root / "byte_fallback", byte_fallback=True),
    }


@pytest.fixture(scope="module")
def toks(tok_dirs: dict[str, Path]) -> dict[str, Tokenizer]:
    return {kind: Tokenizer.from_dir(path) for kind, path in tok_dirs.items()}


@pytest.fixture(scope="module")
def hf_toks(tok_dirs: dict[str, Path]) -> dict:
    from transformers import AutoTokenizer

    return {kind: AutoTokenizer.from_pretrained(str(path)) for kind, path in tok_dirs.items()}


def _vocab_size(tok: Tokenizer) -> int:
    """len(AutoTokenizer): the model vocab plus added tokens (may be < the model's rows)."""
    return tok._backend.get_vocab_size(with_added_tokens=True)


def _special_id(tok: Tokenizer, name: str) -> int | None:
    return tok.token_to_id(tok.special_tokens_map.get(name))


def _all_special_ids(tok: Tokenizer) -> list[int]:
    """transformers' all_special_ids: named special tokens, then the extra ones, once each."""
    tokens = dict.fromkeys([*tok.special_tokens_map.values(), *tok.extra_special_tokens])
    return [i for t in tokens if (i := tok.token_to_id(t)) is not None]


def _random_ids(rng: random.Random, tok: Tokenizer, n: int) -> list[int]:
    """Ids of the whole vocabulary plus a few past it: a model's padded rows can be sampled."""
    return [rng.randrange(_vocab_size(tok) + 4) for _ in range(n)]


# ---- Tokenizer vs transformers ----------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_vocab_and_special_tokens_match_transformers(kind, toks, hf_toks):
    tok, hf = toks[kind], hf_toks[kind]
    assert _vocab_size(tok) == len(hf)
    assert _special_id(tok, "eos_token") == hf.eos_token_id
    assert _special_id(tok, "bos_token") == hf.bos_token_id
    assert _special_id(tok, "pad_token") == hf.pad_token_id
    assert _all_special_ids(tok) == hf.all_special_ids
    ids = list(range(len(hf)))
    assert [tok._backend.id_to_token(i) for i in ids] == hf.convert_ids_to_tokens(ids)
    assert [tok.token_to_id(t) for t in hf.convert_ids_to_tokens(ids)] == ids
    assert not tok.is_known_id(len(hf))


@pytest.mark.parametrize("kind", KINDS)
def test_encode_decode_match_transformers(kind, toks, hf_toks):
    tok, hf = toks[kind], hf_toks[kind]
    for text in TEXTS:
        for add in (True, False):
            ids = tok.encode(text, add_special_tokens=add)
            assert ids == hf.encode(text, add_special_tokens=add), (text, add)
        for skip in (True, False):
            assert tok.decode(ids, skip_special_tokens=skip) == hf.decode(
                ids, skip_special_tokens=skip)
    rng = random.Random(0)
    for _ in range(50):
        ids = _random_ids(rng, tok, rng.randrange(1, 30))
        for skip in (True, False):
            assert tok.decode(ids, skip_special_tokens=skip) == hf.decode(
                ids, skip_special_tokens=skip), ids


def test_eos_ids_and_added_tokens(toks, hf_toks):
    tok = toks["byte_level"]
    im_end = tok.token_to_id("<|im_end|>")
    assert _special_id(tok, "eos_token") == im_end
    # "<tool_call>" is named only in tokenizer_config.json: it must exist, as one special token.
    tool = tok.token_to_id("<tool_call>")
    assert tool is not None and tool in _all_special_ids(tok)
    assert tok.encode("a<tool_call>b", add_special_tokens=False) == hf_toks["byte_level"].encode(
        "a<tool_call>b", add_special_tokens=False)
    assert tool in tok.encode("a<tool_call>b", add_special_tokens=False)
    tiny = toks["tiny_model"]
    assert _special_id(tiny, "eos_token") == tiny.token_to_id("<|im_end|>")


@pytest.mark.parametrize("kind", ["tiny_model", "byte_level"])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(kind, add_generation_prompt, toks, hf_toks):
    tok, hf = toks[kind], hf_toks[kind]
    for chat in CHATS:
        text = tok.apply_chat_template(chat, add_generation_prompt=add_generation_prompt)
        ref = hf.apply_chat_template(chat, tokenize=False,
                                     add_generation_prompt=add_generation_prompt)
        assert text == ref
        ids = tok.encode_chat(chat, add_generation_prompt=add_generation_prompt)
        ref_ids = hf.apply_chat_template(chat, tokenize=True, return_dict=False,
                                         add_generation_prompt=add_generation_prompt)
        assert ids == list(ref_ids)


def test_chat_template_kwargs_tools_and_errors(toks, hf_toks):
    tok, hf = toks["byte_level"], hf_toks["byte_level"]
    chat = CHATS[0]
    tools = [{"name": "lookup", "description": "finds <b>é</b> & more"}]
    assert tok.apply_chat_template(chat, tools=tools, enable_thinking=False) == \
        hf.apply_chat_template(chat, tools=tools, enable_thinking=False, tokenize=False,
                               add_generation_prompt=True)
    assert "<think>" in tok.apply_chat_template(chat, enable_thinking=False)
    assert "<b>é</b>" in tok.apply_chat_template(chat, tools=tools)  # tojson must not escape
    assert tok.apply_chat_template(chat).startswith("<s>")  # bos_token reaches the template
    with pytest.raises(jinja2.TemplateError, match="unknown role: tool"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}])
    with pytest.raises(ValueError, match="chat_template"):
        toks["metaspace"].apply_chat_template(chat)
    with pytest.raises(ValueError):
        tok.apply_chat_template([])


def test_sandbox_blocks_python_internals(tmp_path, tok_dirs):
    files = {n: (tok_dirs["byte_level"] / n).read_bytes() for n in ("tokenizer.json",)}
    files["tokenizer_config.json"] = json.dumps(
        {"chat_template": "{{ messages.__class__.__mro__ }}"}).encode()
    with pytest.raises(jinja2.exceptions.SecurityError):
        Tokenizer.from_files(files).apply_chat_template(CHATS[0])
    files["tokenizer_config.json"] = json.dumps(
        {"chat_template": "{% set ns = namespace() %}{% set ns._x = 1 %}"}).encode()
    with pytest.raises(jinja2.exceptions.SecurityError):
        Tokenizer.from_files(files).apply_chat_template(CHATS[0])


def test_chat_template_file_wins_over_config(tmp_path, tok_dirs):
    files = {n: (tok_dirs["tiny_model"] / n).read_bytes()
             for n in TOKENIZER_FILES if (tok_dirs["tiny_model"] / n).is_file()}
    files["chat_template.jinja"] = b"{% for m in messages %}[{{ m.content }}]{% endfor %}"
    assert Tokenizer.from_files(files).apply_chat_template(CHATS[0]) == "[Hi there! 你好 🙂]"


@pytest.mark.parametrize("kind", KINDS)
def test_from_files_rebuilds_the_same_tokenizer(kind, toks):
    tok = toks[kind]
    assert "tokenizer.json" in tok.files and "tokenizer_config.json" in tok.files
    assert set(tok.files) <= set(TOKENIZER_FILES)
    copy = Tokenizer.from_files(dict(tok.files))
    assert _vocab_size(copy) == _vocab_size(tok)
    assert copy.special_tokens_map == tok.special_tokens_map
    assert _all_special_ids(copy) == _all_special_ids(tok)
    for text in TEXTS:
        assert copy.encode(text) == tok.encode(text)
    if tok.chat_template is not None:
        assert copy.encode_chat(CHATS[1]) == tok.encode_chat(CHATS[1])


def test_tokenizer_module_does_not_need_transformers_or_torch():
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['torch'] = None; sys.modules['transformers'] = None\n"
        "import engine_service.common.tokenizer, engine_service.common.detokenizer\n"
    )
    root = Path(__file__).resolve().parents[1]
    subprocess.run([sys.executable, "-c", code], check=True, cwd=root)


# ---- incremental detokenizer ------------------------------------------------------------------


def _stream(tok: Tokenizer, ids: list[int], chunks: list[int] | None = None, *,
            skip: bool = True, stop: tuple[str, ...] = (),
            ) -> tuple[list[DetokenizerUpdate], str, IncrementalDetokenizer]:
    """Feed `ids` in chunks of the given sizes (cycled); returns updates, finish(), detok."""
    detok = IncrementalDetokenizer(tok, skip, list(stop))
    sizes = chunks or [1]
    updates, pos, i = [], 0, 0
    while pos < len(ids) and not detok.stopped:
        size = sizes[i % len(sizes)]
        updates.append(detok.update(ids[pos:pos + size]))
        pos, i = pos + size, i + 1
    return updates, detok.finish(), detok


def _joined(updates: list[DetokenizerUpdate], tail: str = "") -> str:
    return "".join(u.text_delta for u in updates) + tail


CHUNKINGS = [[1], [2], [5], [1, 2, 5], [3, 1, 1, 4]]


@pytest.mark.parametrize("kind", ["tiny_model", "byte_level", "metaspace"])
def test_deltas_concatenate_to_decode_for_random_ids(kind, toks):
    tok = toks[kind]
    rng = random.Random(1234)
    for trial in range(120):
        ids = _random_ids(rng, tok, rng.randrange(0, 40))
        chunks = [rng.choice([1, 2, 5]) for _ in range(4)]
        skip = trial % 2 == 0
        updates, tail, detok = _stream(tok, ids, chunks, skip=skip)
        expected = tok.decode(ids, skip_special_tokens=skip)
        assert _joined(updates, tail) == expected, (ids, chunks, skip)
        assert detok.output_text == expected
        assert not any(u.stopped for u in updates)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("chunks", CHUNKINGS)
def test_text_streams_without_partial_characters(kind, chunks, toks):
    tok = toks[kind]
    for text in TEXTS:
        ids = tok.encode(text, add_special_tokens=False)
        for skip in (True, False):
            updates, tail, _ = _stream(tok, ids, chunks, skip=skip)
            expected = tok.decode(ids, skip_special_tokens=skip)
            assert _joined(updates, tail) == expected
            # Valid text: every delta is whole characters, so none carries a U+FFFD.
            assert all("\ufffd" not in u.text_delta for u in updates)
            assert tail == ""  # nothing was left waiting when the text was complete


def test_split_multibyte_characters_are_held_until_complete(toks):
    tok = toks["tiny_model"]  # English-only vocab: 你, ö and 🙂 are several byte tokens each
    ids = tok.encode(MULTIBYTE, add_special_tokens=False)
    assert len(ids) > len(MULTIBYTE.split()) + 6  # the characters really are split
    detok = IncrementalDetokenizer(tok, True, [])
    seen = ""
    for token in ids:
        seen += detok.update([token]).text_delta
        assert "\ufffd" not in seen
        assert MULTIBYTE.startswith(seen)
    assert seen + detok.finish() == MULTIBYTE


class _CountingTokenizer:
    """Wraps a Tokenizer and records the longest id list any decode() call was given."""

    def __init__(self, tok: Tokenizer) -> None:
        self.tok, self.longest = tok, 0

    def __getattr__(self, name: str):
        return getattr(self.tok, name)

    def decode(self, ids, skip_special_tokens=True):
        self.longest = max(self.longest, len(ids))
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)


@pytest.mark.parametrize("garbage", [False, True])
def test_cost_per_token_does_not_grow_with_length(garbage, toks):
    tok = toks["byte_level"]
    rng = random.Random(7)
    # Garbage: only tokens that alone decode to U+FFFD (lone continuation bytes, unfinished
    # characters), so the text keeps ending in U+FFFD for long stretches.
    broken = [i for i in range(_vocab_size(tok)) if tok.decode([i]) == "\ufffd"]
    assert len(broken) > 50
    pool = broken if garbage else list(range(_vocab_size(tok)))
    ids = [rng.choice(pool) for _ in range(1500)]
    counting = _CountingTokenizer(tok)
    updates, tail, _ = _stream(counting, ids, [1, 2, 5])
    assert _joined(updates, tail) == tok.decode(ids)
    assert counting.longest <= 40  # far below 1500: only a small window is ever decoded


def test_skipped_special_tokens_do_not_grow_the_window(toks):
    tok = toks["tiny_model"]
    pad = tok.token_to_id("<|endoftext|>")
    half_char = tok.encode("你", add_special_tokens=False)[:1]
    assert tok.decode(half_char) == "\ufffd"
    unknown = _vocab_size(tok) + 3  # decodes to nothing, like a skipped special token
    ids = ([pad, unknown] * 25 + tok.encode(" ok", add_special_tokens=False)) * 10
    ids += half_char + [pad, unknown] * 100
    counting = _CountingTokenizer(tok)
    updates, tail, _ = _stream(counting, ids, [1, 2, 5], skip=True)
    assert _joined(updates, tail) == tok.decode(ids) == " ok" * 10 + "\ufffd"
    assert counting.longest <= 10


@pytest.mark.parametrize("skip", [True, False])
def test_skip_special_tokens(skip, toks):
    tok = toks["byte_level"]
    im_start, im_end = tok.token_to_id("<|im_start|>"), tok.token_to_id("<|im_end|>")
    ids = [im_start, *tok.encode("hé 你", add_special_tokens=False), im_end,
           *tok.encode("🙂", add_special_tokens=False), im_end]
    expected = "hé 你🙂" if skip else "<|im_start|>hé 你<|im_end|>🙂<|im_end|>"
    assert tok.decode(ids, skip_special_tokens=skip) == expected
    for chunks in CHUNKINGS:
        updates, tail, _ = _stream(tok, ids, chunks, skip=skip)
        assert _joined(updates, tail) == expected


# ---- stop strings -----------------------------------------------------------------------------


def _reference_cut(text: str, stops: list[str]) -> tuple[str, str | None]:
    """Scan `text` a character at a time; stop at the first stop string completed (the longer
    one when two complete at the same character)."""
    for end in range(1, len(text) + 1):
        done = [s for s in stops if s and text[:end].endswith(s)]
        if done:
            stop = max(done, key=len)
            return text[:end - len(stop)], stop
    return text, None


def _check_stop_run(tok, ids, stops, chunks, skip=True):
    full = tok.decode(ids, skip_special_tokens=skip)
    expected, expected_stop = _reference_cut(full, stops)
    updates, tail, detok = _stream(tok, ids, chunks, skip=skip, stop=tuple(stops))
    got = _joined(updates, tail)
    assert got == expected, (full, stops, chunks)
    assert detok.output_text == expected
    assert detok.stopped == (expected_stop is not None)
    assert detok.stop_string == expected_stop
    if any(u.stopped for u in updates):
        assert tail == ""  # (a stop made of U+FFFDs can also complete only at finish())
    # Never leaked: no prefix of what was sent already holds a stop string.
    sent = ""
    for update in updates:
        sent += update.text_delta
        assert not any(s in sent for s in stops)
    return updates, tail


SENTENCE = "The quick brown fox jumps over the lazy dog. Stop here, then go on."


@pytest.mark.parametrize("chunks", CHUNKINGS)
def test_stop_inside_a_token(chunks, toks):
    tok = toks["byte_level"]
    ids = tok.encode(SENTENCE, add_special_tokens=False)
    pieces = [tok.decode([i]) for i in ids]
    starts = {sum(len(p) for p in pieces[:k]) for k in range(len(pieces) + 1)}
    stop = "uic"  # starts inside the token that holds "quick"
    assert SENTENCE.find(stop) not in starts
    updates, _ = _check_stop_run(tok, ids, [stop], chunks)
    assert _joined(updates) == "The q"


@pytest.mark.parametrize("chunks", CHUNKINGS)
def test_stop_spanning_tokens_and_chunks(chunks, toks):
    tok = toks["tiny_model"]
    ids = tok.encode(SENTENCE, add_special_tokens=False)
    updates, _ = _check_stop_run(tok, ids, ["dog. St"], chunks)
    assert _joined(updates) == "The quick brown fox jumps over the lazy "


def test_earliest_stop_wins(toks):
    tok = toks["byte_level"]
    ids = tok.encode(SENTENCE, add_special_tokens=False)
    for chunks in CHUNKINGS:
        updates, _ = _check_stop_run(tok, ids, ["lazy", "over", "zzz"], chunks)
        assert updates[-1].stop_string == "over"
        assert _joined(updates) == "The quick brown fox jumps "
        # Overlapping stops: "ick" is complete before "quick brown" is.
        updates, _ = _check_stop_run(tok, ids, ["quick brown", "ick"], chunks)
        assert updates[-1].stop_string == "ick"


def test_stop_made_of_multibyte_characters(toks):
    tok = toks["tiny_model"]
    text = "hi 你好 🙂 and 🙂 again"
    ids = tok.encode(text, add_special_tokens=False)
    for chunks in CHUNKINGS:
        updates, _ = _check_stop_run(tok, ids, ["好 🙂"], chunks)
        assert _joined(updates) == "hi 你"


def test_held_prefix_is_released_when_the_stop_does_not_follow(toks):
    tok = toks["tiny_model"]
    detok = IncrementalDetokenizer(tok, True, ["lazy cat"])
    ids = tok.encode(SENTENCE, add_special_tokens=False)
    seen = ""
    for token in ids:
        update = detok.update([token])
        seen += update.text_delta
        assert not update.stopped
        # Held text is exactly the longest tail that starts "lazy cat".
        held = detok.output_text[len(seen):]
        assert "lazy cat".startswith(held)
    assert "The quick brown fox jumps over the lazy dog" in seen
    assert seen + detok.finish() == SENTENCE


def test_finish_flushes_held_text(toks):
    tok = toks["tiny_model"]
    ids = tok.encode("count to three: one two thr", add_special_tokens=False)
    updates, tail, detok = _stream(tok, ids, [1], stop=("three!",))
    assert tail == "thr"  # held: it may be the start of "three!"
    assert _joined(updates, tail) == "count to three: one two thr"
    assert not detok.stopped
    assert detok.finish() == ""  # nothing left after the flush


def test_after_stop_nothing_more_comes_out(toks):
    tok = toks["tiny_model"]
    ids = tok.encode(SENTENCE, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, True, ["fox"])
    stopped_at = None
    for k, token in enumerate(ids):
        update = detok.update([token])
        if update.stopped:
            stopped_at = k
            break
    assert stopped_at is not None
    later = detok.update(ids[stopped_at + 1:])
    assert later == DetokenizerUpdate("", True, "fox")
    assert detok.finish() == ""
    assert detok.output_text == "The quick brown "


def test_stop_on_special_token_text_when_not_skipped(toks):
    tok = toks["byte_level"]
    im_end = tok.token_to_id("<|im_end|>")
    ids = [*tok.encode("answer", add_special_tokens=False), im_end,
           *tok.encode(" more", add_special_tokens=False)]
    updates, _ = _check_stop_run(tok, ids, ["<|im_end|>"], [1], skip=False)
    assert _joined(updates) == "answer"
    updates, tail = _check_stop_run(tok, ids, ["<|im_end|>"], [1], skip=True)
    assert _joined(updates, tail) == "answer more"


@pytest.mark.parametrize("kind", ["tiny_model", "byte_level", "metaspace"])
def test_random_stops_match_a_character_scan(kind, toks):
    tok = toks[kind]
    rng = random.Random(99)
    texts = [*TEXTS, SENTENCE]
    for trial in range(150):
        if trial % 3 == 0:  # random ids: U+FFFDs and split characters around the stops
            ids = _random_ids(rng, tok, rng.randrange(1, 40))
        else:
            ids = tok.encode(rng.choice(texts), add_special_tokens=False)
        full = tok.decode(ids)
        stops = []
        for _ in range(rng.randrange(1, 4)):
            if full and rng.random() < 0.8:
                a = rng.randrange(len(full))
                stops.append(full[a:a + rng.randrange(1, 6)])
            else:
                stops.append("zq" * rng.randrange(1, 3))
        chunks = [rng.choice([1, 2, 5]) for _ in range(3)]
        _check_stop_run(tok, ids, stops, chunks)


@pytest.mark.parametrize("kind", ["tiny_model", "byte_level"])
def test_several_tokens_at_once_keep_only_those_up_to_the_stop(kind, toks):
    """Speculative decoding hands over several tokens a step: the output ends at the token
    that completes the stop string, as when they come one a step."""
    tok = toks[kind]
    ids = tok.encode(SENTENCE, add_special_tokens=False)
    one_by_one = IncrementalDetokenizer(tok, stop=("lazy",))
    n = next(i for i, token in enumerate(ids, 1) if one_by_one.update([token]).stopped)
    for size in (2, 3, 5):
        detok = IncrementalDetokenizer(tok, stop=("lazy",))
        kept, text = [], ""
        for start in range(0, len(ids), size):
            upd = detok.update(ids[start:start + size])
            kept += ids[start:start + size][:upd.num_tokens]
            text += upd.text_delta
            if upd.stopped:
                break
        assert kept == ids[:n], size
        assert text == one_by_one.output_text == "The quick brown fox jumps over the "
