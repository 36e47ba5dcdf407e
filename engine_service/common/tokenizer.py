"""Tokenizer shared by engines and routers, on `tokenizers` and jinja2 only (the router pod has
no torch or transformers). It reads `transformers.AutoTokenizer`'s files and follows its rules
where they change results (special tokens, chat template choice and rendering). An engine
streams `Tokenizer.files` through GetTokenizer; a router rebuilds it with `Tokenizer.from_files`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, decoders
from tokenizers import Tokenizer as BackendTokenizer

# Every file a tokenizer may be built from; GetTokenizer streams the ones a model dir has.
TOKENIZER_FILES: tuple[str, ...] = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "generation_config.json",
)
# transformers' SPECIAL_TOKENS_ATTRIBUTES, in its order.
NAMED_SPECIAL_TOKENS: tuple[str, ...] = (
    "bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token",
)

Message = Mapping[str, Any]


class Tokenizer:
    """Encode/decode through tokenizer.json; chat templates through a sandboxed jinja2."""

    def __init__(self, files: Mapping[str, bytes]) -> None:
        if "tokenizer.json" not in files:
            raise ValueError(f"tokenizer.json is required (got: {sorted(files)})")
        self.files: dict[str, bytes] = {n: bytes(files[n]) for n in TOKENIZER_FILES if n in files}
        config = _load_json(self.files, "tokenizer_config.json")
        if "added_tokens_decoder" not in config:
            # Legacy checkpoints keep their special tokens here; transformers reads it only then.
            config.update(_load_json(self.files, "special_tokens_map.json"))
        self._backend = BackendTokenizer.from_str(self.files["tokenizer.json"].decode("utf-8"))
        if self._backend.padding is not None:  # transformers takes pad_token from here too
            config.setdefault("pad_token", self._backend.padding["pad_token"])
        # transformers encodes without padding or truncation unless asked; so do we, always.
        self._backend.no_padding()
        self._backend.no_truncation()
        self.special_tokens_map = _named_special_tokens(config)
        self.extra_special_tokens = _extra_special_tokens(config)
        self._add_missing_tokens(config)
        # What decode(skip_special_tokens=True) drops: added tokens flagged special (not only
        # the tokens the config names).
        self.skipped_special_ids: frozenset[int] = frozenset(
            i for i, t in self._backend.get_added_tokens_decoder().items() if t.special
        )
        # decode() is lossy UTF-8 over the tokens' bytes (GPT-2/Qwen/Llama-3 style BPE).
        self.decoder_is_byte_level = isinstance(self._backend.decoder, decoders.ByteLevel)
        self.chat_template = _pick_chat_template(self.files, config)
        self._template: jinja2.Template | None = None  # compiled on first use

    @classmethod
    def from_files(cls, files: Mapping[str, bytes]) -> Tokenizer:
        return cls(files)

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        root = Path(path)
        return cls({n: (root / n).read_bytes() for n in TOKENIZER_FILES if (root / n).is_file()})

    def is_known_id(self, token_id: int) -> bool:
        """False for ids past the vocabulary (a model's padding rows): decode() drops them."""
        return self._backend.id_to_token(token_id) is not None

    def token_to_id(self, token: str | None) -> int | None:
        return None if token is None else self._backend.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # encode_batch releases the GIL while it works (encode holds it): a long text
        # tokenized on a worker thread then leaves the event loop free.
        return self._backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        # Unknown ids (padded vocab rows) decode to nothing, as in transformers; no
        # clean_up_tokenization_spaces: transformers ignores it for BPE models.
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: Sequence[Message],
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> str:
        """Render the chat template, as transformers' apply_chat_template(tokenize=False);
        extra keyword arguments reach the template (e.g. `tools`, `enable_thinking=False`)."""
        if self.chat_template is None:
            raise ValueError("this tokenizer has no chat_template; send text or token ids instead")
        if not messages:
            raise ValueError("a chat needs at least one message")
        # Like transformers: a None field is dropped, because templates test presence, not value.
        chat = [{k: v for k, v in dict(m).items() if v is not None} for m in messages]
        if self._template is None:
            self._template = _compile_chat_template(self.chat_template)
        # tools and documents are None unless given, as transformers passes them.
        variables = {"tools": None, "documents": None, **self.special_tokens_map,
                     **template_kwargs}
        return self._template.render(
            messages=chat, add_generation_prompt=add_generation_prompt, **variables)

    def encode_chat(
        self,
        messages: Sequence[Message],
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> list[int]:
        """Token ids of the rendered chat; the template already placed every special token."""
        text = self.apply_chat_template(messages, add_generation_prompt, **template_kwargs)
        return self.encode(text, add_special_tokens=False)

    def _add_missing_tokens(self, config: Mapping[str, Any]) -> None:
        """Add the tokens the config names but tokenizer.json lacks, as transformers does."""
        known = set(self._backend.get_vocab(with_added_tokens=True))
        new: list[AddedToken] = []
        decoder = config.get("added_tokens_decoder") or {}
        for _, spec in sorted(decoder.items(), key=lambda item: int(item[0])):
            token = _added_token(spec, special=False)
            if token.content not in known:
                new.append(token)
                known.add(token.content)
        for content in [*self.special_tokens_map.values(), *self.extra_special_tokens]:
            if content not in known:
                new.append(AddedToken(content, special=True, normalized=False))
                known.add(content)
        if new:
            self._backend.add_tokens(new)


def _load_json(files: Mapping[str, bytes], name: str) -> dict[str, Any]:
    return json.loads(files[name].decode("utf-8")) if name in files else {}


def _token_content(value: Any) -> str | None:
    """A special token is a string, an AddedToken dict ({"content": ...}) or None."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    raise ValueError(f"unreadable special token in tokenizer config: {value!r}")


def _added_token(spec: Any, special: bool) -> AddedToken:
    if isinstance(spec, str):
        return AddedToken(spec, special=special)
    fields = ("single_word", "lstrip", "rstrip", "normalized", "special")
    kwargs = {f: bool(spec[f]) for f in fields if f in spec}
    kwargs.setdefault("special", special)
    return AddedToken(spec["content"], **kwargs)


def _named_special_tokens(config: Mapping[str, Any]) -> dict[str, str]:
    """bos/eos/... plus model-specific `*_token` strings (e.g. image_token), as transformers v5."""
    named: dict[str, str] = {}
    for key in NAMED_SPECIAL_TOKENS:
        content = _token_content(config.get(key))
        if content is not None:
            named[key] = content
    for key, value in config.items():
        if key.endswith("_token") and key not in named and isinstance(value, str):
            named[key] = value
    extra = _raw_extra_tokens(config)
    if isinstance(extra, Mapping):
        named.update({k: c for k, v in extra.items() if (c := _token_content(v)) is not None})
    return named


def _raw_extra_tokens(config: Mapping[str, Any]) -> Any:
    return config.get("extra_special_tokens") or config.get("additional_special_tokens") or []


def _extra_special_tokens(config: Mapping[str, Any]) -> list[str]:
    extra = _raw_extra_tokens(config)
    if isinstance(extra, Mapping):  # a dict names model-specific tokens: already in the named map
        return []
    return [c for v in extra if (c := _token_content(v)) is not None]


def _pick_chat_template(files: Mapping[str, bytes], config: Mapping[str, Any]) -> str | None:
    """chat_template.jinja wins over the config entry; a list of named templates -> 'default'."""
    if "chat_template.jinja" in files:
        return files["chat_template.jinja"].decode("utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):
        by_name = {t["name"]: t["template"] for t in template}
        return by_name.get("default")
    return template


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks; a
    server only needs the body rendered, but templates that use it must still parse."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        call = self.call_method("_render_body")
        return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

    def _render_body(self, caller: Any) -> str:
        return caller()


class _TemplateNamespace(jinja2.utils.Namespace):
    """namespace() that refuses underscore attributes, closing a sandbox escape route."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # same signature trick as jinja's Namespace
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} is not allowed")


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: int | None = None,
    separators: tuple[str, str] | None = None, sort_keys: bool = False,
) -> str:
    # jinja's own tojson escapes HTML characters, which would change the prompt.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _compile_chat_template(template: str) -> jinja2.Template:
    # transformers' render_jinja_template, always in the immutable sandbox: templates come
    # with model checkpoints, i.e. from strangers.
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["namespace"] = _TemplateNamespace
    env.globals["dict"] = lambda *args, **kwargs: dict(*args, **kwargs)
    return env.from_string(template)
