"""A Hugging Face ``config.json`` as our ModelConfig, every field lucidlm uses checked first.

Each field is read through ``lucidlm.validation.Fields`` under its config.json name (type,
range with the shared MAX_* bounds), then ModelConfig checks consistency and is told those
names, so a refusal reads "config.json: field 'num_hidden_layers' is 1000000; expected ...".
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lucidlm.config import ROPE_SCALING_PARAMETERS, ModelConfig
from lucidlm.errors import ConfigError, UnsupportedArchitectureError
from lucidlm.validation import MAX_CONTEXT, MAX_HEADS, MAX_LAYERS, MAX_VOCAB, MAX_WIDTH, Fields, read_json_object
from lucidlm.weights.hf_families import LLAMA_SHAPED, LlamaShapedFamily, attention_biases

CONFIG_NAME = "config.json"
# The other files of a Hugging Face directory (here, beside config.json, so that lucidlm's own
# save can name them without importing the exporter: weights/checkpoint.py)
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
TOKENIZER_NAME = "tokenizer.json"
TOKENIZER_CONFIG_NAME = "tokenizer_config.json"
# architecture class -> (family, model_type); the LLaMA-shaped ones' differences are in hf_families.py
SUPPORTED = {"LlamaForCausalLM": ("llama", "llama"), "GPT2LMHeadModel": ("gpt2", "gpt2"),
             **{f.architecture: (name, name) for name, f in LLAMA_SHAPED.items()}}
_FAMILY_OF_MODEL_TYPE = {model_type: family for family, model_type in SUPPORTED.values()}
_GPT2_ACTIVATIONS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu", "relu": "relu"}
_LLAMA_ACTIVATIONS = ("silu", "swish")  # transformers' ACT2FN builds torch.nn.SiLU for both names
_CONFIG_FIX = "correct that field in config.json, or re-download or re-export the model"


def read_hf_config(path: str | Path) -> Fields:
    """config.json of a Hugging Face directory as checked ``Fields`` (missing, truncated, not
    UTF-8 or not an object: one ConfigError naming the file)."""
    return read_json_object(Path(path) / CONFIG_NAME, ConfigError, "model config", fix=_CONFIG_FIX)


def _fields(hf: dict[str, Any] | Fields, source: str | Path) -> Fields:
    return hf if isinstance(hf, Fields) else Fields(hf, source, ConfigError, fix=_CONFIG_FIX)


def hf_family(hf_config: dict[str, Any] | Fields, source: str | Path = CONFIG_NAME) -> str:
    """``"llama"``, ``"qwen2"``, ``"qwen3"`` or ``"gpt2"`` from config.json's architectures / model_type."""
    fields = _fields(hf_config, source)
    architectures = fields.list("architectures", default=[], item=str)
    model_type = fields.str("model_type", default=None)
    for arch in architectures:
        if arch in SUPPORTED:
            return SUPPORTED[arch][0]
    if not architectures and model_type in _FAMILY_OF_MODEL_TYPE:
        return _FAMILY_OF_MODEL_TYPE[model_type]
    found = architectures or [model_type]
    raise UnsupportedArchitectureError(
        f"{fields.source}: architecture {', '.join(map(str, found))} (model_type={model_type!r}) is not supported; "
        f"lucidlm reads Hugging Face models of these architectures: {', '.join(SUPPORTED)}."
    )


def config_from_hf(hf: dict[str, Any] | Fields, source: str = CONFIG_NAME) -> ModelConfig:
    """Our ModelConfig for a Hugging Face config.json (already parsed). Every field lucidlm
    uses is checked for type and range under its config.json name before anything is built."""
    fields = _fields(hf, source)
    family = hf_family(fields)
    _refuse_quantized(fields)
    values, names = _gpt2_fields(fields) if family == "gpt2" else _llama_fields(fields, family)
    return ModelConfig.from_dict(values, source=fields.source, names=names, fix=_CONFIG_FIX)


def _refuse_quantized(hf: Fields) -> None:
    """A ``quantization_config`` means the weights are stored quantized (FP8, GPTQ, AWQ,
    bitsandbytes...) with scales and packing lucidlm does not read: refuse before reading them."""
    quantization = hf.object("quantization_config", default={})
    if not quantization.data:
        return
    method = quantization.raw("quant_method", default=None)
    raise UnsupportedArchitectureError(
        f"{hf.source}: the checkpoint is quantized (quantization_config with quant_method={method!r}), which lucidlm "
        f"does not read; lucidlm reads float checkpoints (float32, float16, bfloat16) and quantizes them itself "
        f"(lucidlm.load(..., quantize='int8' or 'int4'), --quantize): use the model's unquantized release."
    )


# our ModelConfig field -> config.json's name for it, so refusals name the file's field
LLAMA_NAMES = {"vocab_size": "vocab_size", "d_model": "hidden_size", "n_layers": "num_hidden_layers",
                "n_heads": "num_attention_heads", "n_kv_heads": "num_key_value_heads", "head_dim": "head_dim",
                "d_mlp": "intermediate_size", "max_seq_len": "max_position_embeddings", "rope_theta": "rope_theta",
                "rope_scaling": "rope_scaling", "norm_eps": "rms_norm_eps", "attn_bias": "attention_bias",
                "mlp_bias": "mlp_bias", "tie_embeddings": "tie_word_embeddings"}
GPT2_NAMES = {"vocab_size": "vocab_size", "d_model": "n_embd", "n_layers": "n_layer", "n_heads": "n_head",
               "d_mlp": "n_inner", "max_seq_len": "n_positions", "norm_eps": "layer_norm_epsilon",
               "tie_embeddings": "tie_word_embeddings"}


def _llama_fields(hf: Fields, family: str = "llama") -> tuple[dict[str, Any], dict[str, str]]:
    facts = LLAMA_SHAPED[family]
    activation = hf.str("hidden_act", default="silu")
    if activation not in _LLAMA_ACTIVATIONS:
        raise UnsupportedArchitectureError(
            f"{hf.source}: hidden_act={activation!r} is not supported for {facts.title}; lucidlm's SwiGLU "
            f"uses silu (also spelled swish)."
        )
    n_layers = hf.int("num_hidden_layers", low=1, high=MAX_LAYERS)
    if facts.sliding_window_switch:
        _refuse_sliding_layers(hf, facts, n_layers)
    n_heads = hf.int("num_attention_heads", low=1, high=MAX_HEADS)
    hidden = hf.int("hidden_size", low=1, high=MAX_WIDTH)
    head_dim = hf.int("head_dim", default=None, low=1, high=MAX_WIDTH)
    if facts.heads_divide_hidden and hidden % n_heads:
        # heads x head_dim != hidden_size is legal in transformers, but LlamaConfig refuses a head
        # count that does not divide hidden_size even when head_dim is given: no checkpoint has one
        given = f" (head_dim={head_dim} does not lift that rule)" if head_dim is not None else ""
        hf.fail(f"hidden_size={hidden} is not divisible by num_attention_heads={n_heads}, which transformers' "
                f"LlamaConfig requires{given}, so transformers cannot load this directory either")
    attn_bias, attn_out_bias = attention_biases(facts, hf.bool("attention_bias", default=False))
    max_positions = hf.int("max_position_embeddings", default=facts.default_max_positions, low=1, high=MAX_CONTEXT)
    rope, rope_key = _rope(hf, max_positions)
    values = dict(
        name=family, vocab_size=hf.int("vocab_size", low=1, high=MAX_VOCAB),
        d_model=hf.int("hidden_size", low=1, high=MAX_WIDTH),
        n_layers=n_layers, n_heads=n_heads,
        n_kv_heads=hf.int("num_key_value_heads", default=n_heads, low=1, high=MAX_HEADS),
        head_dim=facts.default_head_dim if head_dim is None else head_dim, qk_norm=facts.qk_norm,
        d_mlp=hf.int("intermediate_size", low=1, high=MAX_WIDTH),
        max_seq_len=max_positions, positions="rope", rope_variant="half", **rope,
        norm="rms", norm_eps=hf.float("rms_norm_eps", default=1e-6, low=0.0, high=1.0),
        norm_position="pre", final_norm=True, mlp="swiglu", attn_bias=attn_bias, attn_out_bias=attn_out_bias,
        mlp_bias=facts.mlp_bias_switch and hf.bool("mlp_bias", default=False),
        tie_embeddings=hf.bool("tie_word_embeddings", default=False),
    )
    return values, {**LLAMA_NAMES, "rope_scaling": rope_key}


def _refuse_sliding_layers(hf: Fields, facts: LlamaShapedFamily, n_layers: int) -> None:
    """Qwen's configs name each layer's attention in ``layer_types``, or, without it, make layers
    ``max_window_layers`` and above sliding when ``use_sliding_window`` is true (``Qwen2Config.
    __post_init__``); lucidlm builds no such pattern, so a model with a sliding layer is refused."""
    if hf.has("layer_types"):
        kinds = hf.list("layer_types", item=str)
        sliding = [i for i, kind in enumerate(kinds) if kind == "sliding_attention"]
        where = f"layer_types marks layer(s) {sliding[:8]} 'sliding_attention'"
        fix = "only if the model was meant to run without the window, set every layer_types entry to 'full_attention'"
    elif hf.bool("use_sliding_window", default=False) and hf.has("sliding_window"):
        first = hf.int("max_window_layers", default=28, low=0, high=MAX_LAYERS)
        sliding = list(range(first, n_layers))
        where = f"use_sliding_window=true makes layers {first}..{n_layers - 1} (max_window_layers={first} on) slide"
        fix = "only if the model was meant to run without the window, set use_sliding_window to false"
    else:
        return
    if sliding:
        window = hf.raw("sliding_window", default=None)
        raise UnsupportedArchitectureError(
            f"{hf.source}: {where} within sliding_window={window!r} tokens, which is not implemented; lucidlm reads "
            f"{facts.architecture} with full attention in every layer. In config.json, {fix} (every released Qwen "
            f"checkpoint has no sliding layer)."
        )


def _rope(hf: Fields, max_positions: int) -> tuple[dict[str, Any], str]:
    """``rope_theta`` and ``rope_scaling`` (ModelConfig's spelling) from config.json.

    transformers >= 5 keeps theta and scaling in ``rope_parameters``; older files have
    ``rope_theta`` and ``rope_scaling`` at the top level. transformers' rule
    (``convert_rope_params_to_dict``): a non-empty ``rope_scaling`` replaces ``rope_parameters``
    whole, and a theta missing from the chosen dict comes from the top-level ``rope_theta``, else
    10000. A file carrying both is read the same way here. Of the scaling rules, lucidlm has
    "linear" and "llama3" (model/rope_scaling.py); it takes their parameters and no others, and,
    as transformers' ``standardize_rope_params``, llama3's original context from a top-level
    ``original_max_position_embeddings``, else the dict's, else ``max_position_embeddings``.
    Returns the ModelConfig fields and the file's name for the dict it read (for messages)."""
    parameters = hf.object("rope_parameters", default={})
    scaling = hf.object("rope_scaling", default={})
    scaling_type = scaling.str("rope_type", default=None) or scaling.str("type", default=None)
    if scaling_type is None and scaling.data:
        scaling.fail(f"field 'rope_scaling' is {dict(scaling.data)!r} but names no 'rope_type' (or 'type'), so "
                     f"which RoPE scaling it means is unknown")
    chosen = scaling if scaling.data else parameters
    rope_type = chosen.str("rope_type", default=None) or chosen.str("type", default=None) or "default"
    if rope_type not in ("default", "linear", "llama3"):
        raise UnsupportedArchitectureError(
            f"{hf.source}: RoPE scaling type {rope_type!r} is not implemented; lucidlm supports plain RoPE and the "
            f"'linear' and 'llama3' scalings. Remove the scaling only if the model was trained without it."
        )
    top_level = hf.float("rope_theta", default=10000.0, low=0.0, low_open=True)  # checked even when unused
    theta = chosen.float("rope_theta", default=top_level, low=0.0, low_open=True)
    key = "rope_scaling" if scaling.data else "rope_parameters"
    if rope_type == "default":
        return dict(rope_theta=theta, rope_scaling=None), key
    # transformers' LLaMA-shaped default rotation ignores partial_rotary_factor, but its scaled rules
    # size their frequencies by it: fewer than the head has, which its forward pass cannot apply.
    # Turning every pair would be a guess at an unrunnable config, so it is refused.
    partial = chosen.float("partial_rotary_factor", default=hf.float("partial_rotary_factor", default=1.0))
    if partial != 1.0:
        raise UnsupportedArchitectureError(
            f"{hf.source}: partial_rotary_factor={partial:g} with RoPE scaling {rope_type!r} rotates part of each "
            f"head (partial rotary), which lucidlm does not implement.")
    # ModelConfig checks the values and fills llama3's optional ones, naming the file's fields
    kept = {name: chosen.data[name] for name in ROPE_SCALING_PARAMETERS[rope_type] if chosen.has(name)}
    if rope_type == "llama3":
        original = "original_max_position_embeddings"
        kept[original] = hf.raw(original, default=None) or kept.get(original) or max_positions
    return dict(rope_theta=theta, rope_scaling={"rope_type": rope_type, **kept}), key


def _gpt2_fields(hf: Fields) -> tuple[dict[str, Any], dict[str, str]]:
    activation = hf.str("activation_function", default="gelu_new")
    if activation not in _GPT2_ACTIVATIONS:
        raise UnsupportedArchitectureError(
            f"{hf.source}: activation_function={activation!r} is not supported; use one of "
            f"{', '.join(_GPT2_ACTIVATIONS)}."
        )
    if hf.bool("scale_attn_by_inverse_layer_idx", default=False) or not hf.bool("scale_attn_weights", default=True):
        raise UnsupportedArchitectureError(
            f"{hf.source}: this GPT-2 variant scales attention differently (scale_attn_by_inverse_layer_idx / "
            f"scale_attn_weights); lucidlm implements only the standard 1/sqrt(head_dim) scaling."
        )
    values = dict(
        name="gpt2", vocab_size=hf.int("vocab_size", low=1, high=MAX_VOCAB), d_model=hf.int("n_embd", low=1, high=MAX_WIDTH),
        n_layers=hf.int("n_layer", low=1, high=MAX_LAYERS), n_heads=hf.int("n_head", low=1, high=MAX_HEADS),
        d_mlp=hf.int("n_inner", default=None, low=1, high=MAX_WIDTH),  # None: 4 * n_embd
        max_seq_len=hf.int("n_positions", default=1024, low=1, high=MAX_CONTEXT), positions="learned",
        norm="layer", norm_eps=hf.float("layer_norm_epsilon", default=1e-5, low=0.0, high=1.0), norm_position="pre",
        final_norm=True, mlp=_GPT2_ACTIVATIONS[activation], attn_bias=True, attn_out_bias=True, mlp_bias=True,
        norm_bias=True, tie_embeddings=hf.bool("tie_word_embeddings", default=True),
    )
    return values, GPT2_NAMES
