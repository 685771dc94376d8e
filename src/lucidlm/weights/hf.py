"""Hugging Face model directories, both ways: ``load_hf`` reads one, ``save_hf`` writes one.

A Hugging Face directory is ``config.json`` plus ``model.safetensors`` (or shards listed in
``model.safetensors.index.json``). Two families map onto our ModelConfig:

- ``LlamaForCausalLM``: RoPE in the rotate_half layout (our ``rope_variant="half"``),
  RMSNorm, SwiGLU, grouped-query attention. Names differ from ours, tensors do not.
- ``GPT2LMHeadModel``: learned positions, LayerNorm, GELU(tanh), biases. Its ``Conv1D``
  layers store weights as (in, out), the transpose of ``nn.Linear``, and ``c_attn`` holds
  q, k and v side by side in one matrix.

Both directions go through one table, ``hf_state_dict(model)``: the tensors a Hugging Face
checkpoint of this model holds, by their Hugging Face names. Saving writes it; loading
checks the file against its names and shapes, then inverts the mapping. Reading and
checking ``config.json`` itself is ``hf_config.py``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from lucidlm.config import ModelConfig
from lucidlm.errors import (
    ConfigError,
    MissingTensorError,
    ShapeMismatchError,
    WeightsError,
)
from lucidlm.model.positions import permute_qk_to_half
from lucidlm.model.transformer import Transformer
from lucidlm.validation import read_json_object
from lucidlm.weights.checkpoint import atomic_save_safetensors, atomic_write_text
from lucidlm.weights.finite import FiniteCheck
from lucidlm.weights.hf_config import (CONFIG_NAME, GPT2_NAMES, LLAMA_NAMES, SUPPORTED, config_from_hf, hf_family,
                                       read_hf_config)
from lucidlm.weights.state import load_into, own_state_dict

WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
TOKENIZER_NAME = "tokenizer.json"
TOKENIZER_CONFIG_NAME = "tokenizer_config.json"

_ARCHITECTURE_OF_FAMILY = {family: arch for arch, (family, _) in SUPPORTED.items()}

_GPT2_ACTIVATION_NAMES = {"gelu_tanh": "gelu_new", "gelu": "gelu", "relu": "relu"}
_DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


# ----------------------------------------------------------------------------- reading

def is_hf_dir(path: str | Path) -> bool:
    """A directory with a Hugging Face config.json and safetensors weights. A config.json that
    cannot be read (truncated, not UTF-8, not an object) still counts, so that loading it says
    what is wrong with it; a valid one must name a model_type or architectures."""
    path = Path(path)
    if not (path / CONFIG_NAME).is_file():
        return False
    if not ((path / WEIGHTS_NAME).is_file() or (path / INDEX_NAME).is_file()):
        return False
    try:
        config = json.loads((path / CONFIG_NAME).read_bytes().decode("utf-8"))
    except (OSError, ValueError, RecursionError):
        return True
    return not isinstance(config, dict) or "model_type" in config or "architectures" in config


def load_hf(path: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
            model_cls: type[Transformer] = Transformer) -> Transformer:
    """A Transformer (or ``model_cls``, a subclass) with the weights of a Hugging Face LLaMA
    or GPT-2 directory."""
    path = Path(path)
    hf_config = read_hf_config(path)
    family = hf_family(hf_config)
    config = config_from_hf(hf_config)
    model = model_cls.empty(config, device)  # checks the memory this config needs first
    tensors = read_safetensors(path)
    load_into(model, _to_our_names(model, family, tensors, path), path)
    model.tokenizer = _load_tokenizer(path)
    return model.to(dtype).eval()


def read_safetensors(path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of a Hugging Face directory, from one file or from the shards its index lists."""
    path = Path(path)
    files = _shard_files(path) if (path / INDEX_NAME).is_file() else [WEIGHTS_NAME]
    tensors: dict[str, torch.Tensor] = {}
    for name in files:
        file = path / name
        if not file.is_file():
            raise WeightsError(f"{file} is missing; re-download or re-save the model (listed in {INDEX_NAME}).")
        check = FiniteCheck(file)
        try:
            with safe_open(str(file), framework="pt") as f:
                for key in f.keys():
                    tensors[key] = f.get_tensor(key)
                    check.add(key, tensors[key])
        except (SafetensorError, OSError) as exc:
            raise WeightsError(f"{file} cannot be read ({exc}); the file is truncated or corrupted.") from None
        check.verify()
    return tensors


def _shard_files(path: Path) -> list[str]:
    """The shard files ``model.safetensors.index.json`` lists: each a file name inside the
    model directory (an absolute path or ``..`` would read files outside it)."""
    fix = "re-download the model or re-save it with save_pretrained"
    index = read_json_object(path / INDEX_NAME, WeightsError, "shard index", fix=fix)
    weight_map = index.object("weight_map")
    root = path.resolve()
    files = set()
    for tensor in weight_map.data:
        name = weight_map.str(tensor)
        target = (path / name).resolve()
        if not name or Path(name).is_absolute() or root not in target.parents:
            weight_map.fail(f"weight_map[{tensor!r}] is {name!r}, which is not a file inside the model directory "
                            f"{path}; a shard index may only name shard files beside it")
        files.add(name)
    if not files:
        weight_map.fail("weight_map lists no tensors")
    return sorted(files)


def _to_our_names(model: Transformer, family: str, tensors: dict[str, torch.Tensor],
                  source: Path) -> dict[str, torch.Tensor]:
    """Check the file against the tensors this config needs (HF names and shapes), then rename."""
    # Original GPT-2 checkpoints have no "transformer." prefix; accept both spellings.
    if family == "gpt2" and not any(k.startswith("transformer.") for k in tensors):
        tensors = {k if k.startswith("lm_head.") else f"transformer.{k}": v for k, v in tensors.items()}
    with torch.device("meta"):  # shapes only: no memory, no copies
        expected = {name: t.shape for name, t in hf_state_dict(Transformer(model.config)).items()}
    names = LLAMA_NAMES if family == "llama" else GPT2_NAMES
    sizes = ", ".join(f"{names[k]}={getattr(model.config, k)}" for k in ("vocab_size", "d_model", "n_layers", "n_heads",
                                                                       "n_kv_heads", "head_dim", "d_mlp") if k in names)
    for name, shape in expected.items():
        if name not in tensors:
            raise MissingTensorError(
                f"{source}: tensor {name!r} is missing (expected shape {tuple(shape)}); the checkpoint is "
                f"incomplete or its config.json ({sizes}) does not describe it."
            )
        if tuple(tensors[name].shape) != tuple(shape):
            raise ShapeMismatchError(
                f"{source}: tensor {name!r} has shape {tuple(tensors[name].shape)}, expected {tuple(shape)} "
                f"from config.json ({sizes}); the weights and the config do not belong together."
            )
    return _llama_to_ours(model.config, tensors) if family == "llama" else _gpt2_to_ours(model.config, tensors)


def _load_tokenizer(path: Path) -> Any:
    if not (path / TOKENIZER_NAME).is_file():
        return None
    try:
        from lucidlm.tokenizers.pretrained import HFTokenizer
    except ImportError:  # the pretrained-tokenizer module is optional
        return None
    return HFTokenizer.from_file(path / TOKENIZER_NAME)


# ----------------------------------------------------------------------------- name maps

def _llama_names(cfg: ModelConfig) -> dict[str, str]:
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
    return names


def _llama_to_ours(cfg: ModelConfig, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {ours: tensors[theirs] for ours, theirs in _llama_names(cfg).items() if theirs in tensors}


def _gpt2_to_ours(cfg: ModelConfig, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {
        "embed.weight": tensors["transformer.wte.weight"],
        "pos_embed.weight": tensors["transformer.wpe.weight"],
        "ln_final.weight": tensors["transformer.ln_f.weight"],
        "ln_final.bias": tensors["transformer.ln_f.bias"],
    }
    if not cfg.tie_embeddings:
        out["unembed.weight"] = tensors["lm_head.weight"]
    for i in range(cfg.n_layers):
        ours, theirs = f"blocks.{i}", f"transformer.h.{i}"
        for a, b in (("ln1", "ln_1"), ("ln2", "ln_2")):
            out[f"{ours}.{a}.weight"] = tensors[f"{theirs}.{b}.weight"]
            out[f"{ours}.{a}.bias"] = tensors[f"{theirs}.{b}.bias"]
        # Conv1D stores (in, out): transpose to nn.Linear's (out, in). c_attn is [q | k | v].
        qkv_weight = tensors[f"{theirs}.attn.c_attn.weight"].t()  # (3d, d)
        qkv_bias = tensors[f"{theirs}.attn.c_attn.bias"]  # (3d,)
        for p, weight, bias in zip("qkv", qkv_weight.chunk(3, dim=0), qkv_bias.chunk(3, dim=0)):
            out[f"{ours}.attn.{p}_proj.weight"] = weight
            out[f"{ours}.attn.{p}_proj.bias"] = bias
        for ours_name, theirs_name in (("attn.o_proj", "attn.c_proj"), ("mlp.up_proj", "mlp.c_fc"),
                                       ("mlp.down_proj", "mlp.c_proj")):
            out[f"{ours}.{ours_name}.weight"] = tensors[f"{theirs}.{theirs_name}.weight"].t()
            out[f"{ours}.{ours_name}.bias"] = tensors[f"{theirs}.{theirs_name}.bias"]
    return out


# ----------------------------------------------------------------------------- writing

def export_family(cfg: ModelConfig) -> str:
    """``"llama"`` or ``"gpt2"``: the Hugging Face architecture this config can be written as.
    Raises ConfigError listing every field that keeps it from the nearer family."""
    problems = {"llama": _llama_export_problems(cfg), "gpt2": _gpt2_export_problems(cfg)}
    for family, found in problems.items():
        if not found:
            return family
    nearest = min(problems, key=lambda family: len(problems[family]))
    raise ConfigError(
        f"this model cannot be exported to Hugging Face: as {_ARCHITECTURE_OF_FAMILY[nearest]} (the nearest fit) "
        f"{'; '.join(problems[nearest])}. lucidlm exports LLaMA-style models (rope + rms + swiglu + pre-norm + "
        f"final norm) and GPT-2-style models (learned positions + layer norm + pre-norm + final norm); save this "
        f"one in lucidlm's own format instead (lucidlm convert --to lucidlm)."
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
    return problems


def _llama_export_problems(cfg: ModelConfig) -> list[str]:
    problems = [f"{name}={getattr(cfg, name)!r}, but LLaMA needs {name}={value!r}"
                for name, value in (("positions", "rope"), ("norm", "rms"), ("mlp", "swiglu"))
                if getattr(cfg, name) != value]
    return problems + _common_export_problems(cfg)


def _gpt2_export_problems(cfg: ModelConfig) -> list[str]:
    problems = []
    if cfg.positions != "learned":
        problems.append(f"positions={cfg.positions!r}, but GPT-2 needs positions='learned'")
    if cfg.norm != "layer":
        problems.append(f"norm={cfg.norm!r}, but GPT-2 needs norm='layer'")
    if cfg.mlp not in _GPT2_ACTIVATION_NAMES:
        problems.append(f"mlp={cfg.mlp!r}, but GPT-2 needs one of {', '.join(_GPT2_ACTIVATION_NAMES)}")
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
    if family == "llama":
        return _llama_from_ours(cfg, ours)
    return _gpt2_from_ours(cfg, ours)


def _llama_from_ours(cfg: ModelConfig, ours: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for name, hf_name in _llama_names(cfg).items():
        if name in ours:
            out[hf_name] = ours[name]
        elif _llama_has_bias(cfg, hf_name):  # HF has one switch for q/k/v/o biases: fill in zeros
            weight = ours[name.replace(".bias", ".weight")]
            out[hf_name] = weight.new_zeros(weight.shape[0])
    if cfg.rope_variant == "interleaved":  # HF rotates halves: put each head's rows back in that order
        for i in range(cfg.n_layers):
            for p, heads in (("q", cfg.n_heads), ("k", cfg.n_kv_heads)):
                for kind in ("weight", "bias"):
                    key = f"model.layers.{i}.self_attn.{p}_proj.{kind}"
                    if key in out:
                        out[key] = permute_qk_to_half(out[key], heads)
    return out


def _llama_has_bias(cfg: ModelConfig, hf_name: str) -> bool:
    if not hf_name.endswith(".bias"):
        return False
    if ".self_attn." in hf_name:
        return bool(cfg.attn_bias or cfg.attn_out_bias)
    return cfg.mlp_bias and ".mlp." in hf_name


def _gpt2_from_ours(cfg: ModelConfig, ours: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    def bias_of(name: str, size: int) -> torch.Tensor:
        # GPT-2 always has biases; a model trained without them gets exact zeros.
        return ours.get(f"{name}.bias", ours["embed.weight"].new_zeros(size))

    d = cfg.d_model
    out = {
        "transformer.wte.weight": ours["embed.weight"],
        "transformer.wpe.weight": ours["pos_embed.weight"],
        "transformer.ln_f.weight": ours["ln_final.weight"],
        "transformer.ln_f.bias": bias_of("ln_final", d),
    }
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = ours["unembed.weight"]
    for i in range(cfg.n_layers):
        ours_prefix, theirs = f"blocks.{i}", f"transformer.h.{i}"
        for a, b in (("ln1", "ln_1"), ("ln2", "ln_2")):
            out[f"{theirs}.{b}.weight"] = ours[f"{ours_prefix}.{a}.weight"]
            out[f"{theirs}.{b}.bias"] = bias_of(f"{ours_prefix}.{a}", d)
        attn = f"{ours_prefix}.attn"
        out[f"{theirs}.attn.c_attn.weight"] = torch.cat(
            [ours[f"{attn}.{p}_proj.weight"] for p in "qkv"], dim=0).t().contiguous()  # (d, 3d)
        out[f"{theirs}.attn.c_attn.bias"] = torch.cat([bias_of(f"{attn}.{p}_proj", d) for p in "qkv"])
        for ours_name, theirs_name, size in (("attn.o_proj", "attn.c_proj", d), ("mlp.up_proj", "mlp.c_fc", cfg.d_mlp),
                                             ("mlp.down_proj", "mlp.c_proj", d)):
            out[f"{theirs}.{theirs_name}.weight"] = ours[f"{ours_prefix}.{ours_name}.weight"].t().contiguous()
            out[f"{theirs}.{theirs_name}.bias"] = bias_of(f"{ours_prefix}.{ours_name}", size)
    return out


def hf_config(model: Transformer) -> dict[str, Any]:
    """config.json contents for this model (LlamaForCausalLM or GPT2LMHeadModel)."""
    cfg = model.config
    family = export_family(cfg)
    architecture = _ARCHITECTURE_OF_FAMILY[family]
    token_ids = {f"{role}_token_id": getattr(model.tokenizer, f"{role}_id", None) for role in ("bos", "eos", "pad")}
    dtype_name = _DTYPE_NAMES.get(model.dtype, "float32")
    common = dict(architectures=[architecture], model_type=SUPPORTED[architecture][1], vocab_size=cfg.vocab_size,
                  tie_word_embeddings=cfg.tie_embeddings, **token_ids, torch_dtype=dtype_name, dtype=dtype_name,
                  use_cache=True)
    if family == "llama":
        return dict(
            common, hidden_size=cfg.d_model, num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads,
            num_key_value_heads=cfg.n_kv_heads, head_dim=cfg.head_dim, intermediate_size=cfg.d_mlp,
            hidden_act="silu", max_position_embeddings=cfg.max_seq_len, rms_norm_eps=cfg.norm_eps,
            rope_theta=cfg.rope_theta, rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
            attention_bias=bool(cfg.attn_bias or cfg.attn_out_bias), mlp_bias=cfg.mlp_bias,
            attention_dropout=cfg.dropout, initializer_range=0.02,
        )
    return dict(
        common, n_embd=cfg.d_model, n_layer=cfg.n_layers, n_head=cfg.n_heads, n_inner=cfg.d_mlp,
        n_positions=cfg.max_seq_len, layer_norm_epsilon=cfg.norm_eps,
        activation_function=_GPT2_ACTIVATION_NAMES[cfg.mlp], attn_pdrop=cfg.dropout, resid_pdrop=cfg.dropout,
        embd_pdrop=cfg.dropout, scale_attn_weights=True, initializer_range=0.02,
    )


def save_hf(model: Transformer, out_dir: str | Path) -> Path:
    """Write ``model`` as a Hugging Face directory that ``AutoModelForCausalLM.from_pretrained`` loads."""
    out_dir = Path(out_dir)
    config = hf_config(model)  # raises ConfigError before anything is written
    tensors = hf_state_dict(model)
    atomic_save_safetensors(tensors, out_dir / WEIGHTS_NAME, metadata={"format": "pt"})
    atomic_write_text(out_dir / CONFIG_NAME, json.dumps(config, indent=2) + "\n")
    _save_tokenizer(model.tokenizer, out_dir)
    return out_dir


def _save_tokenizer(tokenizer: Any, out_dir: Path) -> None:
    """Hugging Face's tokenizer.json (+ tokenizer_config.json for the bos/eos roles and chat
    template), when the model's tokenizer can produce one; our own char/word/BPE ones cannot."""
    if tokenizer is None:
        return
    if hasattr(tokenizer, "save_hf"):
        tokenizer.save_hf(out_dir / TOKENIZER_NAME)
    elif hasattr(tokenizer, "to_hf_json"):
        data = tokenizer.to_hf_json()
        atomic_write_text(out_dir / TOKENIZER_NAME, data if isinstance(data, str) else json.dumps(data))
    else:
        return
    roles = {f"{role}_token": getattr(tokenizer, f"{role}_token", None) for role in ("bos", "eos", "pad", "unk")}
    tokenizer_config = {k: v for k, v in roles.items() if isinstance(v, str)}
    tokenizer_config["add_bos_token"] = bool(getattr(tokenizer, "add_bos", False))
    tokenizer_config["tokenizer_class"] = "PreTrainedTokenizerFast"  # what AutoTokenizer builds from tokenizer.json
    if isinstance(getattr(tokenizer, "chat_template", None), str):
        tokenizer_config["chat_template"] = tokenizer.chat_template
    text = json.dumps(tokenizer_config, indent=2, ensure_ascii=False) + "\n"
    atomic_write_text(out_dir / TOKENIZER_CONFIG_NAME, text)
