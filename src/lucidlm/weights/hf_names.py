"""Our tensor names <-> Hugging Face's, for the families lucidlm writes and reads.

- LLaMA-shaped (``LlamaForCausalLM``, ``Qwen2ForCausalLM``, ``Qwen3ForCausalLM``; their
  differences in ``hf_families.py``): renaming only; an interleaved-RoPE model's q/k rows are put
  back in the rotate-half order Hugging Face uses.
- GPT-2 (``GPT2LMHeadModel``): ``Conv1D`` stores weights as (in, out), the transpose of
  ``nn.Linear``, and ``c_attn`` holds q, k and v side by side; GPT-2 always has biases, so a
  model trained without them is written with exact zeros.

``export_family`` says which family a config can be written as, listing what keeps it from
the nearer one. ``hf.py`` reads and writes the directories.
"""

from __future__ import annotations

import torch

from lucidlm.config import ModelConfig
from lucidlm.errors import ConfigError
from lucidlm.model.positions import permute_qk_to_half
from lucidlm.model.transformer import Transformer
from lucidlm.weights.hf_config import SUPPORTED
from lucidlm.weights.hf_families import LLAMA_SHAPED, attention_biases
from lucidlm.weights.state import own_state_dict

ARCHITECTURE_OF_FAMILY = {family: arch for arch, (family, _) in SUPPORTED.items()}
GPT2_ACTIVATION_NAMES = {"gelu_tanh": "gelu_new", "gelu": "gelu", "relu": "relu"}


def _llama_names(cfg: ModelConfig, family: str = "llama") -> dict[str, str]:
    """our name -> Hugging Face name; LLaMA tensors need no reshaping, only renaming."""
    names = {"embed.weight": "model.embed_tokens.weight", "ln_final.weight": "model.norm.weight"}
    if not cfg.tie_embeddings:
        names["unembed.weight"] = "lm_head.weight"
    for i in range(cfg.n_layers):
        ours, theirs = f"blocks.{i}", f"model.layers.{i}"
        names[f"{ours}.ln1.weight"] = f"{theirs}.input_layernorm.weight"
        names[f"{ours}.ln2.weight"] = f"{theirs}.post_attention_layernorm.weight"
        for p in ("q", "k", "v", "o"):
            for kind in ("weight", "bias"):
                names[f"{ours}.attn.{p}_proj.{kind}"] = f"{theirs}.self_attn.{p}_proj.{kind}"
        for p in ("gate", "up", "down"):
            for kind in ("weight", "bias"):
                names[f"{ours}.mlp.{p}_proj.{kind}"] = f"{theirs}.mlp.{p}_proj.{kind}"
        if cfg.qk_norm and LLAMA_SHAPED[family].qk_norm:  # Qwen 3
            for p in ("q", "k"):
                names[f"{ours}.attn.{p}_norm.weight"] = f"{theirs}.self_attn.{p}_norm.weight"
    return names


def to_our_names(cfg: ModelConfig, family: str, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A Hugging Face checkpoint's tensors (names and shapes already checked) under our names."""
    return _gpt2_to_ours(cfg, tensors) if family == "gpt2" else _llama_to_ours(cfg, tensors, family)


def _llama_to_ours(cfg: ModelConfig, tensors: dict[str, torch.Tensor], family: str) -> dict[str, torch.Tensor]:
    return {ours: tensors[theirs] for ours, theirs in _llama_names(cfg, family).items() if theirs in tensors}


def _gpt2_names(cfg: ModelConfig) -> list[tuple[str, str, str]]:
    """Every GPT-2 tensor as (our name, Hugging Face name, layout), in Hugging Face's order; both
    directions (``_gpt2_to_ours`` and ``_gpt2_from_ours``) read this one table. layout:
    ``"same"``; ``"conv1d"`` (a weight stored (in, out), the transpose of ``nn.Linear``'s; a
    Conv1D bias is ``"same"``); ``"qkv"`` (``c_attn``: our q, k and v projections side by side,
    ``{}`` in our name standing for q, k or v; its weight is Conv1D too)."""
    rows = [("embed.weight", "transformer.wte.weight", "same"), ("pos_embed.weight", "transformer.wpe.weight", "same"),
            ("ln_final.weight", "transformer.ln_f.weight", "same"), ("ln_final.bias", "transformer.ln_f.bias", "same")]
    if not cfg.tie_embeddings:
        rows.append(("unembed.weight", "lm_head.weight", "same"))
    for i in range(cfg.n_layers):
        ours, theirs = f"blocks.{i}", f"transformer.h.{i}"
        for a, b in (("ln1", "ln_1"), ("ln2", "ln_2")):
            rows += [(f"{ours}.{a}.{kind}", f"{theirs}.{b}.{kind}", "same") for kind in ("weight", "bias")]
        rows += [(f"{ours}.attn.{{}}_proj.{kind}", f"{theirs}.attn.c_attn.{kind}", "qkv")
                 for kind in ("weight", "bias")]
        for ours_name, theirs_name in (("attn.o_proj", "attn.c_proj"), ("mlp.up_proj", "mlp.c_fc"),
                                       ("mlp.down_proj", "mlp.c_proj")):
            rows.append((f"{ours}.{ours_name}.weight", f"{theirs}.{theirs_name}.weight", "conv1d"))
            rows.append((f"{ours}.{ours_name}.bias", f"{theirs}.{theirs_name}.bias", "same"))
    return rows


def _gpt2_to_ours(cfg: ModelConfig, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for ours, theirs, layout in _gpt2_names(cfg):
        tensor = tensors[theirs]
        if layout == "same":
            out[ours] = tensor
        elif layout == "conv1d":
            out[ours] = tensor.t()  # (in, out) -> nn.Linear's (out, in)
        else:  # c_attn is [q | k | v]: weight (d, 3d) -> three (d, d); bias (3d,) -> three (d,)
            fused = tensor.t() if theirs.endswith(".weight") else tensor
            for p, part in zip("qkv", fused.chunk(3, dim=0)):
                out[ours.format(p)] = part
    return out


def export_family(cfg: ModelConfig) -> str:
    """``"llama"``, ``"gpt2"``, or for a Qwen model (``cfg.name``, as read from a Qwen file)
    ``"qwen2"`` / ``"qwen3"``: the Hugging Face architecture this config can be written as, its
    own first. Raises ConfigError listing every field that keeps it from the nearest family."""
    own = [cfg.name] if cfg.name in LLAMA_SHAPED and cfg.name != "llama" else []
    problems = {family: _llama_export_problems(cfg, family) for family in (*own, "llama")}
    problems["gpt2"] = _gpt2_export_problems(cfg)
    for family, found in problems.items():
        if not found:
            return family
    nearest = min(problems, key=lambda family: len(problems[family]))
    raise ConfigError(
        f"this model cannot be exported to Hugging Face: as {ARCHITECTURE_OF_FAMILY[nearest]} (the nearest fit) "
        f"{'; '.join(problems[nearest])}. lucidlm exports LLaMA-style models (rope + rms + swiglu + pre-norm + "
        f"final norm; Qwen 2 / Qwen 3 models as their own architecture) and GPT-2-style models (learned "
        f"positions + layer norm + pre-norm + final norm); save this one in lucidlm's own format instead "
        f"(lucidlm convert --to lucidlm)."
    )


def _common_export_problems(cfg: ModelConfig) -> list[str]:
    problems = []
    if cfg.norm_position != "pre":
        problems.append(f"norm_position={cfg.norm_position!r} (post-norm) has no Hugging Face "
                        f"equivalent (it needs 'pre')")
    if not cfg.final_norm:
        problems.append("final_norm=False, but both Hugging Face families apply a final norm")
    if cfg.unembed_bias:
        problems.append("unembed_bias=True, but both Hugging Face families have a bias-free lm_head")
    # Gemma / Qwen 3 features: LlamaForCausalLM and GPT2LMHeadModel would load the file without them
    # (dropping their tensors) and compute different logits, so each is a refusal, not a loss.
    if cfg.qk_norm:
        problems.append("qk_norm=True (RMSNorm on each head's queries and keys), but neither family has "
                        "q_norm/k_norm weights (it needs qk_norm=False)")
    local = sum(cfg.layer_is_local(i) for i in range(cfg.n_layers))
    # A window of max_seq_len keys or more covers the whole context: those layers attend globally.
    if local and cfg.sliding_window < cfg.max_seq_len:
        problems.append(f"sliding_window={cfg.sliding_window} ({local} of {cfg.n_layers} layers attend locally), "
                        f"but both families attend globally in every layer (it needs sliding_window=None, or at "
                        f"least max_seq_len={cfg.max_seq_len})")
    if local and cfg.positions == "rope" and cfg.rope_local_theta not in (None, cfg.rope_theta):
        problems.append(f"rope_local_theta={cfg.rope_local_theta!r} differs from rope_theta={cfg.rope_theta!r} (the "
                        f"RoPE base of the {local} sliding_window={cfg.sliding_window} layers), but LLaMA has one "
                        f"RoPE base for every layer")
    elif local and cfg.positions == "rope" and cfg.has_local_rope_table:
        problems.append(f"rope_scaling={cfg.rope_scaling!r} scales the RoPE of the global layers only (the {local} "
                        f"sliding_window={cfg.sliding_window} layers keep rope_local_theta unscaled), but LLaMA "
                        f"rotates every layer alike")
    if cfg.final_logit_softcap is not None:
        problems.append(f"final_logit_softcap={cfg.final_logit_softcap!r}, but neither family caps its logits "
                        f"(it needs final_logit_softcap=None)")
    if cfg.scale_embeddings:
        problems.append("scale_embeddings=True (embeddings times sqrt(d_model)), but neither family scales its "
                        "embeddings (it needs scale_embeddings=False)")
    if cfg.query_pre_attn_scalar is not None and float(cfg.query_pre_attn_scalar) != float(cfg.head_dim):
        problems.append(f"query_pre_attn_scalar={cfg.query_pre_attn_scalar!r}, but both families scale attention "
                        f"scores by 1/sqrt(head_dim={cfg.head_dim}) (it needs None or head_dim)")
    if cfg.post_sublayer_norm:
        problems.append("post_sublayer_norm=True (a norm on each sub-layer's output), but neither family has "
                        "post-attention/post-feedforward norms (it needs post_sublayer_norm=False)")
    return problems


def _llama_export_problems(cfg: ModelConfig, family: str = "llama") -> list[str]:
    facts = LLAMA_SHAPED[family]
    architecture = facts.title
    problems = [f"{name}={getattr(cfg, name)!r}, but {architecture} needs {name}={value!r}"
                for name, value in (("positions", "rope"), ("norm", "rms"), ("mlp", "swiglu"))
                if getattr(cfg, name) != value]
    if facts.heads_divide_hidden and cfg.d_model % cfg.n_heads:  # LlamaConfig refuses it, even with head_dim
        problems.append(f"d_model={cfg.d_model} is not divisible by n_heads={cfg.n_heads}, but LlamaConfig "
                        f"requires hidden_size divisible by num_attention_heads, even with head_dim={cfg.head_dim} "
                        f"given (it needs an n_heads that divides d_model)")
    if cfg.rope_scaling is not None and cfg.rope_scaling["rope_type"] not in ("linear", "llama3"):
        problems.append(f"rope_scaling type {cfg.rope_scaling['rope_type']!r} (one divisor per frequency, from a "
                        f"GGUF's rope_freqs that follow no llama3 rule), but transformers' {architecture} scales RoPE "
                        f"only by the 'linear' or 'llama3' rules among those lucidlm implements")
    if facts.qk_norm and not cfg.qk_norm:
        problems.append(f"qk_norm=False, but {architecture} has q_norm/k_norm weights (it needs qk_norm=True)")
    if cfg.mlp_bias and not facts.mlp_bias_switch:
        problems.append(f"mlp_bias=True, but {architecture}'s MLP has no biases (it needs mlp_bias=False)")
    if facts.qkv_bias and not cfg.attn_bias:
        problems.append(f"attn_bias=False, but {architecture}'s q/k/v projections always have biases (it needs "
                        f"attn_bias=True)")
    if cfg.attn_out_bias and facts.out_bias is False:
        problems.append(f"attn_out_bias=True, but {architecture}'s o_proj has no bias (it needs attn_out_bias=False)")
    # a feature this architecture has (Qwen 3's q/k norms) is no problem
    return problems + _common_export_problems(cfg.replace(qk_norm=False) if facts.qk_norm else cfg)


def _gpt2_export_problems(cfg: ModelConfig) -> list[str]:
    problems = []
    if cfg.positions != "learned":
        problems.append(f"positions={cfg.positions!r}, but GPT-2 needs positions='learned'")
    if cfg.norm != "layer":
        problems.append(f"norm={cfg.norm!r}, but GPT-2 needs norm='layer'")
    if cfg.mlp not in GPT2_ACTIVATION_NAMES:
        problems.append(f"mlp={cfg.mlp!r}, but GPT-2 needs one of {', '.join(GPT2_ACTIVATION_NAMES)}")
    if cfg.n_kv_heads != cfg.n_heads:
        problems.append(f"n_kv_heads={cfg.n_kv_heads} differs from n_heads={cfg.n_heads}; "
                        f"GPT-2 has no grouped-query attention")
    if cfg.q_dim != cfg.d_model:
        problems.append(f"n_heads*head_dim={cfg.q_dim} differs from d_model={cfg.d_model}; GPT-2 needs them equal")
    return problems + _common_export_problems(cfg)


def hf_state_dict(model: Transformer) -> dict[str, torch.Tensor]:
    """The model's tensors under Hugging Face names and layouts (what ``save_hf`` writes)."""
    cfg = model.config
    ours = own_state_dict(model)
    family = export_family(cfg)
    _check_all_mapped(model, family, ours)
    if family == "gpt2":
        return _gpt2_from_ours(cfg, ours)
    return _llama_from_ours(cfg, ours, family)


def _check_all_mapped(model: Transformer, family: str, ours: dict[str, torch.Tensor]) -> None:
    """Refuse a model holding a tensor the family's name table has no Hugging Face name for: it
    would be left out of the file without a word (a quantized model's codes, or the weights of a
    config feature that ``export_family`` does not know to refuse)."""
    cfg = model.config
    if family != "gpt2":
        mapped = set(_llama_names(cfg, family))
    else:
        mapped = set()
        for name, _, layout in _gpt2_names(cfg):  # a "qkv" row's name has {} for q, k or v
            mapped.update([name.format(part) for part in "qkv"] if layout == "qkv" else [name])
    unmapped = sorted(set(ours) - mapped)
    if not unmapped:
        return
    from lucidlm.quantization import QuantizedEmbedding, QuantizedLinear

    architecture = ARCHITECTURE_OF_FAMILY[family]
    if any(isinstance(m, (QuantizedLinear, QuantizedEmbedding)) for m in model.modules()):
        raise ConfigError(
            f"this model is quantized ({len(unmapped)} tensors such as {unmapped[:3]} are quantization codes), but a "
            f"{architecture} directory holds float weights; load the model without quantize= to export it to "
            f"Hugging Face (a model saved quantized: lucidlm.quantization.dequantize(model) first, or `lucidlm "
            f"convert DIR OUT --to hf`, which does it), or save it in lucidlm's own format (lucidlm convert --to "
            f"lucidlm --quantize ...)."
        )
    raise ConfigError(
        f"this model cannot be exported to Hugging Face as {architecture}: {len(unmapped)} of its tensors have no "
        f"{architecture} name and would be left out, e.g. {unmapped[:5]}; save it in lucidlm's own format "
        f"instead (lucidlm convert --to lucidlm)."
    )


def _llama_from_ours(cfg: ModelConfig, ours: dict[str, torch.Tensor], family: str = "llama") -> dict[str, torch.Tensor]:
    out = {}
    for name, hf_name in _llama_names(cfg, family).items():
        if name in ours:
            out[hf_name] = ours[name]
        elif _llama_has_bias(cfg, hf_name, family):  # a bias the architecture has and we do not: zeros
            weight = ours[name.replace(".bias", ".weight")]
            out[hf_name] = weight.new_zeros(weight.shape[0])
    if cfg.rope_variant == "interleaved":  # HF rotates halves: put each head's rows back in that order
        for i in range(cfg.n_layers):
            for p, heads in (("q", cfg.n_heads), ("k", cfg.n_kv_heads)):
                for kind in ("weight", "bias"):
                    key = f"model.layers.{i}.self_attn.{p}_proj.{kind}"
                    if key in out:
                        out[key] = permute_qk_to_half(out[key], heads)
                norm = f"model.layers.{i}.self_attn.{p}_norm.weight"
                if norm in out:  # one scale per head dimension, in the same order as the rows
                    out[norm] = permute_qk_to_half(out[norm], 1)
    return out


def _llama_has_bias(cfg: ModelConfig, hf_name: str, family: str = "llama") -> bool:
    """Whether a model of ``family`` holds the bias ``hf_name``: LLaMA and Qwen 3 have one switch
    for the q/k/v/o biases, Qwen 2 always has q/k/v biases and never an o_proj bias."""
    if not hf_name.endswith(".bias"):
        return False
    if ".self_attn." in hf_name:
        qkv, out = attention_biases(LLAMA_SHAPED[family], bool(cfg.attn_bias or cfg.attn_out_bias))
        return out if ".o_proj." in hf_name else qkv
    return cfg.mlp_bias and ".mlp." in hf_name


def _gpt2_from_ours(cfg: ModelConfig, ours: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    def tensor(name: str) -> torch.Tensor:
        if not name.endswith(".bias"):
            return ours[name]
        # GPT-2 always has biases; a model trained without them gets exact zeros (the length
        # of the weight's first dimension: d for norms, the output width for projections).
        size = ours[name[: -len(".bias")] + ".weight"].shape[0]
        return ours.get(name, ours["embed.weight"].new_zeros(size))

    out = {}
    for name, theirs, layout in _gpt2_names(cfg):
        if layout == "same":
            out[theirs] = tensor(name)
        elif layout == "conv1d":
            out[theirs] = tensor(name).t().contiguous()  # nn.Linear's (out, in) -> (in, out)
        else:  # c_attn: [q | k | v], weight (d, 3d), bias (3d,)
            fused = torch.cat([tensor(name.format(p)) for p in "qkv"], dim=0)
            out[theirs] = fused.t().contiguous() if theirs.endswith(".weight") else fused
    return out
