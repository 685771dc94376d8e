"""Saving a model over an earlier one (``convert`` / ``merge`` with ``--force``).

A lucidlm save and a Hugging Face save write different files. Written into a directory that
held the other kind, the old files stayed beside the new ones: an old ``lucidlm_config.json``
and ``checksums.json`` made lucidlm read a fresh Hugging Face save as its own format and call
its new weights damaged. So after a save, the model files lucidlm writes (either format's)
that this save did not rewrite are removed; any other file (the user's) is left alone.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Optional


def model_file_names() -> tuple[str, ...]:
    """Every file a lucidlm save (``save_model``) or a Hugging Face save (``save_hf``) writes."""
    from lucidlm.weights import checkpoint, hf
    from lucidlm.weights.hf_generation_config import CONFIG_NAME, GENERATION_CONFIG_NAME

    return (checkpoint.CONFIG_NAME, checkpoint.WEIGHTS_NAME, checkpoint.TOKENIZER_NAME, checkpoint.QUANTIZATION_NAME,
            checkpoint.CHECKSUMS_NAME, CONFIG_NAME, GENERATION_CONFIG_NAME, hf.WEIGHTS_NAME, hf.TOKENIZER_NAME,
            hf.TOKENIZER_CONFIG_NAME)


@contextmanager
def replacing_model(directory: Path) -> Iterator[list[str]]:
    """Around a save into ``directory``: once it has succeeded, remove the stale model files
    (named by ``model_file_names``, present before and untouched by the save) and fill the
    yielded list with the names of the files the save wrote. A failed save removes nothing."""
    before = {path.name: _stamp(path) for path in _entries(directory)}
    written: list[str] = []
    yield written
    ours = set(model_file_names())
    for path in _entries(directory):
        if before.get(path.name) != _stamp(path):  # new, or replaced (atomic writes make a new file)
            written.append(path.name)
        elif path.name in ours and path.is_file():
            path.unlink()
    written.sort()


def _entries(directory: Path) -> list[Path]:
    """The plain files of ``directory`` (staging files, which start with ".", left out)."""
    if not directory.is_dir():
        return []
    return [p for p in directory.iterdir() if not p.name.startswith(".") and p.is_file() and not p.is_symlink()]


def _stamp(path: Path) -> Optional[tuple[int, int, int, int]]:
    """What changes when a file is written: a new inode (written beside and renamed in), or the
    modification and change times and the size (written in place)."""
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return st.st_ino, st.st_mtime_ns, st.st_ctime_ns, st.st_size
