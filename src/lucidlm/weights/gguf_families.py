"""What each GGUF architecture adds to the LLaMA-shaped reading in ``gguf.py``.

A GGUF names its family in ``general.architecture`` and stores hyperparameters under that
prefix (``gemma3.embedding_length``). Everything a family needs beyond LLaMA's layout is
data here: extra tensors, config fields the file does not carry (llama.cpp hard-codes them
per architecture, and so does transformers' GGUF loader, which is our reference), and
whether llama.cpp's converter permuted the Q/K rows. The tensor names every family shares
(``blk.N.attn_q.weight`` -> ``blocks.N.attn.q_proj.weight``) are here too.

Gemma facts (llama.cpp ``convert_hf_to_gguf.py`` / ``src/llama-model.cpp``, transformers
``Gemma3TextConfig`` defaults):
- Gemma's RMSNorm multiplies by (1 + weight); the converter stores weight + 1, so the GGUF
  value is the plain scale our RMSNorm uses (transformers subtracts the 1 again on load);
- Q/K rows are *not* permuted (only the ``llama`` converter does that);
- Gemma 3: 5 sliding-window layers then 1 global, local RoPE base 10000, GeGLU, embeddings
  times sqrt(d_model). Without an ``attention.sliding_window`` key, or with 0, every layer is
  global with the file's RoPE base (llama.cpp's ``found_swa && n_swa > 0`` test; its converter
  omits the key for all-global models such as Rnj-1). Scores are scaled by 1/sqrt(head_dim),
  except for the 62-layer 27B, where llama.cpp uses 1/sqrt(d_model / n_heads) (168, not 128).

Qwen facts (llama.cpp ``convert_hf_to_gguf.py`` Qwen2Model / Qwen3Model, ``src/llama-model.cpp``):
- Q/K rows are not permuted; the norms are Qwen's own plain scales (weight * x / rms(x));
- qwen2 (Qwen 2 and 2.5): q/k/v biases (``blk.N.attn_q.bias`` ...), none on attn_output; its
  window settings (use_sliding_window) are not written and llama.cpp attends globally;
- qwen3: ``attn_q_norm`` / ``attn_k_norm`` over each head before RoPE, no biases, and
  ``qwen3.attention.key_length`` for head_dim (128, not embedding_length / head_count).
  transformers' GGUF loader ignores that key and takes Qwen3Config's default, also 128.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from lucidlm.errors import GGUFError

# GGUF per-layer tensor -> our name below ``blocks.N.``, for tensors beyond LLaMA's set.
QK_NORM_TENSORS = {
    "attn_q_norm.weight": "attn.q_norm.weight",
    "attn_k_norm.weight": "attn.k_norm.weight",
}
GEMMA_LAYER_TENSORS = {
    **QK_NORM_TENSORS,
    "post_attention_norm.weight": "ln1_post.weight",
    "post_ffw_norm.weight": "ln2_post.weight",
}
QKV_BIAS_TENSORS = {f"attn_{p}.bias": f"attn.{p}_proj.bias" for p in "qkv"}


@dataclass(frozen=True)
class GGUFFamily:
    permuted_qk: bool  # llama.cpp permuted Q/K rows to the interleaved RoPE layout
    extra_layer_tensors: dict[str, str] = field(default_factory=dict)
    # (the architecture's metadata as validation.Fields, the LLaMA-shaped ModelConfig settings read
    # from it: d_model, n_layers, n_heads, head_dim, ...) -> ModelConfig fields beyond LLaMA's
    config_fields: Callable[[Any, dict[str, Any]], dict[str, Any]] = lambda fields, settings: {}


GEMMA3_27B_LAYERS = 62  # llama.cpp's LLM_TYPE_27B for gemma3, the one size with its own attention scale


def _gemma3_fields(fields: Any, settings: dict[str, Any]) -> dict[str, Any]:
    from lucidlm.validation import MAX_CONTEXT

    # llama.cpp: `found_swa && n_swa > 0` -> 5 local layers per global one; else every layer global
    window = fields.int("attention.sliding_window", None, low=0, high=MAX_CONTEXT) or None
    # llama.cpp's f_attention_scale: the 27B scales by n_embd / n_head (integer division), others by head_dim
    scalar = settings["d_model"] // settings["n_heads"] if settings["n_layers"] == GEMMA3_27B_LAYERS \
        else settings["head_dim"]
    if not scalar:
        fields.fail(f"a {GEMMA3_27B_LAYERS}-layer (27B) model with gemma3.embedding_length={settings['d_model']} below "
                    f"gemma3.attention.head_count={settings['n_heads']} would scale attention scores by 1/sqrt(0)")
    return dict(
        mlp="geglu", norm_eps=fields.float("attention.layer_norm_rms_epsilon", 1e-6, low=0.0, high=1.0), qk_norm=True,
        post_sublayer_norm=True, scale_embeddings=True, query_pre_attn_scalar=float(scalar),
        sliding_window=window, global_layer_every=6 if window else None, rope_local_theta=10000.0 if window else None,
        final_logit_softcap=fields.float("final_logit_softcapping", None, low=0.0, low_open=True) or None,
    )


FAMILIES: dict[str, GGUFFamily] = {
    "llama": GGUFFamily(permuted_qk=True),
    "gemma3": GGUFFamily(permuted_qk=False, extra_layer_tensors=GEMMA_LAYER_TENSORS, config_fields=_gemma3_fields),
    "qwen2": GGUFFamily(permuted_qk=False, extra_layer_tensors=QKV_BIAS_TENSORS,
                        config_fields=lambda fields, settings: dict(attn_bias=True, attn_out_bias=False)),
    "qwen3": GGUFFamily(permuted_qk=False, extra_layer_tensors=QK_NORM_TENSORS,
                        config_fields=lambda fields, settings: dict(qk_norm=True)),
}


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


# Tensors that describe the model rather than weigh it: read into its config (gguf_config.py),
# never into the weights. rope_freqs: one RoPE frequency divisor per pair (Llama 3.1's scaling).
ROPE_FREQS = "rope_freqs.weight"
CONFIG_TENSORS = frozenset({ROPE_FREQS})


def gguf_tensors_check_name(tensor: Any, config: Any, source: str) -> None:
    """Refuse a tensor that has no place in the model (``our_name`` found none for it)."""
    raise GGUFError(f"{source}: tensor {tensor.name!r} has no place in a {config.name} model; the file "
                    f"is for a different architecture.")


def our_name(gguf_name: str, extra_layer_tensors: Optional[dict[str, str]] = None) -> Optional[str]:
    """Our parameter name for a GGUF tensor name, or None when the model has none for it."""
    if gguf_name in GLOBAL_TENSORS:
        return GLOBAL_TENSORS[gguf_name]
    layer_tensors = {**LAYER_TENSORS, **(extra_layer_tensors or {})}
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in layer_tensors:
        return f"blocks.{parts[1]}.{layer_tensors[parts[2]]}"
    return None
