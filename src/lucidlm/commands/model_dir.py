"""Saving a model into a directory (``convert`` / ``merge``): never over the model it is made
from (``refuse_writing_over``), nor where it would be hidden or fail half-way
(``refuse_unusable_output``). Over an earlier model (with ``--force``) the saves themselves
remove that model's files they do not rewrite (``weights.checkpoint.replacing_model``,
re-exported here: the commands use the names of the files it wrote).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

from lucidlm.errors import OutputError
from lucidlm.weights.checkpoint import (TRAINER_STATE_NAME, blocked_model_files, model_dir_read, model_file_names,
                                        replacing_model)


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


# What a model or adapter is read from (weights, configs, tokenizers: tokenizer.model, Meta's .pth)
_INPUT_SUFFIXES = (".safetensors", ".gguf", ".json", ".pth", ".bin", ".model")


def refuse_writing_over_input(out_file: Path, sources: dict[str, Optional[str]], out_flag: str) -> None:
    """Refuse an output file (``inspect --out``) that would replace what a model or adapter is
    read from: the ``.gguf`` file given as the source, or a weights, config or tokenizer file in
    the directory it is read from (a report written as MODEL/model.safetensors replaced the model
    it describes). ``sources`` maps each input's flag to its path; real paths are compared."""
    out = Path(os.path.realpath(out_file.expanduser()))
    for flag, source in sources.items():
        path = Path(source).expanduser() if source else None
        if path is None or not path.exists():  # a pretrained name: nothing a report can replace
            continue
        if path.is_dir():
            read_from = {Path(os.path.realpath(path)), Path(os.path.realpath(model_dir_read(path)))}
            hit = out.parent in read_from and out.suffix.lower() in _INPUT_SUFFIXES
        else:
            hit = out == Path(os.path.realpath(path))
        if hit:
            raise OutputError(f"{out_flag} {out_file} is where {flag} {source} is read from: writing there would "
                              f"replace it; choose another {out_flag}.")


def refuse_unusable_output(out_dir: Path, out_flag: str) -> None:
    """Refuse, before any work, an output directory a saved model could not be used from:

    - one holding a training run (RUN/checkpoint, or an interrupted swap's RUN/.checkpoint.old-*):
      ``lucidlm.load(RUN)`` and ``generate --model RUN`` read that checkpoint before any model
      files beside it, so the new model would be hidden from lucidlm while transformers reads it;
    - a training checkpoint itself (RUN/checkpoint): the save would replace the model a resume
      continues, beside its optimizer state. A run's checkpoint is the user's work, never
      replaced or removed to make room;
    - one where a model file's name is taken by a directory (``OUT/config.json/``): the save
      would fail only after writing the files before it (``checkpoint.blocked_model_files``)."""
    if not out_dir.is_dir():
        return
    run_checkpoint = model_dir_read(out_dir)
    if run_checkpoint != out_dir:
        raise OutputError(f"{out_flag} {out_dir} holds a training run: lucidlm.load({str(out_dir)!r}) and "
                          f"`generate --model {out_dir}` read its checkpoint {run_checkpoint} before any model "
                          f"written beside it, so the new model would be hidden behind the run's; choose another "
                          f"{out_flag} (the run is left as it is).")
    if (out_dir / TRAINER_STATE_NAME).is_file():
        raise OutputError(f"{out_flag} {out_dir} is a training checkpoint ({TRAINER_STATE_NAME}): writing there "
                          f"would replace the model its run resumes from; choose another {out_flag}.")
    blocked = blocked_model_files(out_dir)
    if blocked:
        raise OutputError(f"cannot write {blocked[0]} (it is a directory): move it out of the way or choose another "
                          f"{out_flag}.")


__all__ = ["model_file_names", "refuse_unusable_output", "refuse_writing_over", "refuse_writing_over_input",
           "replacing_model"]
