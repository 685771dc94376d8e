"""Parsed GGUF headers kept per file within one process, so a second load does not parse again.

Parsing SmolLM2's header (49k tokens, 49k merges as Python strings) takes ~80 ms; a notebook
or a server that loads the same file twice pays it once. A cached header is reused only when
the file's current header bytes are the very bytes that were parsed: the entry keeps their
length and BLAKE2b digest, and a lookup hashes that many bytes of the file as it is now
(~1.5 ms for 1.8 MB). So a rewritten file, even one patched in place with the same size and
modification time, is parsed afresh; the tensor data after the header is never cached (the
reader maps it anew each time and checks every tensor's bounds against the file's size).

Everything a header yields is immutable in use: the metadata values (strings, numbers, lists
nobody appends to) and the tensor infos. Tokenizers built from a cached header are cached by
its digest too (``cached_tokenizer``), and each load gets its own copy.
"""

from __future__ import annotations

import copy
import hashlib
import os
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

MAX_FILES = 4  # headers kept (least recently used dropped first); SmolLM2's is ~15 MB of Python objects


@dataclass(frozen=True)
class Header:
    size: int  # the file's size when parsed: a different size is a different file
    header_len: int  # bytes from the magic to the end of the tensor infos
    digest: bytes  # BLAKE2b of those bytes
    metadata: dict[str, Any]
    infos: list[tuple[str, list[int], int, int]]  # (name, dims, type id, offset)


_HEADERS: OrderedDict[str, Header] = OrderedDict()
_TOKENIZERS: OrderedDict[tuple[bytes, str], Any] = OrderedDict()


def _key(path: Path) -> str:
    return os.path.realpath(path)


def _digest(buf: memoryview, n_bytes: int) -> bytes:
    return hashlib.blake2b(buf[:n_bytes], digest_size=32).digest()


def lookup(path: Path, buf: memoryview) -> Header | None:
    """The cached header of ``path`` if its first bytes are still the ones parsed, else None."""
    entry = _HEADERS.get(_key(path))
    if entry is None or entry.size != len(buf) or _digest(buf, entry.header_len) != entry.digest:
        return None
    _HEADERS.move_to_end(_key(path))
    return entry


def store(path: Path, buf: memoryview, header_len: int, metadata: dict[str, Any],
          infos: list[tuple[str, list[int], int, int]]) -> Header:
    entry = Header(len(buf), header_len, _digest(buf, header_len), metadata, infos)
    _HEADERS[_key(path)] = entry
    _HEADERS.move_to_end(_key(path))
    while len(_HEADERS) > MAX_FILES:
        _HEADERS.popitem(last=False)
    return entry


def cached_tokenizer(digest: bytes, source: str, build: Callable[[], Any]) -> Any:
    """``build()``'s tokenizer for the header ``digest`` read as ``source``, built once per
    process; every call gets a copy of its own (attributes such as ``chat_template`` and
    containers are not shared between models)."""
    key = (digest, source)
    if key not in _TOKENIZERS:
        tokenizer = build()
        if tokenizer is None:
            return None
        _TOKENIZERS[key] = tokenizer
        while len(_TOKENIZERS) > MAX_FILES:
            _TOKENIZERS.popitem(last=False)
    _TOKENIZERS.move_to_end(key)
    return _own_copy(_TOKENIZERS[key])


def _own_copy(tokenizer: Any) -> Any:
    clone = copy.copy(tokenizer)  # the backend (a Rust tokenizer, never changed after building) is shared
    for name, value in vars(tokenizer).items():
        if isinstance(value, (dict, list, set)):
            setattr(clone, name, copy.copy(value))
    return clone


def clear() -> None:
    """Forget every cached header and tokenizer (tests; memory)."""
    _HEADERS.clear()
    _TOKENIZERS.clear()
