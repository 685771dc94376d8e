"""Checksums of weight files, verified once and remembered by a stamp.

A weight file that comes with a known SHA-256 (the embedded model: pip's ``RECORD`` of its
distribution; Gemma's joined parts; a model lucidlm saved, whose ``checksums.json`` it wrote)
is hashed and compared on first use. Hashing costs ~0.1 s per 100 MB, too much for every load,
so a match leaves a stamp in the cache (``$LUCIDLM_CACHE/verified/``) recording the file's
path, size, mtime_ns, ctime_ns, inode and digest; later loads hash again only when the file's
stat no longer matches its stamp (any write changes mtime or ctime; a file changed in the last
two seconds gets no stamp yet, as a change within one clock tick might not show). The stamp is
a cache, never a requirement: when the cache cannot be read or written (read-only, full),
every load hashes.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.metadata
import json
import os
import time
from pathlib import Path
from typing import Optional

from lucidlm.cache_dir import cache_root
from lucidlm.errors import WeightsError

_BLOCK = 1 << 20
RACY_NS = 2_000_000_000
STAMP_DIR = "verified"


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_BLOCK):
            digest.update(block)
    return digest.hexdigest()


def record_sha256(distribution: str, filename: str) -> Optional[str]:
    """The hex SHA-256 that pip's RECORD of ``distribution`` lists for ``filename`` (None when
    the distribution or its RECORD has none, e.g. an editable install)."""
    try:
        files = importlib.metadata.files(distribution) or []
    except importlib.metadata.PackageNotFoundError:
        return None
    return next((entry_sha256(f) for f in files if f.name == filename), None)


def entry_sha256(entry: importlib.metadata.PackagePath) -> Optional[str]:
    """A RECORD entry's SHA-256 as hex (RECORD stores urlsafe base64 without padding)."""
    if entry.hash is None or entry.hash.mode != "sha256":
        return None
    return base64.urlsafe_b64decode(entry.hash.value + "=" * (-len(entry.hash.value) % 4)).hex()


def verify_sha256(path: Path, expected: str, fix: str, cache: Optional[Path] = None) -> bool:
    """Raise WeightsError unless ``path`` has SHA-256 ``expected``. True when it was hashed now,
    False when a matching stamp vouched for it. ``cache`` defaults to lucidlm's cache dir."""
    path = Path(path).absolute()
    stamp_path = _stamp_path(path, cache)
    before = _stat_key(path, expected)
    if before is not None and _read_stamp(stamp_path) == before:
        return False
    actual = sha256_file(path)
    if actual != expected.lower():
        raise WeightsError(f"{path} is damaged: its SHA-256 is {actual}, expected {expected.lower()} (bytes changed "
                           f"since it was written). {fix}")
    if before is not None and _stat_key(path, expected) == before and not _racy(before):
        write_stamp(stamp_path, before)
    return True


def _racy(key: dict) -> bool:
    """A file changed within the last RACY_NS could change again within the same timestamp
    tick (filesystems keep coarse clocks) without its stat changing: no stamp for it yet."""
    return time.time_ns() - max(key["mtime_ns"], key["ctime_ns"]) < RACY_NS


def write_stamp(stamp_path: Path, key: dict) -> None:
    """Best effort: a cache that cannot be written only means hashing again next time."""
    from lucidlm.staging import atomic_write_text

    try:
        atomic_write_text(stamp_path, json.dumps(key), 0o666)
    except OSError:
        pass


def _stamp_path(path: Path, cache: Optional[Path]) -> Path:
    if cache is None:
        cache = cache_root()
    name = hashlib.sha256(str(path).encode("utf-8", "surrogateescape")).hexdigest()[:32]
    return Path(cache) / STAMP_DIR / f"{name}.json"


def _stat_key(path: Path, digest: str) -> Optional[dict]:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return {"path": str(path), "size": st.st_size, "mtime_ns": st.st_mtime_ns, "ctime_ns": st.st_ctime_ns,
            "inode": st.st_ino, "device": st.st_dev, "sha256": digest.lower()}


def _read_stamp(stamp_path: Path) -> Optional[dict]:
    try:
        return json.loads(stamp_path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None  # absent, unreadable or torn: verify by hashing
