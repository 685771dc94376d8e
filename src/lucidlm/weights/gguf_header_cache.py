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

Large headers are also kept on disk, for the next process: ``$LUCIDLM_CACHE/gguf-headers/``
holds one JSON file per GGUF path (its size, header length and digest, the metadata and the
tensor infos). A fresh process parses SmolLM2's header in ~45 ms and reads that JSON in ~17 ms,
before its first token. The same check guards it: the entry is used only when the file has
the size it had and its first ``header_len`` bytes hash to the digest written; anything else
(another file, a patched one, a cache file that does not parse or has the wrong shape) means
parsing, and a new entry replaces the old. JSON keeps every metadata value a GGUF header can
hold exactly (Python ints of any size, floats by their shortest repr, NaN and infinities,
booleans, nested lists, any text). It is a cache: unreadable or unwritable, it is skipped;
small headers are not written (``DISK_MIN_BYTES``), and the oldest entries beyond
``DISK_MAX_FILES`` are removed.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from lucidlm.cache_dir import cache_root
from lucidlm.staging import atomic_write_text

MAX_FILES = 4  # headers kept (least recently used dropped first); SmolLM2's is ~15 MB of Python objects
DISK_DIR = "gguf-headers"
DISK_FORMAT = 1
DISK_MIN_BYTES = 64 << 10  # smaller headers parse in about the time their JSON takes to read
DISK_MAX_FILES = 16


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


def _matches(entry: Header, buf: memoryview) -> bool:
    return entry.size == len(buf) and 0 < entry.header_len <= len(buf) and \
        _digest(buf, entry.header_len) == entry.digest


def lookup(path: Path, buf: memoryview) -> Header | None:
    """The cached header of ``path`` (this process's, else the one on disk) if the file's first
    bytes are still the ones parsed, else None."""
    key = _key(path)
    entry = _HEADERS.get(key)
    if entry is None or not _matches(entry, buf):
        entry = _from_disk(key, buf)
        if entry is None:
            return None
        _HEADERS[key] = entry
    _HEADERS.move_to_end(key)
    return entry


def store(path: Path, buf: memoryview, header_len: int, metadata: dict[str, Any],
          infos: list[tuple[str, list[int], int, int]]) -> Header:
    entry = Header(len(buf), header_len, _digest(buf, header_len), metadata, infos)
    key = _key(path)
    _HEADERS[key] = entry
    _HEADERS.move_to_end(key)
    while len(_HEADERS) > MAX_FILES:
        _HEADERS.popitem(last=False)
    if header_len >= DISK_MIN_BYTES:
        _to_disk(key, entry)
    return entry


def _disk_path(key: str) -> Path:
    name = hashlib.blake2b(key.encode("utf-8", "surrogateescape"), digest_size=16).hexdigest()
    return cache_root() / DISK_DIR / f"{name}.json"


def _from_disk(key: str, buf: memoryview) -> Header | None:
    try:
        data = json.loads(_disk_path(key).read_bytes())
        entry = Header(data["size"], data["header_len"], bytes.fromhex(data["digest"]), data["metadata"],
                       [(name, [int(d) for d in dims], int(kind), int(offset))
                        for name, dims, kind, offset in data["infos"]])
        if data["format"] != DISK_FORMAT or data["path"] != key or not isinstance(entry.metadata, dict) or \
                not isinstance(entry.header_len, int) or not all(isinstance(info[0], str) for info in entry.infos):
            return None
    except (OSError, RuntimeError, ValueError, KeyError, TypeError, AttributeError):  # none, or not ours: parse
        return None
    return entry if _matches(entry, buf) else None


def _to_disk(key: str, entry: Header) -> None:
    record = {"format": DISK_FORMAT, "path": key, "size": entry.size, "header_len": entry.header_len,
              "digest": entry.digest.hex(), "metadata": entry.metadata, "infos": entry.infos}
    try:
        target = _disk_path(key)  # (no home directory: RuntimeError)
        atomic_write_text(target, json.dumps(record, separators=(",", ":")))
        kept = sorted(target.parent.glob("*.json"), key=lambda p: p.stat().st_mtime_ns, reverse=True)
        for old in kept[DISK_MAX_FILES:]:
            old.unlink(missing_ok=True)
    except (OSError, RuntimeError, ValueError):  # a cache: not writable, full, no home, or a value JSON cannot hold
        pass


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
