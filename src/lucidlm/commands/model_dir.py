"""Saving a model into a directory (``convert`` / ``merge``): never over the model it is made
from (``refuse_writing_over``). Over an earlier model (with ``--force``) the saves themselves
remove that model's files they do not rewrite (``weights.checkpoint.replacing_model``,
re-exported here: the commands use the names of the files it wrote).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

from lucidlm.errors import OutputError
from lucidlm.weights.checkpoint import model_dir_read, model_file_names, replacing_model


def refuse_writing_over(out_dir: Path, source: Optional[str], what: str, out_flag: str) -> None:
    """Refuse an output directory that is the directory a model (or adapter) ``source`` is read
    from, or lies on the way from ``source`` to it (a training run RUN is read from RUN/checkpoint:
    OUT_DIR RUN/checkpoint, and RUN itself, whose new model would hide its checkpoint). A save there
    would replace the input it is made from. Real paths are compared (``~``, ``..`` and symbolic
    links resolved), never the strings. A directory beside or below the model is fine: it changes
    none of its files. ``what`` and ``out_flag`` name the two in the message."""
    if source is None:
        return
    path = Path(source).expanduser()
    if not path.is_dir():  # a pretrained name or a .gguf file: nothing a model directory can replace
        return
    start, read = Path(os.path.realpath(path)), Path(os.path.realpath(model_dir_read(path)))
    out = Path(os.path.realpath(out_dir.expanduser()))
    if out == read or (out in read.parents and (out == start or start in out.parents)):
        shown = "" if read == start else f" (read from {read})"
        raise OutputError(f"{out_flag} {out_dir} is the {what} {source}{shown}: writing there would replace the "
                          f"model it is made from; choose another {out_flag}.")

__all__ = ["model_file_names", "refuse_writing_over", "replacing_model"]
