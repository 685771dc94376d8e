"""Loading GGUF files (llama.cpp's format) into a lucidlm Transformer.

A GGUF file is a header of key/value metadata (hyperparameters, the tokenizer) followed by
tensors, each possibly quantized in blocks (Q8_0: 32 weights share one scale; Q4_K: 256
weights in super-blocks). We read it with our own small reader (``gguf_reader.py``:
memory-mapped, nothing is copied until asked; ``gguf.GGUFReader`` takes seconds on a large
vocabulary), and either keep the matrices quantized (``gguf_quants.py``) or dequantize them
to float32 exactly as ``gguf.quants`` does, and rename them to our parameter names.

Two layout facts matter:
- GGUF lists dimensions fastest-first (``ne`` order), so a (out, in) matrix is shown as
  ``[in, out]`` by ``tensor.shape``; the reader's ``tensor.data`` is already (out, in),
  i.e. ``nn.Linear``'s orientation.
- llama.cpp's converter permutes the rows of each LLaMA Q and K head so that RoPE can rotate
  adjacent pairs (the ``interleaved`` layout). We undo that permutation on load and use the
  ``half`` layout, so a model from GGUF has exactly the weights of the same model read from
  Hugging Face safetensors (and exports to either without further thought).
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
import torch

from lucidlm.config import ModelConfig
from lucidlm.errors import GGUFError
from lucidlm.model.positions import permute_qk_to_half
from lucidlm.model.transformer import Transformer
from lucidlm.weights.finite import FiniteCheck
from lucidlm.weights.gguf_config import SUPPORTED_ARCHITECTURES, config_from_metadata, fit_to_tensors  # noqa: F401
from lucidlm.weights.gguf_families import FAMILIES, gguf_tensors_check_name, our_name
from lucidlm.weights.gguf_quants import EXACT, exact_float, exact_plain, finite_parts, native_scheme, plain_from_float
from lucidlm.weights.state import load_into

GGUF_MAGIC = b"GGUF"

@functools.lru_cache(maxsize=None)
def supported_types() -> tuple[str, ...]:
    """Tensor types we can dequantize: whatever ``gguf.quants`` implements (F32, F16, BF16,
    Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K..Q6_K, the IQ types, ...), found by trying one block."""
    import gguf
    from gguf import quants

    names = []
    for kind in gguf.GGMLQuantizationType:
        _, type_size = gguf.GGML_QUANT_SIZES[kind]
        try:
            quants.dequantize(np.zeros((1, type_size), dtype=np.uint8), kind)  # one block of zeros
        except (NotImplementedError, ValueError, TypeError):
            continue
        names.append(kind.name)
    return tuple(names)


# --------------------------------------------------------------------------------------- reading


def open_gguf(path: str | Path) -> Any:
    """A ``GGUFFile`` (our fast memory-mapped reader) over ``path``, with every way a file can
    be broken turned into a GGUFError that names the file."""
    from lucidlm.weights.gguf_reader import (GGUFFile, GGUFFormatError, TensorOutOfBounds,
                                             UnknownTensorType, UnsupportedVersion, VERSIONS)

    path = Path(path)
    if not path.is_file():
        raise GGUFError(f"GGUF file {path} does not exist (or is not a file); check the path.")
    size = path.stat().st_size
    with path.open("rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise GGUFError(
            f"{path} is not a GGUF file: it starts with {magic!r}, not the magic bytes {GGUF_MAGIC!r}. "
            f"Pass a .gguf file produced by llama.cpp's converter (or a model directory)."
        )
    damaged = f"the file is truncated or corrupted ({size} bytes). Download or convert it again."
    try:
        return GGUFFile(path)
    except UnsupportedVersion as exc:
        raise GGUFError(f"{path} is GGUF version {exc.version}, which lucidlm cannot read (it reads versions "
                        f"{', '.join(map(str, VERSIONS))}); convert the model with a current llama.cpp.") from None
    except GGUFFormatError as exc:
        raise GGUFError(f"{path} cannot be read as GGUF: {exc}; {damaged}") from None
    except UnknownTensorType as exc:
        raise GGUFError(f"{path}: tensor {exc.name!r} has unknown type id {exc.kind}; the file is corrupted or "
                        f"from a newer llama.cpp.") from None
    except TensorOutOfBounds as exc:
        raise GGUFError(
            f"{path}: data of tensor {exc.name!r} spans bytes {exc.start}..{exc.start + exc.n_bytes}, beyond the end "
            f"of the file ({size} bytes). The file is truncated or corrupted; download or convert it again."
        ) from None
    except (OSError, ValueError) as exc:  # mmap of an unreadable file
        raise GGUFError(f"{path} cannot be read as GGUF ({type(exc).__name__}: {exc}); {damaged}") from None


def read_metadata(reader: Any, skip: tuple[str, ...] = ()) -> dict[str, Any]:
    """Every metadata key -> its Python value (strings decoded, arrays as lists)."""
    return {key: value for key, value in reader.metadata.items() if key not in skip}


def dequantize_tensor(tensor: Any, source: str) -> torch.Tensor:
    """One reader tensor as float32, in the (out, in) orientation of its data."""
    from gguf import quants

    name, kind = tensor.name, tensor.tensor_type
    if kind.name in EXACT:  # the common types: same numbers as gguf.quants, computed in torch
        return exact_float(tensor, kind.name)
    try:
        array = quants.dequantize(tensor.data, kind)
    except NotImplementedError:
        raise GGUFError(
            f"{source}: tensor {name!r} has type {kind.name}, which lucidlm cannot dequantize. "
            f"Supported types: {', '.join(supported_types())}. Re-quantize the model to one of these "
            f"(e.g. llama-quantize ... Q8_0)."
        ) from None
    return torch.from_numpy(np.array(array, dtype=np.float32, copy=True))


def gguf_tensors(reader: Any, config: ModelConfig, source: str,
                 progress: Optional[Callable[[Any], Any]] = None) -> dict[str, torch.Tensor]:
    """All tensors of the file under our names, dequantized to float32 and with Q/K rows in
    the ``half`` RoPE layout. ``progress`` wraps the tensor list (e.g. ``tqdm``)."""
    items = reader.tensors if progress is None else progress(reader.tensors)
    family = FAMILIES.get(config.name, FAMILIES["llama"])
    out: dict[str, torch.Tensor] = {}
    check = FiniteCheck(source)
    for tensor in items:
        ours = our_name(tensor.name, family.extra_layer_tensors)
        if ours is None:
            gguf_tensors_check_name(tensor, config, source)
        weight = dequantize_tensor(tensor, source)
        if not _queue_finite(check, tensor):
            check.add(tensor.name, weight)
        if not family.permuted_qk:
            pass  # Q/K rows are already in the half layout
        elif ours.endswith("q_proj.weight"):
            weight = permute_qk_to_half(weight, config.n_heads)
        elif ours.endswith("k_proj.weight"):
            weight = permute_qk_to_half(weight, config.n_kv_heads)
        out[ours] = weight
    check.verify()
    return out


def _queue_finite(check: FiniteCheck, tensor: Any) -> bool:
    """Queue the check of the values (or block scales) of ``tensor`` from its raw bytes:
    cheaper than checking the dequantized floats. False for types whose blocks we cannot
    read; the caller then checks the dequantized values."""
    parts = finite_parts(tensor)
    if parts is not None:
        check.add(tensor.name, *parts)
    return parts is not None


def gguf_quantized_tensors(reader: Any, config: ModelConfig, source: str, quantize: str,
                           group_size: Optional[int], scale_dtype: torch.dtype,
                           ) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, Any]]]:
    """(tensors, layout) with the matrices kept quantized: ``quantize="gguf"`` keeps each
    tensor in the nearest lucidlm scheme to its own type (Q8_0 -> int8/32, Q4_0/Q4_1 ->
    int4/32 exactly); "int8"/"int4" use that scheme everywhere, converting bit for bit where
    the file's blocks already are that scheme and group size, and through float otherwise.
    Float tensors (norms) come back as float32 under their names."""
    from lucidlm.quantization import scheme_class
    from lucidlm.quantization.base import check_group_size

    family = FAMILIES.get(config.name, FAMILIES["llama"])
    out: dict[str, torch.Tensor] = {}
    layout: dict[str, dict[str, Any]] = {}
    check = FiniteCheck(source)
    for tensor in reader.tensors:
        ours = our_name(tensor.name, family.extra_layer_tensors)
        if ours is None:
            gguf_tensors_check_name(tensor, config, source)
        if not _queue_finite(check, tensor):  # a type we cannot read scales from: check its floats
            check.add(tensor.name, dequantize_tensor(tensor, source))
        kind = tensor.tensor_type.name
        module = ours[: -len(".weight")]
        is_matrix = len(tensor.shape) == 2  # norms (and Gemma's QK-norms) are vectors and stay float
        if not is_matrix:
            out[ours] = dequantize_tensor(tensor, source)
            continue
        if quantize == "gguf":
            target = native_scheme(kind)
        else:
            target = (quantize, scheme_class(quantize).default_group_size if group_size is None else group_size)
        if target is None:
            out[ours] = dequantize_tensor(tensor, source)
            continue
        check_group_size(module, int(tensor.shape[0]), target[1], target[0])  # GGUF shape: [in, out]
        if EXACT.get(kind) == target:
            plain = exact_plain(tensor, kind, scale_dtype)
        else:
            plain = plain_from_float(dequantize_tensor(tensor, source), *target, scale_dtype)
        n_heads = config.n_heads if module.endswith("q_proj") else config.n_kv_heads
        for name, value in plain.items():
            # Q/K rows back to the "half" layout: permuting output rows (codes with their row's
            # scales) is exact for per-row and per-group quantization.
            if family.permuted_qk and module.endswith(("q_proj", "k_proj")):
                value = permute_qk_to_half(value, n_heads)
            out[f"{module}.{name}"] = value
        layout[module] = {"scheme": target[0], "group_size": target[1]}
    check.verify()
    return out, layout


def tokenizer_from_metadata(meta: dict[str, Any], source: str) -> Any:
    """The file's tokenizer as an HFTokenizer, or None when the file carries none."""
    if "tokenizer.ggml.tokens" not in meta:
        return None
    from lucidlm.tokenizers.pretrained import HFTokenizer

    return HFTokenizer.from_gguf_fields(meta, source=source)


# --------------------------------------------------------------------------------------- loading


def read_gguf(path: str | Path, progress: Optional[Callable[[Any], Any]] = None
              ) -> tuple[ModelConfig, dict[str, torch.Tensor], Any]:
    """(config, float32 tensors under our names, tokenizer or None) from a GGUF file."""
    source = str(path)
    reader = open_gguf(path)
    meta = read_metadata(reader)
    config = fit_to_tensors(reader, config_from_metadata(meta, source), meta, source, float_weights=True)
    tokenizer = tokenizer_from_metadata(meta, source)
    return config, gguf_tensors(reader, config, source, progress), tokenizer


def load_gguf(path: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
              progress: Optional[Callable[[Any], Any]] = None, quantize: Optional[str] = None,
              group_size: Optional[int] = None, model_cls: type[Transformer] = Transformer) -> Transformer:
    """A Transformer (or ``model_cls``, a subclass) with the GGUF file's weights and tokenizer.

    quantize=None: every tensor dequantized to float (``dtype``), exactly as ``gguf.quants``
    does. quantize="gguf" | "int8" | "int4": matrices stay quantized (see
    ``gguf_quantized_tensors``); ``dtype`` is then the residual stream's dtype.
    The chat template, if the file has one, is ``model.tokenizer.chat_template``.
    """
    if quantize is None:
        config, tensors, tokenizer = read_gguf(path, progress)
        model = model_cls.empty(config, device)
        load_into(model, tensors, path)
        model.tokenizer = tokenizer
        return model.to(dtype).eval()

    from lucidlm.quantization import DEFAULT_COMPUTE_DTYPE, install_quantized, scheme_class

    if quantize != "gguf":
        scheme_class(quantize)  # an unknown name fails before any work
    source = str(path)
    reader = open_gguf(path)
    meta = read_metadata(reader)
    config = fit_to_tensors(reader, config_from_metadata(meta, source), meta, source, float_weights=False,
                            model_cls=model_cls)
    tokenizer = tokenizer_from_metadata(meta, source)
    tensors, layout = gguf_quantized_tensors(reader, config, source, quantize, group_size, DEFAULT_COMPUTE_DTYPE)
    if config.tie_embeddings and "embed" in layout:
        layout["unembed"] = layout["embed"]  # one matrix: the unembedding is built from the same codes
    model = model_cls.empty(config, device)
    rest = install_quantized(model, layout, {k: v.to(device) for k, v in tensors.items()}, source)
    load_into(model, rest, path)
    model.tokenizer = tokenizer
    return model.to(dtype).eval()
