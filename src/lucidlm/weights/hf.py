"""Hugging Face model directories, both ways: ``load_hf`` reads one, ``save_hf`` writes one.

A Hugging Face directory is ``config.json`` plus ``model.safetensors`` (or shards listed in
``model.safetensors.index.json``). These architectures map onto our ModelConfig:

- ``LlamaForCausalLM``: RoPE in the rotate_half layout (our ``rope_variant="half"``),
  RMSNorm, SwiGLU, grouped-query attention. Names differ from ours, tensors do not.
- ``Qwen2ForCausalLM`` (Qwen 2 and 2.5) and ``Qwen3ForCausalLM`` (Qwen 3): LLaMA's layout with
  Qwen 2's q/k/v biases, or Qwen 3's q/k norms and explicit head_dim (``hf_families.py``).
- ``GPT2LMHeadModel``: learned positions, LayerNorm, GELU(tanh), biases. Its ``Conv1D``
  layers store weights as (in, out), the transpose of ``nn.Linear``, and ``c_attn`` holds
  q, k and v side by side in one matrix.

Both directions go through one table, ``hf_state_dict(model)`` in ``hf_names.py``: the
tensors a Hugging Face checkpoint of this model holds, by their Hugging Face names. Saving
writes it; loading checks the file against its names, shapes and float dtypes, refuses any
tensor left over (a wrong config or an unsupported variant), then inverts the mapping.
Reading and checking ``config.json`` itself is ``hf_config.py``.
"""

from __future__ import annotations

import json
import re
import warnings
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from lucidlm.config import ModelConfig
from lucidlm.errors import (
    MissingTensorError,
    TokenizerError,
    ShapeMismatchError,
    WeightsError,
)
from lucidlm.model.transformer import Transformer
from lucidlm.outputs import user_path
from lucidlm.staging import atomic_write_text
from lucidlm.validation import read_json_object
from lucidlm.weights.checkpoint import atomic_save_safetensors, replacing_model
from lucidlm.weights.finite import FiniteCheck
from lucidlm.weights.hf_config import (  # noqa: F401  (the file names re-exported: this module was their home)
    CONFIG_NAME, GPT2_NAMES, INDEX_NAME, LLAMA_NAMES, SUPPORTED, TOKENIZER_CONFIG_NAME, TOKENIZER_NAME, WEIGHTS_NAME,
    config_from_hf, hf_family, read_hf_config)
from lucidlm.weights.hf_families import LLAMA_SHAPED, LlamaShapedFamily
from lucidlm.weights.hf_generation_config import (end_token_ids, hf_eos_token_id, role_token_id,
                                                   use_generation_eos_ids, write_generation_config)
from lucidlm.weights.hf_names import (ARCHITECTURE_OF_FAMILY, GPT2_ACTIVATION_NAMES, export_family,
                                      hf_state_dict, to_our_names)
from lucidlm.weights.state import load_into


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
    """A Transformer (or ``model_cls``, a subclass) with the weights of a Hugging Face LLaMA,
    Qwen 2/2.5, Qwen 3 or GPT-2 directory."""
    path = Path(path)
    hf_config = read_hf_config(path)
    family = hf_family(hf_config)
    config = config_from_hf(hf_config)
    model = model_cls.empty(config, device)  # checks the memory this config needs first
    tensors = read_safetensors(path)
    load_into(model, _to_our_names(model, family, tensors, path), path)
    model.tokenizer = _load_tokenizer(path)
    # generation stops on generation_config.json's eos ids (else config.json's), as in transformers,
    # with or without a tokenizer.json (hf_generation_config.py)
    use_generation_eos_ids(model, path)
    return model.to(dtype).eval()


def read_safetensors(path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of a Hugging Face directory, from one file or from the shards its index lists.
    ``model.safetensors`` wins over an index beside it, as in transformers' ``from_pretrained``
    (``_get_resolved_checkpoint_files`` tries it first): its ``save_pretrained`` leaves an old
    index behind when a model saved in shards is saved again in one file."""
    path = Path(path)
    files = [WEIGHTS_NAME] if (path / WEIGHTS_NAME).is_file() or not (path / INDEX_NAME).is_file() \
        else _shard_files(path)
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
    names = GPT2_NAMES if family == "gpt2" else LLAMA_NAMES
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
        _check_float_dtype(tensors[name], name, source)
    _check_nothing_left_over(model.config, family, tensors, set(expected), source, sizes)
    return to_our_names(model.config, family, tensors)


# Tensors a checkpoint may hold that a model of its config has no use for, and rightly so:
# GPT-2's causal-mask buffers (attn.bias, attn.masked_bias) and RoPE's inverse frequencies.
_HARMLESS = re.compile(r"(^transformer\.h\.\d+\.attn\.(bias|masked_bias)$)|(rotary_emb\.inv_freq$)")
_LAYER_INDEX = re.compile(r"\.(?:layers|h)\.(\d+)\.")
_FLOAT8 = {getattr(torch, n) for n in ("float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz",
                                       "float8_e8m0fnu") if hasattr(torch, n)}


def _check_float_dtype(tensor: torch.Tensor, name: str, source: Path) -> None:
    """A weight stored as float8 or 8-bit integers is quantized (it needs scales lucidlm does not
    read), and one stored as another integer, bool or complex is no weight at all: converting
    either to float would load wrong numbers without a word."""
    if tensor.is_floating_point() and tensor.dtype not in _FLOAT8:
        return
    dtype = str(tensor.dtype).removeprefix("torch.")
    quantized = tensor.dtype in _FLOAT8 or tensor.dtype in (torch.int8, torch.uint8)
    what = "a quantized format" if quantized else "not a floating-point type (the file is damaged or not a model)"
    fix = "use the model's unquantized release" if quantized else "re-download or re-convert it"
    raise WeightsError(
        f"{source}: tensor {name!r} is stored as {dtype}, {what}; lucidlm reads Hugging Face checkpoints in "
        f"float32, float16 or bfloat16 (and quantizes them itself with quantize=): {fix}."
    )


def _check_nothing_left_over(config: ModelConfig, family: str, tensors: dict[str, torch.Tensor], used: set[str],
                             source: Path, sizes: str) -> None:
    """Refuse a checkpoint holding tensors this config has no place for: loading without them
    would build a different model than the file's (a 2-layer file read as 1 layer, a Qwen 3
    style q_norm/k_norm checkpoint labelled LLaMA, a tied config with its own lm_head)."""
    left = {name for name in tensors if name not in used and not _HARMLESS.search(name)}
    embed = "transformer.wte.weight" if family == "gpt2" else "model.embed_tokens.weight"
    if config.tie_embeddings and "lm_head.weight" in left:
        head = tensors["lm_head.weight"]
        if head.shape == tensors[embed].shape and torch.equal(head, tensors[embed]):
            left.discard("lm_head.weight")  # a tied model saved with both names: the same matrix twice
        else:
            raise WeightsError(
                f"{source}: config.json says tie_word_embeddings=true, but the file's 'lm_head.weight' differs from "
                f"{embed!r}, so which one the output layer uses is ambiguous; set tie_word_embeddings to false in "
                f"config.json if the model has its own output matrix, or remove lm_head.weight from the file."
            )
    if not left:
        return
    names = GPT2_NAMES if family == "gpt2" else LLAMA_NAMES
    layers = [int(m.group(1)) for m in map(_LAYER_INDEX.search, tensors) if m]
    if layers and max(layers) >= config.n_layers:
        cause = (f"the file has tensors for layers 0..{max(layers)} but config.json's {names['n_layers']}="
                 f"{config.n_layers}; correct config.json")
    elif family != "gpt2" and all(name.endswith("_proj.bias") for name in left):
        cause = _bias_cause(LLAMA_SHAPED[family], left)
    else:
        cause = (f"config.json ({sizes}) does not describe these weights, or the checkpoint is an architecture "
                 f"variant lucidlm does not implement (e.g. Qwen 3's q_norm/k_norm in a file labelled LLaMA); "
                 f"correct config.json or "
                 f"use a supported model")
    raise WeightsError(
        f"{source}: {len(left)} tensor(s) in the file have no place in a model of this config, e.g. "
        f"{sorted(left)[:4]}; {cause}."
    )


def _bias_cause(facts: LlamaShapedFamily, left: set[str]) -> str:
    """Why a LLaMA-shaped file's leftover ``*_proj.bias`` tensors have no place: a bias the
    architecture never has (Qwen 2's o_proj, Qwen 3's MLP) means the file is another model; one
    that config.json's attention_bias / mlp_bias switch turns on means config.json is wrong."""
    kinds = {"q/k/v": r"\.self_attn\.[qkv]_proj\.", "o_proj": r"\.self_attn\.o_proj\.", "MLP": r"\.mlp\."}
    never = {"q/k/v": facts.qkv_bias is False, "o_proj": facts.out_bias is False, "MLP": not facts.mlp_bias_switch}
    foreign = [kind for kind, pattern in kinds.items() if never[kind] and any(re.search(pattern, n) for n in left)]
    if foreign:
        return (f"{facts.architecture} has no {' or '.join(foreign)} bias; this file is not a {facts.title} "
                f"checkpoint (or config.json names the wrong architecture)")
    switches = ["attention_bias"] * (facts.qkv_bias is None or facts.out_bias is None) + \
               ["mlp_bias"] * facts.mlp_bias_switch
    verb = "say" if len(switches) > 1 else "says"
    return (f"the file has bias tensors but config.json's {' / '.join(switches)} {verb} there are none; "
            f"correct config.json")


def _load_tokenizer(path: Path) -> Any:
    if not (path / TOKENIZER_NAME).is_file():
        return None
    try:
        from lucidlm.tokenizers.pretrained import HFTokenizer
    except ImportError:  # the pretrained-tokenizer module is optional
        return None
    return HFTokenizer.from_file(path / TOKENIZER_NAME)


# ----------------------------------------------------------------------------- writing

def hf_config(model: Transformer) -> dict[str, Any]:
    """config.json contents for this model (LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM or
    GPT2LMHeadModel, as ``export_family`` picks)."""
    cfg = model.config
    family = export_family(cfg)
    architecture = ARCHITECTURE_OF_FAMILY[family]
    # eos: the ids lucidlm stops on, which may differ from the tokenizer's eos_token role (a
    # config.json that names another end token, Llama 3's list); transformers reads them here
    # when there is no generation_config.json, and write_generation_config repeats them there
    # bos/pad: the tokenizer's roles, or those the model's directory declared when it has none
    token_ids = {"bos_token_id": role_token_id(model, "bos"),
                 "eos_token_id": hf_eos_token_id(end_token_ids(model)),
                 "pad_token_id": role_token_id(model, "pad")}
    dtype_name = _DTYPE_NAMES.get(model.dtype, "float32")
    common = dict(architectures=[architecture], model_type=SUPPORTED[architecture][1], vocab_size=cfg.vocab_size,
                  tie_word_embeddings=cfg.tie_embeddings, **token_ids, torch_dtype=dtype_name, dtype=dtype_name,
                  use_cache=True)
    if family in LLAMA_SHAPED:
        return dict(
            common, hidden_size=cfg.d_model, num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads,
            num_key_value_heads=cfg.n_kv_heads, head_dim=cfg.head_dim, intermediate_size=cfg.d_mlp,
            hidden_act="silu", max_position_embeddings=cfg.max_seq_len, rms_norm_eps=cfg.norm_eps,
            # transformers 5 reads rope_parameters; 4.x reads rope_scaling beside the top-level rope_theta
            rope_theta=cfg.rope_theta, rope_parameters={"rope_type": "default", **(cfg.rope_scaling or {}),
                                                        "rope_theta": cfg.rope_theta},
            **({"rope_scaling": dict(cfg.rope_scaling)} if cfg.rope_scaling else {}),
            attention_dropout=cfg.dropout, initializer_range=0.02, **_switches(cfg, LLAMA_SHAPED[family]),
        )
    return dict(
        common, n_embd=cfg.d_model, n_layer=cfg.n_layers, n_head=cfg.n_heads, n_inner=cfg.d_mlp,
        n_positions=cfg.max_seq_len, layer_norm_epsilon=cfg.norm_eps,
        activation_function=GPT2_ACTIVATION_NAMES[cfg.mlp], attn_pdrop=cfg.dropout, resid_pdrop=cfg.dropout,
        embd_pdrop=cfg.dropout, scale_attn_weights=True, initializer_range=0.02,
    )


def _switches(cfg: ModelConfig, family: LlamaShapedFamily) -> dict[str, Any]:
    """The config.json switches this LLaMA-shaped architecture has: LLaMA's attention_bias (one for
    q/k/v/o: zeros fill the ones we lack) and mlp_bias, Qwen 3's attention_bias, and Qwen's
    use_sliding_window, always false (lucidlm attends globally in every layer of these)."""
    switches: dict[str, Any] = {}
    if family.qkv_bias is None:
        switches["attention_bias"] = bool(cfg.attn_bias or cfg.attn_out_bias)
    if family.mlp_bias_switch:
        switches["mlp_bias"] = cfg.mlp_bias
    if family.sliding_window_switch:
        switches["use_sliding_window"] = False
    return switches


def save_hf(model: Transformer, out_dir: str | Path) -> Path:
    """Write ``model`` as a Hugging Face directory that ``AutoModelForCausalLM.from_pretrained`` loads."""
    out_dir = user_path(out_dir)  # "~/m" is where lucidlm.load("~/m") looks, not ./~/m
    config = hf_config(model)  # raises ConfigError before anything is written
    tensors = hf_state_dict(model)
    with replacing_model(out_dir):  # an earlier save's files this one does not write are removed
        atomic_save_safetensors(tensors, out_dir / WEIGHTS_NAME, metadata={"format": "pt"})
        atomic_write_text(out_dir / CONFIG_NAME, json.dumps(config, indent=2) + "\n")
        _save_tokenizer(model.tokenizer, out_dir)
        write_generation_config(out_dir, model)  # its sampling defaults and end tokens
    return out_dir


def _save_tokenizer(tokenizer: Any, out_dir: Path) -> None:
    """Hugging Face's tokenizer.json (+ tokenizer_config.json for the bos/eos roles and chat
    template), when the model's tokenizer can produce one: Hugging Face-backed ones and byte-level
    BPE can, our char and word tokenizers cannot. A BPE tokenizer Hugging Face cannot mirror is
    left out with a warning saying why; the weights are exported all the same."""
    if tokenizer is None:
        return
    if hasattr(tokenizer, "save_hf"):
        tokenizer.save_hf(out_dir / TOKENIZER_NAME)
    elif hasattr(tokenizer, "to_hf_json"):
        try:
            data = tokenizer.to_hf_json()
        except TokenizerError as exc:
            warnings.warn(f"{exc} The Hugging Face export in {out_dir} has no tokenizer.", stacklevel=3)
            return
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
