"""Tokenizers: one interface over the byte-level tokenizer and a checkpoint's own HF tokenizer.

:class:`Tokenizer` is what the engine, the request and the CLI use; they never assume bytes. Two
implementations:

* :class:`ByteTokenizer`: ids 0..255 are the bytes, 256 is ``<eos>``. Decoding never raises: invalid
  UTF-8 becomes U+FFFD. :class:`StreamDecoder` decodes its token stream piece by piece and holds back
  an incomplete multi-byte character until its last byte arrives (or the stream ends).
* :class:`HFTokenizer`: a checkpoint's ``tokenizer.json`` (HF ``tokenizers``), with the special
  tokens and chat template of its ``tokenizer_config.json`` (or ``chat_template.jinja``). Loaded from
  the model directory only (or the directory ``EngineConfig.tokenizer`` names), never from the network.

A Jinja file (``EngineConfig.chat_template``) replaces either one's chat template (the byte-level
tokenizer has none of its own): :func:`read_chat_template` reads and compiles it once.

:func:`load_tokenizer` chooses by what the directory holds (the rule is in its docstring). It also
collects the ids that end generation: ``eos_token_id`` of ``config.json`` and of
``generation_config.json`` (each an int or a list), all of them.

``ByteTokenizer.write_hf_files`` writes an equivalent ``tokenizer.json`` / ``tokenizer_config.json``
so the model directory also loads as an HF ``PreTrainedTokenizerFast`` (a BPE with no merges over
the 256 byte-level symbols, ids equal to byte values). Its ``tokenizer_config.json`` carries
``"hispec_tokenizer": "byte"``, the marker by which hispec keeps serving it byte-level.
"""

from __future__ import annotations

import codecs
import json
import re
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import attrs
import structlog

from pipeline.errors import ConfigError, RequestError

log = structlog.get_logger("hispec.tokenizer")

EOS_TEXT = "<eos>"
BYTE_MARKER = "hispec_tokenizer"  # tokenizer_config.json key; the value "byte" selects ByteTokenizer
# a byte-fallback piece, as HF's ByteFallback decoder reads it
_BYTE_PIECE = re.compile(r"^<0x[0-9A-Fa-f]{2}>$")
_SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")
# files that mean "this directory has a tokenizer" (tokenizer.json is read directly, the others via
# transformers)
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt")

Messages = Sequence[Mapping[str, Any]]


@runtime_checkable
class Tokenizer(Protocol):
    """What hispec needs of a tokenizer (the byte-level one and a checkpoint's own)."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """Every id that ends generation (``SamplingParams.ignore_eos`` ignores them)."""
        ...

    @property
    def byte_piece_ids(self) -> frozenset[int]:
        """Ids of byte-fallback pieces: a run of them decodes as a whole, so their text is not
        settled until a token of another kind follows."""
        ...

    @property
    def special_ids(self) -> frozenset[int]:
        """Ids that ``decode`` leaves out (so they do not end a run of byte pieces either)."""
        ...

    @property
    def chat_template(self) -> str | None: ...

    def encode(self, text: str) -> list[int]:
        """Text -> ids, with the special tokens the tokenizer adds to any text (e.g. BOS)."""
        ...

    def decode(self, ids: Sequence[int]) -> str:
        """Ids -> text, special tokens left out; never raises (bad bytes become U+FFFD)."""
        ...

    def apply_chat_template(self, messages: Messages, add_generation_prompt: bool = True) -> list[int]:
        """The prompt ids of a conversation; ``RequestError`` naming ``messages`` without a template."""
        ...


def _id_set(ids: Iterable[int]) -> frozenset[int]:
    return frozenset(ids)


@attrs.frozen
class ByteTokenizer:
    eos_token_id: int = 256
    eos_token_ids: frozenset[int] = attrs.field(converter=_id_set)
    chat_template: str | None = None  # none of its own; one given renders to text encoded as bytes

    @eos_token_ids.default
    def _just_eos(self) -> frozenset[int]:
        return frozenset({self.eos_token_id})

    @property
    def vocab_size(self) -> int:
        return self.eos_token_id + 1

    @property
    def byte_piece_ids(self) -> frozenset[int]:
        return frozenset()  # every id is one byte: only a cut character is held back (U+FFFD)

    @property
    def special_ids(self) -> frozenset[int]:
        return frozenset({self.eos_token_id})

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        """Bytes to text; ids outside 0..255 (``<eos>``) are dropped, bad UTF-8 becomes U+FFFD."""
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")

    def apply_chat_template(self, messages: Messages, add_generation_prompt: bool = True) -> list[int]:
        if self.chat_template is None:
            raise RequestError(
                "messages", "<conversation>", "the model has no chat template (byte-level tokenizer)"
            )
        _check_messages(messages)
        return self.encode(_render(self.chat_template, messages, add_generation_prompt, {}))

    def stream(self) -> StreamDecoder:
        return StreamDecoder()

    def write_hf_files(self, path: str | Path) -> None:
        out = Path(path)
        vocab = {symbol: byte for byte, symbol in _byte_symbols().items()}
        tokenizer: dict[str, object] = {
            "version": "1.0",
            "truncation": None,
            "padding": None,
            "added_tokens": [
                {
                    "id": self.eos_token_id,
                    "content": EOS_TEXT,
                    "single_word": False,
                    "lstrip": False,
                    "rstrip": False,
                    "normalized": False,
                    "special": True,
                }
            ],
            "normalizer": None,
            "pre_tokenizer": {
                "type": "ByteLevel",
                "add_prefix_space": False,
                "trim_offsets": False,
                "use_regex": False,
            },
            "post_processor": None,
            "decoder": {
                "type": "ByteLevel",
                "add_prefix_space": False,
                "trim_offsets": False,
                "use_regex": False,
            },
            "model": {
                "type": "BPE",
                "dropout": None,
                "unk_token": None,
                "continuing_subword_prefix": None,
                "end_of_word_suffix": None,
                "fuse_unk": False,
                "byte_fallback": False,
                "ignore_merges": False,
                "vocab": vocab,
                "merges": [],
            },
        }
        # split_special_tokens: the text "<eos>" is five bytes, as here, not the special token
        config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "eos_token": EOS_TEXT,
            "split_special_tokens": True,
            "model_max_length": 1 << 30,
            "clean_up_tokenization_spaces": False,
            BYTE_MARKER: "byte",
        }
        (out / "tokenizer.json").write_text(json.dumps(tokenizer, indent=1, ensure_ascii=False) + "\n")
        (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


class StreamDecoder:
    """Incremental decoding for streamed output."""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, ids: list[int]) -> str:
        """Text completed by these ids; a partial character waits for its next bytes."""
        return self._decoder.decode(bytes(i for i in ids if 0 <= i < 256))

    def finish(self) -> str:
        """Flush at the end of the stream: dangling bytes of a cut character become U+FFFD."""
        return self._decoder.decode(b"", final=True)


def _byte_symbols() -> dict[int, str]:
    """GPT-2's byte -> printable symbol table (what the ``ByteLevel`` pre-tokenizer emits)."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


class HFTokenizer:
    """A checkpoint's HF tokenizer: a ``tokenizers.Tokenizer`` plus its special tokens and chat template.

    Decoding leaves special tokens out and never applies ``clean_up_tokenization_spaces`` (that
    rewrite is not local to a token, so streamed text could not stay a prefix of the final text).
    """

    def __init__(
        self,
        backend: Any,
        *,
        eos_token_ids: Sequence[int] = (),
        chat_template: str | None = None,
        special_tokens: Mapping[str, str | None] | None = None,
    ) -> None:
        self.backend = backend
        self.eos_token_ids = frozenset(eos_token_ids)
        self.chat_template = chat_template
        self.special_tokens = dict(special_tokens or {})
        vocab = backend.get_vocab(with_added_tokens=True)
        self.byte_piece_ids = frozenset(i for token, i in vocab.items() if _BYTE_PIECE.match(token))
        self.special_ids = frozenset(i for i, t in backend.get_added_tokens_decoder().items() if t.special)
        self.vocab_size = max(vocab.values(), default=-1) + 1

    @classmethod
    def from_dir(
        cls,
        path: str | Path,
        *,
        eos_token_ids: Sequence[int] | None = None,
        chat_template: str | None = None,
        field: str = "model",
    ) -> HFTokenizer:
        """Load ``path``'s tokenizer (``tokenizer.json``, else through ``transformers`` from the other
        tokenizer files), offline. ``eos_token_ids`` default: :func:`end_token_ids` of ``path``;
        ``chat_template`` (a template's text) replaces the directory's own. A file that cannot be
        read as what it should hold is a ``ConfigError`` on ``field`` naming it."""
        path = Path(path)
        config = _read_json(path / "tokenizer_config.json", field)
        backend = _load_backend(path, field)
        special = {key: _token_text(config.get(key)) for key in _SPECIAL_KEYS}
        ends = list(end_token_ids(path) if eos_token_ids is None else eos_token_ids)
        if not ends and special["eos_token"] is not None:  # no end id in the model's files: the tokenizer's
            eos = backend.token_to_id(special["eos_token"])
            ends = [] if eos is None else [eos]
        template = chat_template if chat_template is not None else _chat_template(path, config, field)
        return cls(backend, eos_token_ids=ends, chat_template=template, special_tokens=special)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return list(self.backend.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Sequence[int]) -> str:
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=True)

    def render_chat(self, messages: Messages, add_generation_prompt: bool = True) -> str:
        """The conversation as text, by the checkpoint's chat template (as ``transformers`` renders it)."""
        if self.chat_template is None:
            raise RequestError(
                "messages",
                "<conversation>",
                "the checkpoint has no chat template (tokenizer_config.json "
                "'chat_template' or chat_template.jinja); pass a prompt instead",
            )
        _check_messages(messages)
        return _render(self.chat_template, messages, add_generation_prompt, self.special_tokens)

    def apply_chat_template(self, messages: Messages, add_generation_prompt: bool = True) -> list[int]:
        # the template writes its own special tokens (BOS...): the text is encoded without adding more
        return self.encode(self.render_chat(messages, add_generation_prompt), add_special_tokens=False)


def load_tokenizer(
    name_or_path: str | Path,
    *,
    tokenizer: str | Path | None = None,
    chat_template: str | Path | None = None,
    vocab_size: int | None = None,
) -> ByteTokenizer | HFTokenizer:
    """The tokenizer of a model directory (or of a bundled model's name), from its files only.

    ``tokenizer``: read the tokenizer files from this directory instead (the end ids still come from
    the model's); it must hold some. ``chat_template``: a Jinja file replacing the chat template
    (:func:`read_chat_template`). ``vocab_size``: the model's, which every end id must be below. A
    tokenizer file that cannot be read as one is a ``ConfigError`` on ``model`` (``tokenizer`` for
    the ``tokenizer`` directory) naming the file. The rule, in order (in the tokenizer's directory):

    1. ``tokenizer_config.json`` has ``"hispec_tokenizer": "byte"`` -> :class:`ByteTokenizer` (the
       bundled model: its HF files describe the same byte-level tokenizer);
    2. ``tokenizer.json`` exists -> :class:`HFTokenizer` over it (``tokenizers``);
    3. other tokenizer files (``tokenizer_config.json``, ``tokenizer.model``, ``vocab.json``...) ->
       :class:`HFTokenizer` over ``transformers.AutoTokenizer.from_pretrained(dir, local_files_only=True)``;
    4. none -> :class:`ByteTokenizer` (logged).

    Either way the end ids are :func:`end_token_ids` of the model directory.
    """
    from pipeline.model.config import resolve_model_dir

    path = resolve_model_dir(name_or_path)
    ends = end_token_ids(path, vocab_size=vocab_size)
    template = None if chat_template is None else read_chat_template(chat_template)
    source, field = (path, "model") if tokenizer is None else (Path(tokenizer), "tokenizer")
    config = _read_json(source / "tokenizer_config.json", field)
    has_files = any((source / name).exists() for name in _TOKENIZER_FILES)
    if tokenizer is not None and not has_files:
        raise ConfigError(
            "tokenizer", str(tokenizer), f"holds no tokenizer files ({', '.join(_TOKENIZER_FILES)})"
        )
    if config.get(BYTE_MARKER) == "byte" or not has_files:
        if config.get(BYTE_MARKER) != "byte":
            log.warning(
                "tokenizer.byte_level", model=str(path), reason="the directory has no tokenizer files"
            )
        primary = ends[0] if ends else 256
        return ByteTokenizer(eos_token_id=primary, eos_token_ids=ends or (primary,), chat_template=template)
    return HFTokenizer.from_dir(source, eos_token_ids=ends or None, chat_template=template, field=field)


def read_chat_template(path: str | Path) -> str:
    """The text of a chat template file, compiled once here: an unreadable file or a template Jinja
    cannot parse is a ``ConfigError`` naming ``chat_template``."""
    from jinja2 import TemplateError

    try:
        template = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError("chat_template", str(path), f"cannot be read ({exc})") from None
    try:
        _jinja_environment().from_string(template)
    except TemplateError as exc:
        raise ConfigError("chat_template", str(path), f"is not a valid Jinja template ({exc})") from None
    return template


def end_token_ids(path: str | Path, *, vocab_size: int | None = None) -> tuple[int, ...]:
    """``eos_token_id`` of ``config.json`` and of ``generation_config.json`` (each an int, a list or
    absent), in that order, without repeats; with ``vocab_size``, each must be an id of the model's
    vocabulary (a ``ConfigError`` on ``model`` naming the file and the id)."""
    path = Path(path)
    ids: list[int] = []
    for name in ("config.json", "generation_config.json"):
        value = _read_json(path / name).get("eos_token_id")
        if value is None:
            continue
        for token in value if isinstance(value, list) else [value]:
            if isinstance(token, bool) or not isinstance(token, int):
                raise ConfigError(
                    "model", str(path), f"{name}: eos_token_id must be an int or a list of ints"
                )
            if vocab_size is not None and not 0 <= token < vocab_size:
                raise ConfigError(
                    "model",
                    str(path),
                    f"{name}: eos_token_id {token} is outside the model's vocabulary of "
                    f"{vocab_size} ids (0..{vocab_size - 1})",
                )
            if token not in ids:
                ids.append(token)
    return tuple(ids)


def configured_tokenizer(config: Any, model: Any = None) -> Tokenizer:
    """The tokenizer an engine of ``config`` (an ``EngineConfig``) serves with: ``config.tokenizer``
    and ``config.chat_template`` over the checkpoint's own files; with an injected ``model``, over
    the byte-level tokenizer of its vocabulary."""
    from pipeline.model.config import ModelConfig

    cfg = model.cfg if model is not None else ModelConfig.from_dir(config.model)
    return tokenizer_for_model(
        None if model is not None else config.model, vocab_size=cfg.vocab_size,
        eos_token_id=cfg.eos_token_id, tokenizer=config.tokenizer, chat_template=config.chat_template,
    )


def tokenizer_for_model(
    model_dir: str | Path | None,
    *,
    vocab_size: int,
    eos_token_id: int | None,
    tokenizer: str | Path | None = None,
    chat_template: str | Path | None = None,
) -> ByteTokenizer | HFTokenizer:
    """The engine's tokenizer: ``model_dir``'s (:func:`load_tokenizer`, with ``tokenizer`` and
    ``chat_template`` as there), or for a model built in memory (no directory) ``tokenizer``'s, else
    the byte-level one with the model's EOS. Refuses a tokenizer whose ids the model cannot embed."""
    source = model_dir if model_dir is not None else tokenizer
    if source is None:
        template = None if chat_template is None else read_chat_template(chat_template)
        return ByteTokenizer(
            eos_token_id=eos_token_id if eos_token_id is not None else 256, chat_template=template
        )
    ends_below = vocab_size if model_dir is not None else None  # a model built in memory has no end-id files
    loaded = load_tokenizer(source, tokenizer=tokenizer, chat_template=chat_template, vocab_size=ends_below)
    if loaded.vocab_size > vocab_size:
        field, where = ("model", model_dir) if tokenizer is None else ("tokenizer", tokenizer)
        raise ConfigError(
            field,
            str(where),
            f"the tokenizer has {loaded.vocab_size} ids but the model's vocab_size is {vocab_size}",
        )
    return loaded


# ----- helpers ----------------------------------------------------------------------------------------
def _read_json(path: Path, field: str = "model") -> dict[str, Any]:
    """A JSON object file of a model (or tokenizer) directory; ``{}`` when it does not exist.
    Unreadable, not JSON, or not an object: a ``ConfigError`` on ``field`` naming the file."""
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise ConfigError(
            field, str(path.parent), f"{path.name} is not valid JSON ({_one_line(exc)})"
        ) from None
    if not isinstance(data, dict):
        raise ConfigError(
            field, str(path.parent), f"{path.name} must hold a JSON object, not a {type(data).__name__}"
        )
    return data


def _one_line(exc: BaseException, limit: int = 200) -> str:
    """An exception's message on one line (a library's own may span several), cut at ``limit``."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _token_text(value: object) -> str | None:
    """A special token as ``tokenizer_config.json`` writes it: a string or ``{"content": ...}``."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _load_backend(path: Path, field: str = "model") -> Any:
    """The ``tokenizers`` tokenizer of ``path``: its ``tokenizer.json``, else what ``transformers``
    makes of its other tokenizer files. Files it cannot read: a ``ConfigError`` on ``field``."""
    if (path / "tokenizer.json").exists():
        from tokenizers import Tokenizer as Backend

        try:
            return Backend.from_file(str(path / "tokenizer.json"))
        except Exception as exc:  # the library raises a bare Exception for a bad file
            raise ConfigError(
                field,
                str(path),
                f"tokenizer.json is not a tokenizer the tokenizers library can read ({_one_line(exc)})",
            ) from None
    try:
        from transformers import AutoTokenizer
    except ImportError as exc:
        raise ConfigError(
            field,
            str(path),
            "its tokenizer has no tokenizer.json: reading the other tokenizer files "
            "needs transformers (pip install transformers)",
        ) from exc
    try:
        hf = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as exc:  # whatever the files make transformers raise
        raise ConfigError(
            field,
            str(path),
            f"its tokenizer files cannot be read by transformers ({type(exc).__name__}: {_one_line(exc)})",
        ) from None
    backend = getattr(hf, "backend_tokenizer", None)
    if backend is None:
        raise ConfigError(field, str(path), f"{type(hf).__name__} is not a fast (tokenizers) tokenizer")
    return backend


def _chat_template(path: Path, config: dict[str, Any], field: str = "model") -> str | None:
    """``chat_template.jinja`` if present, else ``tokenizer_config.json``'s ``chat_template`` (a
    string, or a list of named templates: the one named ``default``)."""
    jinja = path / "chat_template.jinja"
    if jinja.exists():
        try:
            return jinja.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(
                field, str(path), f"chat_template.jinja cannot be read ({_one_line(exc)})"
            ) from None
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def _check_messages(messages: Messages) -> None:
    ok = isinstance(messages, Sequence) and not isinstance(messages, str) and len(messages) > 0
    ok = ok and all(isinstance(m, Mapping) and isinstance(m.get("role"), str) for m in messages)
    if not ok:
        raise RequestError(
            "messages", messages, "must be a non-empty list of {'role': str, 'content': ...} mappings"
        )


def _render(
    template: str, messages: Messages, add_generation_prompt: bool, special: Mapping[str, Any]
) -> str:
    """Render like ``transformers``' ``apply_chat_template`` (sandboxed Jinja, trim_blocks and
    lstrip_blocks, ``raise_exception``, ``strftime_now``, a ``tojson`` that keeps non-ASCII)."""
    from jinja2 import TemplateError

    try:
        return (
            _jinja_environment()
            .from_string(template)
            .render(
                messages=[dict(m) for m in messages],
                add_generation_prompt=add_generation_prompt,
                tools=None,
                documents=None,
                **special,
            )
        )
    except TemplateError as exc:
        raise RequestError("messages", "<conversation>", f"the chat template refused it: {exc}") from exc


def _jinja_environment() -> Any:
    """The sandboxed environment chat templates render in (as ``transformers``' own)."""
    from jinja2 import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    def tojson(
        value: Any,
        ensure_ascii: bool = False,
        indent: Any = None,
        separators: Any = None,
        sort_keys: bool = False,
    ) -> str:
        return json.dumps(
            value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env
