"""lucidlm's own model format: a directory with the config, safetensors weights and tokenizer.

    DIR/lucidlm_config.json   ModelConfig fields
    DIR/model.safetensors     weights under our parameter names
    DIR/tokenizer.json        the tokenizer, when the model has one (our JSON, with "type")

Training checkpoints add optimizer and RNG state beside these (see training/checkpoint.py).
"""

from __future__ import annotations

import errno
import json
import os
import re
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Optional

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from lucidlm.config import ModelConfig
from lucidlm.errors import CheckpointError
from lucidlm.model.transformer import Transformer
from lucidlm.outputs import user_path
from lucidlm.staging import atomic_write_text, publish, replacing_files, staging_file
from lucidlm.validation import read_json_object
from lucidlm.weights.finite import check_finite
from lucidlm.weights.integrity import sha256_file, verify_sha256
from lucidlm.weights.state import load_into, own_state_dict
from lucidlm.weights.hf_generation_config import use_generation_eos_ids, write_generation_config

CONFIG_NAME = "lucidlm_config.json"
WEIGHTS_NAME = "model.safetensors"
TOKENIZER_NAME = "tokenizer.json"
QUANTIZATION_NAME = "quantization.json"  # only for quantized models: which module has which scheme
# quantization.json's "format": a later lucidlm may store the codes otherwise, so a newer one is refused
QUANTIZATION_FORMAT = 1
CHECKSUMS_NAME = "checksums.json"  # SHA-256 of the weights, written last: flipped bytes are found on load
# A training run's previous checkpoint while a new one is swapped in (training/checkpoint.py)
OLD_CHECKPOINT_PREFIX = ".checkpoint.old-"
# What a training checkpoint holds besides (or instead of) the model (training/checkpoint.py)
TRAINER_STATE_NAME = "trainer_state.json"
OPTIMIZER_STATE_NAME = "optimizer.safetensors"
TRAINABLE_NAME = "trainable.safetensors"  # the payload of a LoRA / adapter / prefix run


def interrupted_checkpoint(run_dir: Path) -> Path | None:
    """The previous checkpoint of a run killed between the two renames that swap a new
    checkpoint in (OUT/checkpoint gone, OUT/.checkpoint.old-* complete), read where it lies:
    loading never moves a run's files (the next ``train --resume`` puts it back). The same
    one ``train --resume`` puts back (``previous_checkpoints``)."""
    return next((p for p in previous_checkpoints(run_dir) if is_checkpoint_dir(p)), None)


def previous_checkpoints(run_dir: Path) -> list[Path]:
    """The run's ``OUT/.checkpoint.old-*`` directories, the one to use first: complete training
    checkpoints before anything else, of those the highest step, then (same step) the newest.
    A killed run can leave more than one (an older leftover whose removal was interrupted or
    failed); their names (host-pid-random) say nothing about which is newer. This one order is
    what ``lucidlm.load`` and ``train --resume`` (``training/checkpoint.find_checkpoint``) share,
    so both read the same checkpoint."""
    def rank(path: Path) -> tuple[bool, int, int]:
        step = saved_step(path)
        try:
            mtime = path.stat().st_mtime_ns
        except OSError:
            mtime = 0
        return step is not None, -1 if step is None else step, mtime

    try:
        olds = [p for p in Path(run_dir).glob(f"{OLD_CHECKPOINT_PREFIX}*") if p.is_dir()]
    except OSError:
        return []
    return sorted(olds, key=rank, reverse=True)


def saved_step(directory: Path) -> int | None:
    """The step of the complete training checkpoint in ``directory``: trainer state, optimizer
    and the weights (the model, or only the trainable ones) all present. None when it is not
    one: a file missing (a half-deleted directory), or no step in trainer_state.json. Only
    whether the files are there is checked; a resume reads them in full."""
    directory = Path(directory)
    try:
        has_weights = ((directory / CONFIG_NAME).is_file() and (directory / WEIGHTS_NAME).is_file()) \
            or (directory / TRAINABLE_NAME).is_file()
        if not (has_weights and (directory / OPTIMIZER_STATE_NAME).is_file()):
            return None
        step = json.loads((directory / TRAINER_STATE_NAME).read_text(encoding="utf-8")).get("step")
    except (OSError, ValueError, AttributeError):  # missing, unreadable, not JSON, not an object
        return None
    return step if isinstance(step, int) and not isinstance(step, bool) and step >= 0 else None


def is_checkpoint_dir(path: Path) -> bool:
    return path.is_dir() and (path / CONFIG_NAME).is_file()


def model_dir_read(path: Path) -> Path:
    """The directory ``lucidlm.load(path)`` reads a model directory ``path`` from: ``path`` itself,
    or a training run's checkpoint (RUN/checkpoint, or an interrupted swap's RUN/.checkpoint.old-*)
    (the order of ``loading._load_float``). What a write must not go over (``convert``, ``merge``)."""
    if is_checkpoint_dir(path):
        return path
    if is_checkpoint_dir(path / "checkpoint"):
        return path / "checkpoint"
    if not (path / "checkpoint").exists():
        return interrupted_checkpoint(path) or path
    return path


def atomic_save_safetensors(tensors: dict[str, torch.Tensor], path: Path,
                            metadata: Optional[dict[str, str]] = None) -> None:
    """Write to a staging file in the same directory, then rename: a crash mid-write
    leaves the previous file intact, never a truncated one (see ``lucidlm.staging``)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    out, tmp = staging_file(path)
    out.close()
    try:
        try:
            save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(tmp), metadata=metadata)
        except SafetensorError as exc:  # its I/O errors (a full disk) are no OSError: make them one
            raise _os_error(exc, path) from None
        publish(tmp, path, 0o644)
    finally:
        tmp.unlink(missing_ok=True)


def _os_error(exc: SafetensorError, path: Path) -> Exception:
    """The OSError a SafetensorError for an I/O error stands for ("... I/O error: No space left
    on device (os error 28)"), so ``outputs.writing`` names the path; any other one as it is."""
    found = re.search(r"\(os error (\d+)\)", str(exc))
    if found is None:
        return exc
    code = int(found.group(1))
    return OSError(code, os.strerror(code), str(path))


# The tokenizer files transformers' save_pretrained writes besides tokenizer.json and
# tokenizer_config.json (slow tokenizers' vocabularies, older role files): never written by
# lucidlm, but an earlier transformers-saved model's, which AutoTokenizer reads when they are there.
_TRANSFORMERS_TOKENIZER_FILES = ("special_tokens_map.json", "added_tokens.json", "vocab.json", "merges.txt",
                                 "tokenizer.model")


def model_file_names() -> tuple[str, ...]:
    """Every file a lucidlm save (``save_model``) or a Hugging Face save (``hf.save_hf``) writes,
    and those of a model transformers saved (its chat template files, which both transformers and
    lucidlm read before tokenizer_config.json's ``chat_template``, and its other tokenizer files):
    what a save over an earlier model replaces. A name ending in "/" is a directory."""
    from lucidlm.tokenizers.hf_files import CHAT_TEMPLATE_DIR, CHAT_TEMPLATE_FILE
    from lucidlm.weights import hf_config
    from lucidlm.weights.hf_generation_config import GENERATION_CONFIG_NAME

    return (CONFIG_NAME, WEIGHTS_NAME, TOKENIZER_NAME, QUANTIZATION_NAME, CHECKSUMS_NAME, hf_config.CONFIG_NAME,
            GENERATION_CONFIG_NAME, hf_config.WEIGHTS_NAME, hf_config.INDEX_NAME, hf_config.TOKENIZER_NAME,
            hf_config.TOKENIZER_CONFIG_NAME, CHAT_TEMPLATE_FILE, f"{CHAT_TEMPLATE_DIR}/",
            *_TRANSFORMERS_TOKENIZER_FILES)


def blocked_model_files(directory: Path) -> list[Path]:
    """The paths in ``directory`` named like a file a lucidlm save writes that are directories (a
    ``config.json/`` left by an unzip or a mistaken ``mkdir -p``): a save there fails only after
    it has written the files before it, which would then sit beside the old model's. (The names
    only a transformers save writes are not in the way: a folder of that name is left alone.)"""
    from lucidlm.tokenizers.hf_files import CHAT_TEMPLATE_FILE

    never_written = {*_TRANSFORMERS_TOKENIZER_FILES, CHAT_TEMPLATE_FILE}
    return [Path(directory) / name for name in model_file_names()
            if not name.endswith("/") and name not in never_written and (Path(directory) / name).is_dir()]


def replacing_model(directory: Path) -> AbstractContextManager[list[str]]:
    """Around a save into ``directory`` over an earlier model: once it has succeeded, remove the
    model files (either format's, ``model_file_names``) that this save did not rewrite, and yield
    the names of those it wrote. A lucidlm save and a Hugging Face save write different files:
    an old ``lucidlm_config.json`` and ``checksums.json`` left beside a Hugging Face save made it
    read as lucidlm's format with damaged weights, and an old ``tokenizer.json`` beside a model
    saved without a tokenizer was loaded as its tokenizer. ``save_model`` and ``save_hf`` use it.

    Raises IsADirectoryError (an OSError naming the path; ``outputs.writing`` makes it one line)
    before anything is written when a model file's name is taken by a directory."""
    directory = Path(directory)
    blocked = blocked_model_files(directory)
    if blocked:
        raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), str(blocked[0]))
    return replacing_files(directory, model_file_names())


def save_model(model: Transformer, directory: str | Path) -> Path:
    directory = user_path(directory)  # "~/m" is where lucidlm.load("~/m") looks, not ./~/m
    with replacing_model(directory):
        _save_model(model, directory)
    return directory


def _save_model(model: Transformer, directory: Path) -> None:
    from lucidlm.quantization import is_quantized, quantization_layout

    # The old checksums go first: a crash before the new ones are written leaves a directory
    # without checksums (loaded unverified, as before), never one that wrongly looks damaged.
    (directory / CHECKSUMS_NAME).unlink(missing_ok=True)
    atomic_save_safetensors(own_state_dict(model), directory / WEIGHTS_NAME)
    atomic_write_text(directory / CONFIG_NAME, json.dumps(model.config.to_dict(), indent=2) + "\n")
    if is_quantized(model):
        compute = next(m.compute_dtype for m in model.modules() if hasattr(m, "compute_dtype"))
        layout = {"format": QUANTIZATION_FORMAT, "compute_dtype": str(compute).replace("torch.", ""),
                  "modules": quantization_layout(model)}
        atomic_write_text(directory / QUANTIZATION_NAME, json.dumps(layout, indent=2) + "\n")
    elif (directory / QUANTIZATION_NAME).exists():  # a float model over an old quantized one
        (directory / QUANTIZATION_NAME).unlink()
    if model.tokenizer is not None and hasattr(model.tokenizer, "save"):
        model.tokenizer.save(directory / TOKENIZER_NAME)
    write_generation_config(directory, model)  # sampling defaults: read back as a Hugging Face one is
    digest = sha256_file(directory / WEIGHTS_NAME)
    atomic_write_text(directory / CHECKSUMS_NAME, json.dumps({"format": 1, "sha256": {WEIGHTS_NAME: digest}},
                                                             indent=2) + "\n")


def verify_checksums(directory: Path) -> None:
    """Check the files ``checksums.json`` lists (a directory without one, saved by an older
    lucidlm or by hand, is not checked)."""
    from lucidlm.validation import read_json_object

    path = directory / CHECKSUMS_NAME
    if not path.is_file():
        return
    fix = "re-save the model (or restore the directory from a good copy)"
    digests = read_json_object(path, CheckpointError, "checksum file", fix).object("sha256")
    for name in digests.data:
        digest = digests.str(name)
        if Path(name).name != name or name.startswith(".") or len(digest) != 64:
            raise CheckpointError(f"{path}: entry {name!r}: {digest!r} is not a file name and a SHA-256; {fix}.")
        if (directory / name).is_file():
            verify_sha256(directory / name, digest, f"Re-save the model, restore it from a good copy, or, if you "
                                                    f"changed the file on purpose, delete {path.name}.")


def load_model(directory: str | Path, dtype: torch.dtype = torch.float32,
               device: str | torch.device = "cpu", model_cls: type[Transformer] = Transformer) -> Transformer:
    """The model saved in ``directory`` by ``save_model``, built as ``model_cls``."""
    directory = Path(directory)
    if not (directory / CONFIG_NAME).is_file():
        raise CheckpointError(f"{directory} has no {CONFIG_NAME}; it is not a lucidlm model directory.")
    config = ModelConfig.load(directory / CONFIG_NAME)
    weights_path = directory / WEIGHTS_NAME
    if not weights_path.is_file():
        raise CheckpointError(f"{weights_path} is missing; the checkpoint is incomplete (re-save or re-train).")
    verify_checksums(directory)
    try:
        tensors = load_file(weights_path)
    except (SafetensorError, OSError, ValueError) as exc:
        raise CheckpointError(f"{weights_path} cannot be read ({exc}); the file is truncated or corrupted.") from None
    check_finite(tensors, weights_path)
    tokenizer = None
    if (directory / TOKENIZER_NAME).is_file():
        from lucidlm.tokenizers import load_tokenizer
        tokenizer = load_tokenizer(directory / TOKENIZER_NAME)
    model = model_cls.empty(config, device)
    if (directory / QUANTIZATION_NAME).is_file():
        tensors = _install_quantized(model, directory / QUANTIZATION_NAME, tensors, device)
    load_into(model, tensors, weights_path)
    model.tokenizer = tokenizer
    if tokenizer is None:  # the end, bos and pad ids a Hugging Face folder declared, kept by save_model
        use_generation_eos_ids(model, directory)
    return model.to(dtype).eval()


def _install_quantized(model: Transformer, layout_path: Path, tensors: dict[str, torch.Tensor],
                       device: str | torch.device) -> dict[str, torch.Tensor]:
    from lucidlm.quantization import install_quantized

    fields = read_json_object(layout_path, CheckpointError, "quantization layout", fix="re-save the quantized model")
    # The format first: a later lucidlm may name its modules otherwise, which would read as damage.
    fields.format_version("format", QUANTIZATION_FORMAT, to="load this model")
    try:
        modules, compute = fields.data["modules"], getattr(torch, fields.data.get("compute_dtype", "bfloat16"))
    except (KeyError, AttributeError, TypeError) as exc:
        raise CheckpointError(f"{layout_path} cannot be read ({exc}); re-save the quantized model.") from None
    tensors = {k: v.to(device) for k, v in tensors.items()}
    return install_quantized(model, modules, tensors, str(layout_path.parent / WEIGHTS_NAME), compute)
