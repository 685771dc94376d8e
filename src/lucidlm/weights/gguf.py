"""Loading GGUF files (llama.cpp's format) into a lucidlm Transformer.

A GGUF file is a header of key/value metadata (hyperparameters, the tokenizer) followed by
tensors, each possibly quantized in blocks (Q8_0: 32 weights share one scale; Q4_K: 256
weights in super-blocks). We read it with our own small reader (``gguf_reader.py``:
memory-mapped, nothing is copied until asked; ``gguf.GGUFReader`` takes seconds on a large
vocabulary), and either keep the matrices quantized (``gguf_quants.py``) or dequantize them
to float32 exactly as ``gguf.quants`` does, and rename them to our parameter names. The
architectures read (``general.architecture``) are ``llama``, ``gemma3``, ``qwen2`` (Qwen 2 and
2.5) and ``qwen3``; what each adds to LLaMA's layout is data in ``gguf_families.py``.

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

from pathlib import Path
from typing import Any, Callable, Optional

import torch

from lucidlm.errors import GGUFError
from lucidlm.model.transformer import Transformer
from lucidlm.weights.gguf_config import (SUPPORTED_ARCHITECTURES, config_from_metadata, fit_skeleton,  # noqa: F401
                                         fit_to_tensors)
from lucidlm.weights.gguf_header_cache import cached_tokenizer
from lucidlm.weights.gguf_fill import stream_into
from lucidlm.weights.gguf_stream import plan, supported_types  # noqa: F401 - supported_types: API

GGUF_MAGIC = b"GGUF"


# --------------------------------------------------------------------------------------- reading


def open_gguf(path: str | Path) -> Any:
    """A ``GGUFFile`` (our fast memory-mapped reader) over ``path``, with every way a file can
    be broken turned into a GGUFError that names the file."""
    from lucidlm.weights.gguf_reader import (BigEndian, GGUFFile, GGUFFormatError, TensorOutOfBounds,
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
    except BigEndian:
        raise GGUFError(f"{path} is a big-endian GGUF file and lucidlm reads little-endian ones; convert it in place "
                        f"with the gguf package's script: gguf-convert-endian {path} little") from None
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


def tokenizer_from_metadata(meta: dict[str, Any], source: str) -> Any:
    """The file's tokenizer as an HFTokenizer, or None when the file carries none."""
    if "tokenizer.ggml.tokens" not in meta:
        return None
    from lucidlm.tokenizers.pretrained import HFTokenizer

    return HFTokenizer.from_gguf_fields(meta, source=source)


# --------------------------------------------------------------------------------------- loading


def load_gguf(path: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
              progress: Optional[Callable[[Any], Any]] = None, quantize: Optional[str] = None,
              group_size: Optional[int] = None, model_cls: type[Transformer] = Transformer,
              quantize_embeddings: bool = True) -> Transformer:
    """A Transformer (or ``model_cls``, a subclass) with the GGUF file's weights and tokenizer.

    quantize=None: every tensor dequantized to float (``dtype``), exactly as ``gguf.quants``
    does. quantize="gguf": each matrix kept in the nearest lucidlm scheme to its own type
    (Q8_0 -> int8/32, Q4_0/Q4_1 -> int4/32 exactly, Q5_0 -> int8/32 and Q4_K -> int4/32 block by
    block, other K-quants their nearest); "int8"/"int4": that scheme everywhere, from the file's
    blocks where they are (or map onto) that scheme and group size, through float otherwise.
    ``dtype`` is then the residual stream's dtype, and vectors (norms) stay float; with ``quantize_embeddings=False`` so do the token embedding
    and the unembedding (in ``dtype``). The chat template, if the file has one, is
    ``model.tokenizer.chat_template``. The tensors stream from the memory map into the model
    a few at a time (``gguf_fill.py``): the peak memory is the model plus a few tensors.
    """
    if quantize not in (None, "gguf"):
        from lucidlm.quantization import scheme_class

        scheme_class(quantize)  # an unknown name fails before any work
    source = str(path)
    reader = open_gguf(path)
    meta = read_metadata(reader)
    config, skeleton = fit_skeleton(reader, config_from_metadata(meta, source), meta, source,
                                    float_weights=quantize is None, model_cls=model_cls)
    # built once per header and process (gguf_header_cache.py); each model gets its own copy
    tokenizer = cached_tokenizer(reader.header_digest, source, lambda: tokenizer_from_metadata(meta, source))
    planned = plan(reader, config, source, quantize, group_size, quantize_embeddings)
    model = stream_into(skeleton, planned, source, dtype, device,
                        release=getattr(reader, "release", lambda tensor: None), progress=progress)
    model.tokenizer = tokenizer
    return model.to(dtype).eval()
