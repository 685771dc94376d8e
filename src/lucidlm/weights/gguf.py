"""Loading GGUF files (llama.cpp's format) into a lucidlm Transformer.

A GGUF file is a header of key/value metadata (hyperparameters, the tokenizer) followed by
tensors, each possibly quantized in blocks (Q8_0: 32 weights share one scale; Q4_K: 256
weights in super-blocks). We read it with the ``gguf`` package's reader (memory-mapped,
nothing is copied until asked), dequantize every tensor to float32 with ``gguf.quants``,
and rename it to our parameter names.

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
from lucidlm.errors import GGUFError, UnsupportedArchitectureError
from lucidlm.model.positions import permute_qk_to_half
from lucidlm.model.transformer import Transformer
from lucidlm.weights.state import load_into

GGUF_MAGIC = b"GGUF"
from lucidlm.weights.gguf_families import FAMILIES  # noqa: E402 - per-architecture data

SUPPORTED_ARCHITECTURES = tuple(FAMILIES)

# Our name for each per-layer GGUF tensor (blk.N.<gguf> -> blocks.N.<ours>).
LAYER_TENSORS = {
    "attn_norm.weight": "ln1.weight",
    "attn_q.weight": "attn.q_proj.weight",
    "attn_k.weight": "attn.k_proj.weight",
    "attn_v.weight": "attn.v_proj.weight",
    "attn_output.weight": "attn.o_proj.weight",
    "ffn_norm.weight": "ln2.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
GLOBAL_TENSORS = {
    "token_embd.weight": "embed.weight",
    "output_norm.weight": "ln_final.weight",
    "output.weight": "unembed.weight",
}


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
    """A ``gguf.GGUFReader`` over ``path``, with every way a file can be broken turned into
    a GGUFError that names the file."""
    import gguf

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

    class CheckedReader(gguf.GGUFReader):
        # Check every tensor's byte range before the reader slices it: a short file would
        # otherwise fail later with a bare numpy reshape error.
        def _build_tensors(self, start_offs: int, fields: list) -> None:  # type: ignore[override]
            for field in fields:
                _, name, _, dims, raw_type, offset = field.parts
                name = bytes(name).decode("utf-8", errors="replace")
                try:
                    kind = gguf.GGMLQuantizationType(int(raw_type[0]))
                except ValueError:
                    raise GGUFError(f"{path}: tensor {name!r} has unknown type id {int(raw_type[0])}; "
                                    f"the file is corrupted or from a newer llama.cpp.") from None
                block, type_size = gguf.GGML_QUANT_SIZES[kind]
                n_bytes = int(np.prod(dims)) * type_size // block
                start = int(start_offs + offset[0])
                if start + n_bytes > size:
                    raise GGUFError(
                        f"{path}: data of tensor {name!r} spans bytes {start}..{start + n_bytes}, beyond the end "
                        f"of the file ({size} bytes). The file is truncated or corrupted; download or convert it again."
                    )
            super()._build_tensors(start_offs, fields)

    try:
        return CheckedReader(str(path))
    except GGUFError:
        raise
    except Exception as exc:  # the reader raises ValueError/IndexError/KeyError/... on bad bytes
        raise GGUFError(
            f"{path} cannot be read as GGUF ({type(exc).__name__}: {exc}); the file is truncated or "
            f"corrupted ({size} bytes). Download or convert it again."
        ) from None


def read_metadata(reader: Any, skip: tuple[str, ...] = ()) -> dict[str, Any]:
    """Every metadata key -> its Python value (strings decoded, arrays as lists)."""
    metadata = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key in skip:
            continue
        metadata[key] = field.contents()
    return metadata


def config_from_metadata(meta: dict[str, Any], source: str) -> ModelConfig:
    """The ModelConfig a GGUF's hyperparameters describe."""
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedArchitectureError(
            f"{source}: general.architecture={arch!r} is not supported; lucidlm can load GGUF models of "
            f"architecture {', '.join(SUPPORTED_ARCHITECTURES)}."
        )

    def need(key: str) -> Any:
        full = f"{arch}.{key}"
        if full not in meta:
            raise GGUFError(f"{source}: metadata key {full!r} is missing; the file is incomplete or not a "
                            f"{arch} model.")
        return meta[full]

    scaling = meta.get(f"{arch}.rope.scaling.type", "none")
    if scaling not in ("none", None):
        raise UnsupportedArchitectureError(
            f"{source}: RoPE scaling {scaling!r} is not implemented in lucidlm; only unscaled RoPE is supported."
        )
    d_model, n_heads = int(need("embedding_length")), int(need("attention.head_count"))
    head_dim = int(meta.get(f"{arch}.attention.key_length", meta.get(f"{arch}.rope.dimension_count",
                                                                      d_model // n_heads)))
    rope_dims = int(meta.get(f"{arch}.rope.dimension_count", head_dim))
    if rope_dims != head_dim:
        raise UnsupportedArchitectureError(
            f"{source}: RoPE rotates {rope_dims} of {head_dim} head dimensions (partial rotary), which "
            f"lucidlm does not implement."
        )
    tokens = meta.get("tokenizer.ggml.tokens")
    vocab = meta.get(f"{arch}.vocab_size", len(tokens) if tokens else None)
    if vocab is None:
        raise GGUFError(f"{source}: neither {arch}.vocab_size nor tokenizer.ggml.tokens says the vocabulary size.")
    family_fields = FAMILIES[arch].config_fields(lambda key, default: meta.get(f"{arch}.{key}", default), head_dim)
    fields = dict(
        name=arch,
        vocab_size=int(vocab),
        d_model=d_model,
        n_layers=int(need("block_count")),
        n_heads=n_heads,
        n_kv_heads=int(meta.get(f"{arch}.attention.head_count_kv", n_heads)),
        head_dim=head_dim,
        d_mlp=int(need("feed_forward_length")),
        max_seq_len=int(meta.get(f"{arch}.context_length", 2048)),
        positions="rope",
        rope_variant="half",  # Q/K rows are un-permuted on load (llama) or never were (gemma)
        rope_theta=float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        norm="rms",
        norm_eps=float(meta.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        mlp="swiglu",
        tie_embeddings=False,  # decided from the tensors by the caller
    )
    return ModelConfig(**{**fields, **family_fields})


def dequantize_tensor(tensor: Any, source: str) -> torch.Tensor:
    """One reader tensor as float32, in the (out, in) orientation of its data."""
    from gguf import quants

    name, kind = tensor.name, tensor.tensor_type
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
    for tensor in items:
        ours = _our_name(tensor.name, family.extra_layer_tensors)
        if ours is None:
            if tensor.name == "rope_freqs.weight":
                raise UnsupportedArchitectureError(
                    f"{source}: the file carries rope_freqs.weight (Llama 3.1-style RoPE frequency scaling), "
                    f"which lucidlm does not implement."
                )
            raise GGUFError(f"{source}: tensor {tensor.name!r} has no place in a {config.name} model; the file "
                            f"is for a different architecture.")
        weight = dequantize_tensor(tensor, source)
        if not family.permuted_qk:
            pass  # Q/K rows are already in the half layout
        elif ours.endswith("q_proj.weight"):
            weight = permute_qk_to_half(weight, config.n_heads)
        elif ours.endswith("k_proj.weight"):
            weight = permute_qk_to_half(weight, config.n_kv_heads)
        out[ours] = weight
    return out


def _our_name(gguf_name: str, extra_layer_tensors: Optional[dict[str, str]] = None) -> Optional[str]:
    if gguf_name in GLOBAL_TENSORS:
        return GLOBAL_TENSORS[gguf_name]
    layer_tensors = {**LAYER_TENSORS, **(extra_layer_tensors or {})}
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in layer_tensors:
        return f"blocks.{parts[1]}.{layer_tensors[parts[2]]}"
    return None


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
    config = config_from_metadata(meta, source)
    tensors = gguf_tensors(reader, config, source, progress)
    config = config.replace(tie_embeddings="unembed.weight" not in tensors)
    embed = tensors.get("embed.weight")
    if embed is not None and embed.shape[0] != config.vocab_size:
        config = config.replace(vocab_size=int(embed.shape[0]))  # the tensor is what the model uses
    tokenizer = tokenizer_from_metadata(meta, source)
    return config, tensors, tokenizer


def load_gguf(path: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
              progress: Optional[Callable[[Any], Any]] = None,
              model_cls: type[Transformer] = Transformer) -> Transformer:
    """A Transformer (or ``model_cls``, a subclass) with the GGUF file's weights (dequantized)
    and tokenizer. The chat template, if the file has one, is ``model.tokenizer.chat_template``.
    """
    config, tensors, tokenizer = read_gguf(path, progress)
    model = model_cls.empty(config, device)
    load_into(model, tensors, path)
    model.tokenizer = tokenizer
    return model.to(dtype).eval()
