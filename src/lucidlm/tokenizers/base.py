"""The interface every lucidlm tokenizer implements, and loading one back from JSON.

A tokenizer turns text into a list of integer ids and back. Each one saves itself as a
single JSON file whose ``"type"`` field names the class, so ``load_tokenizer(path)`` can
rebuild the right kind without the caller knowing which it was.

Special tokens (``<|endoftext|>``, ``<pad>``, ...) are strings that map to one id each and
are never split. ``encode(text, allowed_special=...)`` decides whether such a string in
the input is that one id (allowed) or ordinary text (not allowed): the same choice
tiktoken offers, because text scraped from the web can contain ``<|endoftext|>`` on purpose
or by accident.

This file is the ``Tokenizer`` base class and the registry ``load_tokenizer`` dispatches on;
what ``encode`` accepts (the text, ``allowed_special``) and cutting special tokens out of
text live in ``encode_input.py``, and reading the JSON file back in ``tokenizer_file.py``.
"""

from __future__ import annotations

import json
import operator
import re
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, ClassVar

from lucidlm.errors import TokenizerError
from lucidlm.suggest import did_you_mean
from lucidlm.tokenizers.encode_input import (  # noqa: F401  (check_text re-exported: this module was its home)
    AllowedSpecial, allowed_special_set, check_text, compile_special_regex, list_names, split_on_special)
from lucidlm.tokenizers.tokenizer_file import FORMAT_VERSION, read_tokenizer_json

# type name written in the JSON file -> class; filled in by Tokenizer.__init_subclass__
_TOKENIZER_TYPES: dict[str, type["Tokenizer"]] = {}


class Tokenizer(ABC):
    """Text <-> ids. Subclasses set ``type_name`` and implement the abstract methods."""

    type_name: ClassVar[str] = ""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.type_name:  # register concrete tokenizers so load_tokenizer can find them
            _TOKENIZER_TYPES[cls.type_name] = cls

    def __init__(
        self,
        special_tokens: dict[str, int],
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        pad_token: str | None = None,
    ) -> None:
        self.special_tokens: dict[str, int] = dict(special_tokens)
        for role, name in (("bos", bos_token), ("eos", eos_token), ("pad", pad_token)):
            if name is not None and name not in self.special_tokens:
                raise TokenizerError(
                    f"{role}_token {name!r} is not one of this tokenizer's special tokens "
                    f"{list_names(self.special_tokens)}; add it to special_tokens or pass None"
                    f"{did_you_mean(name, self.special_tokens)}"
                )
        self.bos_token, self.eos_token, self.pad_token = bos_token, eos_token, pad_token
        self._special_regex_compiled: re.Pattern[str] | None | bool = False  # compiled on first need
        self._longest: int | None = None  # the longest token's bytes, counted on first need (fewest_tokens)

    @property
    def _special_regex(self) -> re.Pattern[str] | None:
        """One regex over every special token's name, compiled the first time a text is split
        on them: Gemma 3's 6,249 names took ~0.2 s of its load, and an ``HFTokenizer`` that may
        use every special token leaves the splitting to its backend and never needs it."""
        if self._special_regex_compiled is False:
            self._special_regex_compiled = compile_special_regex(self.special_tokens)
        return self._special_regex_compiled

    # ----------------------------------------------------------------- abstract core

    @property
    @abstractmethod
    def vocab_size(self) -> int:
        """Number of distinct ids: every id is in ``range(vocab_size)``."""

    @abstractmethod
    def _encode_ordinary(self, text: str, offset: int) -> list[int]:
        """Encode text that holds no special token. ``offset`` is where ``text`` starts in
        the caller's string, so errors can name the position the user sees."""

    @abstractmethod
    def _token_bytes(self, token_id: int) -> bytes:
        """The bytes of one in-range id (no range check: callers do it)."""

    @abstractmethod
    def _to_dict(self) -> dict[str, Any]:
        """Everything besides ``type``/``version`` needed to rebuild this tokenizer."""

    @classmethod
    @abstractmethod
    def _from_dict(cls, data: dict[str, Any]) -> "Tokenizer":
        """Inverse of ``_to_dict``."""

    # ----------------------------------------------------------------- encode / decode

    def encode(self, text: str, *, allowed_special: AllowedSpecial = True) -> list[int]:
        """Text -> ids. Special tokens in ``allowed_special`` become their single id."""
        check_text(text)
        ids: list[int] = []
        for start, piece, is_special in self._split_on_special(text, allowed_special):
            if is_special:
                ids.append(self.special_tokens[piece])
            elif piece:
                ids.extend(self._encode_ordinary(piece, start))
        return ids

    def decode_bytes(self, ids: Iterable[int], *, skip_special_tokens: bool = False) -> bytes:
        """Ids -> the raw bytes they stand for. Streaming uses this so that it never
        emits half of a multi-byte UTF-8 character."""
        return b"".join(self._token_bytes(i) for i in self._kept(ids, skip_special_tokens))

    def decode(self, ids: Iterable[int], *, skip_special_tokens: bool = False) -> str:
        """Ids -> text; byte sequences that are not valid UTF-8 become U+FFFD.
        ``skip_special_tokens=True`` leaves out ``<|endoftext|>``, ``<|im_end|>`` and the
        like, as transformers' ``decode`` does (an HF tokenizer skips the added tokens its
        file flags special)."""
        return self.decode_bytes(ids, skip_special_tokens=skip_special_tokens).decode("utf-8", errors="replace")

    def id_to_token(self, token_id: int) -> str:
        """A readable piece for one id (plots, debugging). Not always decodable on its own:
        a byte-level token holding half a character shows U+FFFD."""
        (token_id,) = self._checked([token_id])
        return self._token_bytes(token_id).decode("utf-8", errors="replace")

    def fewest_tokens(self, text: str) -> int:
        """A lower bound on ``len(encode(text))`` found without encoding, so that a text far
        too long for a model's context is refused before its ids cost gigabytes. Where every id
        stands for bytes of the text, in order, with none dropped or rewritten (byte-level BPE,
        characters), no id covers more than the longest token's bytes; 0 (no bound) for a
        tokenizer that may drop or rewrite text (words split on whitespace, a normalizer)."""
        if not self._spells_out_text():
            return 0
        size = self._bytes_spelled(text.encode("utf-8", errors="surrogatepass"))  # a lone surrogate: refused later
        return -(-size // self._longest_token_bytes()) if size else 0

    def _bytes_spelled(self, data: bytes) -> int:
        """How many of the text's bytes its ids spell out: all of them, unless a tokenizer drops some."""
        return len(data)

    def _spells_out_text(self) -> bool:
        """Whether each id's ``_token_bytes`` is a piece of the text it came from, the pieces
        together all of it (a special token's id: its name)."""
        return False

    def _longest_token_bytes(self) -> int:
        if getattr(self, "_longest", None) is None:  # (None too on one unpickled from before it was kept)
            self._longest = max(len(self._token_bytes(i)) for i in range(self.vocab_size))
        return self._longest

    # ----------------------------------------------------------------- special ids

    @property
    def bos_id(self) -> int | None:
        return self.special_tokens[self.bos_token] if self.bos_token is not None else None

    @property
    def eos_id(self) -> int | None:
        return self.special_tokens[self.eos_token] if self.eos_token is not None else None

    @property
    def pad_id(self) -> int | None:
        return self.special_tokens[self.pad_token] if self.pad_token is not None else None

    # ----------------------------------------------------------------- save / load

    def save(self, path: str | Path) -> None:
        """Write this tokenizer as one JSON file (``"type"`` says which class reads it)."""
        data = {"type": self.type_name, "version": FORMAT_VERSION, **self._to_dict()}
        from lucidlm.staging import atomic_write_text

        # ensure_ascii keeps the file valid UTF-8 even if a vocabulary holds lone surrogates; a
        # staging file keeps the previous one whole when the write fails (a full disk)
        atomic_write_text(Path(path), json.dumps(data, ensure_ascii=True, indent=1))

    @classmethod
    def load(cls, path: str | Path) -> "Tokenizer":
        """Read a file written by ``save``. On a subclass, the file must be of that type."""
        data = read_tokenizer_json(path, sorted(_TOKENIZER_TYPES))
        target = _TOKENIZER_TYPES.get(data["type"])
        if target is None:
            raise TokenizerError(
                f"{path}: unknown tokenizer type {data['type']!r}; "
                f"known types are {sorted(_TOKENIZER_TYPES)}"
            )
        if cls is not Tokenizer and not issubclass(target, cls):
            raise TokenizerError(
                f"{path} holds a {data['type']!r} tokenizer, not a {cls.type_name!r} one; "
                f"use lucidlm.tokenizers.load_tokenizer() to load any type"
            )
        try:
            tokenizer = target._from_dict(data)
        except (KeyError, TypeError, ValueError) as err:
            if isinstance(err, TokenizerError):
                raise TokenizerError(f"{path}: {err}") from err
            raise TokenizerError(
                f"{path}: malformed {data['type']!r} tokenizer file ({type(err).__name__}: "
                f"{err}); re-create it with Tokenizer.save()"
            ) from err
        if getattr(tokenizer, "chat_template", None) and not getattr(tokenizer, "chat_template_source", None):
            tokenizer.chat_template_source = f"{path} (chat_template)"  # named by chat-template errors
        if hasattr(tokenizer, "source") and not tokenizer.source:
            tokenizer.source = str(path)
        return tokenizer

    # ----------------------------------------------------------------- helpers

    def _skippable_ids(self) -> frozenset[int]:
        """The ids ``decode(..., skip_special_tokens=True)`` leaves out."""
        return frozenset(self.special_tokens.values())

    def _kept(self, ids: Iterable[int], skip_special_tokens: bool) -> Iterator[int]:
        """The in-range ids to decode: all of them, or those that are not special tokens."""
        if not skip_special_tokens:
            return self._checked(ids)
        skipped = self._skippable_ids()
        return (i for i in self._checked(ids) if i not in skipped)

    def _checked(self, ids: Iterable[int]) -> Iterator[int]:
        """Yield ids, raising TokenizerError on the first one outside the vocabulary."""
        size = self.vocab_size
        if isinstance(ids, (str, bytes)):
            raise TokenizerError(f"decode() takes token ids (ints), got a {type(ids).__name__}: {ids[:40]!r}")
        for token_id in ids:
            try:
                token_id = operator.index(token_id)  # ints and numpy / torch integer scalars, never 2.5 or '7'
            except TypeError:
                raise TokenizerError(f"token ids must be ints, got {token_id!r} ({type(token_id).__name__})") from None
            if not 0 <= token_id < size:
                raise TokenizerError(
                    f"token id {token_id} is out of range for this {self.type_name} "
                    f"tokenizer (vocab_size={size}, valid ids 0..{size - 1}); the ids "
                    f"probably come from a model with a different vocabulary"
                )
            yield token_id

    def _allowed_special_set(self, allowed_special: AllowedSpecial) -> set[str]:
        return allowed_special_set(allowed_special, self.special_tokens)

    def _split_on_special(
        self, text: str, allowed_special: AllowedSpecial
    ) -> Iterator[tuple[int, str, bool]]:
        """Yield (start offset, piece, is_special) covering ``text`` in order."""
        allowed = self._allowed_special_set(allowed_special)
        every = len(allowed) == len(self.special_tokens)  # (allowed is a subset of them)
        return split_on_special(text, allowed, self._special_regex if every else compile_special_regex(allowed))

    def __repr__(self) -> str:
        return f"{type(self).__name__}(vocab_size={self.vocab_size})"


def starts_with_added_bos(tokenizer: Any, ids: list[int]) -> bool:
    """Whether ``ids`` (from ``tokenizer.encode``) start with the BOS id that encode puts first
    by itself (a tokenizer whose model wants one: ``add_bos``). Text that goes after other
    tokens (a completion, a chat the template wrote BOS into) drops it."""
    return bool(getattr(tokenizer, "add_bos", False)) and bool(ids) and ids[0] == getattr(tokenizer, "bos_id", None)


def load_tokenizer(path: str | Path) -> Tokenizer:
    """Load any tokenizer saved with ``save()``, dispatching on the file's ``"type"``."""
    return Tokenizer.load(path)
