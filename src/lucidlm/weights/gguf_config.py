"""A GGUF's metadata as a checked ModelConfig, and that config checked against the file's tensors.

Every hyperparameter goes through ``validation.Fields`` with the shared bounds, so a head
count of 0, a context of 4e9 or a layer count of a million is one line naming the file and
the key; ``fit_to_tensors`` then compares the layer count and every tensor's shape with a
model built on the meta device (which holds no memory) and checks what the model will take,
all before anything is allocated. This is llama.cpp's order: metadata checked, then tensors.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from lucidlm.config import LLAMA3_ROPE_DEFAULTS, ModelConfig
from lucidlm.errors import GGUFError, MissingTensorError, ShapeMismatchError, UnsupportedArchitectureError
from lucidlm.model.positions import rope_inverse_frequencies
from lucidlm.model.rope_scaling import rope_frequency_divisors
from lucidlm.model.transformer import Transformer
from lucidlm.validation import MAX_CONTEXT, MAX_HEADS, MAX_LAYERS, MAX_VOCAB, MAX_WIDTH, Fields, check_allocation
from lucidlm.weights.gguf_families import CONFIG_TENSORS, FAMILIES, ROPE_FREQS, gguf_tensors_check_name, our_name
from lucidlm.weights.gguf_quants import FLOAT_TYPES

SUPPORTED_ARCHITECTURES = tuple(FAMILIES)

METADATA_FIX = ("the file's metadata is corrupted or describes a model lucidlm cannot build; download or convert "
                "the model again")


def config_from_metadata(meta: dict[str, Any], source: str) -> ModelConfig:
    """The ModelConfig a GGUF's hyperparameters describe, each checked against sane bounds
    (validation.py) so that no absurd value reaches an allocation."""
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedArchitectureError(
            f"{source}: general.architecture={arch!r} is not supported; lucidlm can load GGUF models of "
            f"architecture {', '.join(SUPPORTED_ARCHITECTURES)}."
        )
    prefix = f"{arch}."
    fields = Fields({k[len(prefix):]: v for k, v in meta.items() if k.startswith(prefix)}, source, GGUFError,
                    where=arch, fix=METADATA_FIX)

    def fail(problem: str) -> None:
        raise GGUFError(f"{source}: {problem}. {METADATA_FIX[0].upper()}{METADATA_FIX[1:]}.")

    # llama.cpp reads an absent scaling type as "linear", with the factor from rope.scaling.factor
    # (or the older rope.scale_linear); a factor of 0 or 1 scales nothing, and type "none" never
    # scales. Llama 3.1's rule comes as a rope_freqs.weight tensor instead (fit_skeleton).
    scaling = fields.raw("rope.scaling.type", "linear")
    factor = fields.float("rope.scaling.factor", default=None)
    factor = fields.float("rope.scale_linear", default=None) if factor is None else factor
    if scaling not in ("none", "linear"):
        raise UnsupportedArchitectureError(
            f"{source}: RoPE scaling {scaling!r}{f' by {factor:g}' if factor is not None else ''} is not "
            f"implemented in lucidlm; it reads unscaled RoPE, linear scaling and Llama 3.1's frequency factors."
        )
    if scaling == "linear" and factor is not None and factor not in (0.0, 1.0):
        if factor < 0:
            fail(f"{arch}.rope.scaling.factor={factor:g} is negative; a RoPE scaling factor divides frequencies")
        rope_scaling = {"rope_type": "linear", "factor": factor}
    else:
        rope_scaling = None
    d_model = fields.int("embedding_length", low=1, high=MAX_WIDTH)
    n_layers = fields.int("block_count", low=1, high=MAX_LAYERS)
    n_heads = per_layer_int(fields, "attention.head_count", n_layers, low=1, high=MAX_HEADS)
    n_kv_heads = per_layer_int(fields, "attention.head_count_kv", n_layers, default=n_heads, low=1, high=n_heads)
    if n_heads % n_kv_heads:
        fail(f"{arch}.attention.head_count_kv={n_kv_heads} does not divide {arch}.attention.head_count={n_heads}")
    rope_dims = fields.int("rope.dimension_count", default=None, low=1, high=MAX_WIDTH)
    head_dim = fields.int("attention.key_length", default=rope_dims, low=1, high=MAX_WIDTH)
    if head_dim is None:
        if d_model % n_heads:
            fail(f"{arch}.embedding_length={d_model} is not a multiple of {arch}.attention.head_count={n_heads}")
        head_dim = d_model // n_heads
    rope_dims = head_dim if rope_dims is None else rope_dims
    if rope_dims != head_dim:
        raise partial_rotary_error(source, rope_dims, head_dim)
    if head_dim % 2 or n_heads * head_dim > MAX_WIDTH:
        fail(f"{n_heads} heads of {head_dim} dimensions: RoPE needs an even head size, and at most {MAX_WIDTH} in all")
    tokens = meta.get("tokenizer.ggml.tokens")
    if tokens is not None and not isinstance(tokens, list):
        fail(f"tokenizer.ggml.tokens is {type(tokens).__name__}, not a list of strings")
    vocab = fields.int("vocab_size", default=len(tokens) if tokens else None, low=1, high=MAX_VOCAB)
    if vocab is None:
        raise GGUFError(f"{source}: neither {arch}.vocab_size nor tokenizer.ggml.tokens says the vocabulary size.")
    settings = dict(
        name=arch,
        vocab_size=vocab,
        d_model=d_model,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        head_dim=head_dim,
        d_mlp=per_layer_int(fields, "feed_forward_length", n_layers, low=1, high=MAX_WIDTH),
        max_seq_len=fields.int("context_length", default=2048, low=1, high=MAX_CONTEXT),
        positions="rope",
        rope_variant="half",  # Q/K rows are un-permuted on load (llama) or never were (gemma)
        rope_theta=fields.float("rope.freq_base", default=10000.0, low=0.0, low_open=True),
        rope_scaling=rope_scaling,
        norm="rms",
        norm_eps=fields.float("attention.layer_norm_rms_epsilon", default=1e-5, low=0.0, high=1.0),
        mlp="swiglu",
        tie_embeddings=False,  # decided from the tensors by fit_to_tensors
    )
    return ModelConfig(**{**settings, **FAMILIES[arch].config_fields(fields, settings)})


def per_layer_int(fields: Fields, key: str, n_layers: int, **bounds: Any) -> int:
    """An integer hyperparameter (``fields.int(key, **bounds)``) that a GGUF may also give per
    layer, as an array of ``block_count`` integers (llama.cpp reads either, with get_key_or_arr).
    lucidlm builds every layer alike: an array holding one value is that value; one whose layers
    differ (a hybrid model's attention-free layers, OpenELM's growing widths) is refused."""
    values = fields.data.get(key)
    if not isinstance(values, list):
        return fields.int(key, **bounds)
    name = f"{fields.where}.{key}" if fields.where else key
    if len(values) != n_layers:
        fields.fail(f"field {name!r} holds {len(values)} per-layer values for block_count={n_layers} layers")
    bounds.pop("default", None)
    checked = [Fields({f"{key}[{i}]": value}, fields.source, fields.error, where=fields.where, fix=fields.fix)
               .int(f"{key}[{i}]", **bounds) for i, value in enumerate(values)]
    differs = next((i for i, value in enumerate(checked) if value != checked[0]), None)
    if differs is not None:
        raise UnsupportedArchitectureError(
            f"{fields.source}: {name} gives layer {differs} {checked[differs]} but layer 0 {checked[0]}; lucidlm "
            f"builds every layer with the same {key.rsplit('.', 1)[-1].replace('_', ' ')}, so it cannot load "
            f"this model (per-layer values are not supported).")
    return checked[0]


def _rope_scaling_from_freqs(tensor: Any, config: ModelConfig, source: str) -> dict[str, Any]:
    """``rope_scaling`` for a ``rope_freqs.weight`` tensor: llama.cpp divides pair i's frequency
    by its value i. Its converter writes it for Llama 3.1-3.3 from their llama3 rule; when the
    values are that rule with Meta's constants (low 1, high 4, original context 8192) and the
    largest value as the factor, the config says so (and exports to transformers as such),
    else it keeps the divisors themselves."""
    pairs = config.head_dim // 2
    if tensor.tensor_type.name != "F32" or tuple(int(d) for d in tensor.shape) != (pairs,):
        raise GGUFError(f"{source}: {ROPE_FREQS} is {tensor.tensor_type.name} of shape {tensor.shape.tolist()}; "
                        f"llama.cpp reads one float32 divisor per rotated pair ({pairs}). {METADATA_FIX[0].upper()}"
                        f"{METADATA_FIX[1:]}.")
    if config.rope_scaling is not None:
        raise UnsupportedArchitectureError(f"{source}: the file scales RoPE twice ({config.rope_scaling['rope_type']} "
                                           f"by rope.scaling.factor and {ROPE_FREQS}); lucidlm reads one or the other.")
    factors = torch.from_numpy(np.array(tensor.data, dtype=np.float64))  # (hd/2,)
    if not bool(torch.isfinite(factors).all()) or not bool((factors > 0).all()):
        raise GGUFError(f"{source}: {ROPE_FREQS} holds a divisor that is not a positive finite number. "
                        f"{METADATA_FIX[0].upper()}{METADATA_FIX[1:]}.")
    llama3 = {"rope_type": "llama3", "factor": float(factors.max()), **LLAMA3_ROPE_DEFAULTS}
    unscaled = rope_inverse_frequencies(config.head_dim, config.rope_theta)
    if torch.allclose(rope_frequency_divisors(unscaled, llama3), factors, rtol=1e-6, atol=0.0):
        return llama3
    return {"rope_type": "frequency_factors", "factors": factors.tolist()}


def partial_rotary_error(source: str, rope_dims: int, head_dim: int) -> UnsupportedArchitectureError:
    return UnsupportedArchitectureError(f"{source}: RoPE rotates {rope_dims} of {head_dim} head dimensions (partial "
                                        f"rotary), which lucidlm does not implement.")


def _refuse_unstated_partial_rotary(by_name: dict[str, Any], config: ModelConfig, meta: dict[str, Any],
                                    source: str) -> None:
    """Without attention.key_length, config_from_metadata takes rope.dimension_count as the head
    size (transformers reads it so). llama.cpp instead takes embedding_length / head_count and
    rotates rope.dimension_count of it: when the Q tensor has that size, the file is partial
    rotary, which deserves that refusal rather than "the weights do not belong together"."""
    if f"{config.name}.attention.key_length" in meta or config.d_model % config.n_heads:
        return
    usual = config.d_model // config.n_heads
    query = by_name.get("blk.0.attn_q.weight")
    if config.head_dim != usual and query is not None and len(query.shape) == 2 \
            and int(query.shape[1]) == config.n_heads * usual:  # GGUF order: [d_model, rows]
        raise partial_rotary_error(source, config.head_dim, usual)


def fit_to_tensors(reader: Any, config: ModelConfig, meta: dict[str, Any], source: str, float_weights: bool,
                   model_cls: type[Transformer] = Transformer) -> ModelConfig:
    """``config`` with the vocabulary and tied embeddings the tensors have, checked against the
    file before anything is allocated: the layer count, every tensor's shape (on a model built
    on the meta device, which holds no memory) and what the model will take in memory."""
    return fit_skeleton(reader, config, meta, source, float_weights, model_cls)[0]


def fit_skeleton(reader: Any, config: ModelConfig, meta: dict[str, Any], source: str, float_weights: bool,
                 model_cls: type[Transformer] = Transformer) -> tuple[ModelConfig, Transformer]:
    """``fit_to_tensors``, and the meta-device model it checked the shapes on (``model_cls.skeleton``):
    the loader streams the weights into that one instead of building the module tree twice."""
    by_name = {t.name: t for t in reader.tensors}
    embed = by_name.get("token_embd.weight")
    if embed is None or len(embed.shape) != 2:
        raise MissingTensorError(f"{source}: the file has no 2-D token_embd.weight tensor; it is incomplete or "
                                 f"not a model lucidlm can load.")
    rows = int(embed.shape[1])  # GGUF order: [d_model, vocab]
    tokens = meta.get("tokenizer.ggml.tokens") or []
    if len(tokens) > rows:
        raise GGUFError(f"{source}: tokenizer.ggml.tokens has {len(tokens)} tokens but token_embd.weight only "
                        f"{rows} rows, so some token ids would have no embedding. {METADATA_FIX[0].upper()}"
                        f"{METADATA_FIX[1:]}.")
    layers = {int(p[1]) for p in (n.split(".", 2) for n in by_name) if p[0] == "blk" and p[1].isdigit()}
    if layers != set(range(config.n_layers)):
        found = f"tensors for layers 0..{max(layers)}" if layers else "no layer tensors"
        raise GGUFError(f"{source}: {config.name}.block_count={config.n_layers} but the file has {found}. "
                        f"{METADATA_FIX[0].upper()}{METADATA_FIX[1:]}.")
    _refuse_unstated_partial_rotary(by_name, config, meta, source)
    if ROPE_FREQS in by_name:
        config = config.replace(rope_scaling=_rope_scaling_from_freqs(by_name[ROPE_FREQS], config, source))
    config = config.replace(tie_embeddings="output.weight" not in by_name, vocab_size=rows)
    skeleton = model_cls.skeleton(config)
    expected = {name: tuple(p.shape) for name, p in skeleton.state_dict().items()}
    family = FAMILIES.get(config.name, FAMILIES["llama"])
    present = set()
    for tensor in reader.tensors:
        if tensor.name in CONFIG_TENSORS:
            continue  # read into the config above
        ours = our_name(tensor.name, family.extra_layer_tensors)
        if ours is None or ours not in expected:
            gguf_tensors_check_name(tensor, config, source)
        shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
        if shape != expected[ours]:
            raise ShapeMismatchError(f"{source}: tensor {tensor.name!r} has shape {shape}, but the metadata describes "
                                     f"{expected[ours]}; the metadata and the weights do not belong together.")
        if len(shape) == 1 and tensor.tensor_type.name not in FLOAT_TYPES:
            raise GGUFError(f"{source}: vector {tensor.name!r} is stored as {tensor.tensor_type.name}; llama.cpp keeps "
                            f"1-D tensors (norms) in float, so the file is corrupted. Convert the model again.")
        present.add(ours)
    missing = sorted(set(expected) - present - {"unembed.weight"})
    if missing:
        raise MissingTensorError(f"{source}: {len(missing)} tensor(s) the model needs are missing, e.g. "
                                 f"{missing[:3]}; the file is incomplete or for a different architecture.")
    buffers = sum(b.numel() * b.element_size() for b in skeleton.buffers())  # RoPE tables: from context_length
    # float32 at most; the weights stream in one at a time (gguf_stream.py), so they are held once
    params = sum(p.numel() * 4 for p in skeleton.parameters()) if float_weights else 0
    check_allocation(buffers + params, f"{source}: the model its metadata describes", GGUFError,
                     f"check {config.name}.context_length ({config.max_seq_len}) and the layer sizes, or load it "
                     f"quantized")
    return config, skeleton
