"""Hugging Face PEFT's LoRA file format, both ways.

    DIR/adapter_config.json         LoraConfig fields (peft_type "LORA", r, lora_alpha, target_modules, ...)
    DIR/adapter_model.safetensors   base_model.model.<HF module>.lora_A.weight  (r, in)
                                    base_model.model.<HF module>.lora_B.weight  (out, r)

HF LLaMA module names map to ours one to one:
    model.layers.N.self_attn.q_proj  <->  blocks.N.attn.q_proj      (k, v, o alike)
    model.layers.N.mlp.gate_proj     <->  blocks.N.mlp.gate_proj    (up, down alike)

A file's q/k lora_B rows are in Hugging Face's rotate_half order, the order of the q/k rows of
the model PEFT applies it to: a model with ``rope_variant="interleaved"`` is exported with its
q/k rows permuted to that order (``hf_names.py``), so its adapters' B rows move with them
(``qk_rows_to_hf`` / ``qk_rows_from_hf``).
"""

from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import Any, Optional

from lucidlm.errors import AdapterError
from lucidlm.model.positions import permute_qk_to_half, permute_qk_to_interleaved
from lucidlm.validation import MAX_WIDTH, Fields, read_json_object

PEFT_CONFIG_NAME = "adapter_config.json"
PEFT_WEIGHTS_NAME = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."

_OURS_TO_HF = [(re.compile(r"^blocks\.(\d+)\.attn\.(\w+)$"), r"model.layers.\1.self_attn.\2"),
               (re.compile(r"^blocks\.(\d+)\.mlp\.(\w+)$"), r"model.layers.\1.mlp.\2")]
_HF_TO_OURS = [(re.compile(r"^model\.layers\.(\d+)\.self_attn\.(\w+)$"), r"blocks.\1.attn.\2"),
               (re.compile(r"^model\.layers\.(\d+)\.mlp\.(\w+)$"), r"blocks.\1.mlp.\2")]
# PEFT options that change what the tensors mean; lucidlm reads only plain LoRA.
# LoraConfig fields that change what the adapter computes (not only how it was initialised):
# each one set means the file is not a plain LoRA, and reading it as one would give other logits.
_UNSUPPORTED = {"use_dora": "DoRA", "use_qalora": "QA-LoRA", "modules_to_save": "modules_to_save",
                "layer_replication": "layer_replication", "lora_bias": "lora_bias",
                "trainable_token_indices": "trainable_token_indices", "target_parameters": "target_parameters",
                "alora_invocation_tokens": "aLoRA (activated only after its invocation tokens)",
                "use_bdlora": "BD-LoRA (block-diagonal)", "arrow_config": "Arrow routing",
                "kasa_config": "KaSA", "monteclora_config": "MonteCLoRA", "velora_config": "VeLoRA"}
# init_lora_weights values (lower case; pissa_niter_K and corda variants by prefix) under which PEFT
# changes the base weights when it creates the adapter (W - scale * B0 @ A0; LoftQ: a quantized W)
# and again when it loads it: the file's A and B belong to that changed base, not to the saved one.
_BASE_REWRITING_INITS = {"pissa": "PiSSA", "corda": "CorDA", "olora": "OLoRA", "loftq": "LoftQ", "lora_ga": "LoRA-GA"}
_CONVERTIBLE_INITS = ("PiSSA", "CorDA", "OLoRA")  # PEFT's save_pretrained converts these to plain LoRA
# Modules outside the transformer blocks PEFT can put LoRA on; lucidlm's LoRA covers the blocks' linear layers.
_OUTSIDE_BLOCKS = {"lm_head": "the output head (lm_head)", "embed_out": "the output head (embed_out)",
                   "embed_tokens": "the token embedding (embed_tokens)", "wte": "GPT-2's token embedding (wte)",
                   "wpe": "GPT-2's position embedding (wpe)"}
OUTSIDE_BLOCKS_FIX = ("lucidlm's LoRA covers the linear layers inside the blocks only (not the output head or the "
                      "embeddings). Train the adapter without it, or merge it in PEFT (merge_and_unload) and load the "
                      "merged model")


def outside_blocks(module: str) -> Optional[str]:
    """What ``module`` (an HF module name, or a target_modules suffix) is when it lies outside the blocks, else None."""
    return _OUTSIDE_BLOCKS.get(module.rsplit(".", 1)[-1])


def hf_module_name(ours: str) -> str:
    for pattern, replacement in _OURS_TO_HF:
        if pattern.match(ours):
            return pattern.sub(replacement, ours)
    return ours  # not a LLaMA-style name: keep ours, lucidlm reads it back as is


def our_module_name(hf: str) -> str:
    for pattern, replacement in _HF_TO_OURS:
        if pattern.match(hf):
            return pattern.sub(replacement, hf)
    return hf


_QK_MODULE = re.compile(r"^blocks\.\d+\.attn\.([qk])_proj$")


def _qk_heads(config: Any, module: str) -> Optional[int]:
    """The head count of ``module`` when it is a q/k projection of an interleaved-RoPE model, else None."""
    found = _QK_MODULE.match(module)
    if found is None or getattr(config, "rope_variant", "half") != "interleaved":
        return None
    return config.n_heads if found.group(1) == "q" else config.n_kv_heads


def qk_rows_to_hf(config: Any, module: str, lora_B: Any) -> Any:
    """``lora_B`` of our ``module`` with its rows in Hugging Face's order (unchanged but for the
    q/k projections of an interleaved-RoPE model, whose export permutes those rows too)."""
    heads = _qk_heads(config, module)
    return lora_B if heads is None else permute_qk_to_half(lora_B, heads)


def qk_rows_from_hf(config: Any, module: str, lora_B: Any) -> Any:
    """Inverse of ``qk_rows_to_hf``: a file's lora_B rows in our ``module``'s order."""
    heads = _qk_heads(config, module)
    return lora_B if heads is None else permute_qk_to_interleaved(lora_B, heads)


def to_peft_tensors(lora_tensors: dict[str, Any]) -> dict[str, Any]:
    """``blocks.0.attn.q_proj.lora_A`` -> ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``."""
    out = {}
    for key, tensor in lora_tensors.items():
        module, part = key.rsplit(".", 1)
        out[f"{PEFT_PREFIX}{hf_module_name(module)}.{part}.weight"] = tensor.contiguous()
    return out


def from_peft_tensors(tensors: dict[str, Any], source: str) -> dict[str, dict[str, Any]]:
    """PEFT keys -> ``{our module name: {"lora_A": A, "lora_B": B}}``."""
    modules: dict[str, dict[str, Any]] = {}
    key_re = re.compile(r"^(?:base_model\.model\.)?(.+)\.(lora_A|lora_B)(?:\.[\w-]+)?\.weight$")
    for key, tensor in tensors.items():
        outside = next((_OUTSIDE_BLOCKS[part] for part in key.split(".") if part in _OUTSIDE_BLOCKS), None)
        if outside is not None:  # before the generic messages below: name what the adapter adapts
            raise AdapterError(f"{source}: tensor {key!r} puts LoRA on {outside}; {OUTSIDE_BLOCKS_FIX}.")
        found = key_re.match(key)
        if found is None:
            raise AdapterError(f"{source}: tensor {key!r} is not a LoRA A/B matrix; lucidlm reads plain LoRA "
                               f"adapters only (no DoRA, biases, embeddings or modules_to_save).")
        module, part = our_module_name(found.group(1)), found.group(2)
        modules.setdefault(module, {})[part] = tensor
    for module, parts in modules.items():
        if set(parts) != {"lora_A", "lora_B"}:
            raise AdapterError(f"{source}: module {module!r} has {sorted(parts)} but LoRA needs both lora_A and lora_B.")
    return modules


def peft_config(r: int, alpha: float, dropout: float, targets: list[str],
                base_model_name_or_path: Optional[str] = None,
                rank_pattern: Optional[dict[str, int]] = None,
                alpha_pattern: Optional[dict[str, float]] = None) -> dict[str, Any]:
    """The adapter_config.json that ``peft.PeftModel.from_pretrained`` expects."""
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model_name_or_path,
        "revision": None, "inference_mode": True, "r": r, "lora_alpha": alpha, "lora_dropout": dropout,
        "target_modules": sorted(targets), "exclude_modules": None, "fan_in_fan_out": False, "bias": "none",
        "use_rslora": False, "modules_to_save": None, "init_lora_weights": True, "layers_to_transform": None,
        "layers_pattern": None, "rank_pattern": rank_pattern or {}, "alpha_pattern": alpha_pattern or {},
        "use_dora": False, "lora_bias": False,
    }


def read_peft_config(directory: Path) -> dict[str, Any]:
    """adapter_config.json, every field lucidlm uses checked for type and range (and each
    rank/alpha pattern compiled) before any tensor is read; AdapterError naming the field."""
    path = directory / PEFT_CONFIG_NAME
    if not path.is_file() and not path.is_dir():
        raise AdapterError(f"{path} does not exist; an adapter directory needs {PEFT_CONFIG_NAME} and "
                           f"{PEFT_WEIGHTS_NAME} (as written by lucidlm finetune or PEFT's save_pretrained).")
    fields = read_json_object(path, AdapterError, "PEFT adapter config", fix=_FIX)
    peft_type = fields.raw("peft_type", None)
    if peft_type != "LORA":
        raise AdapterError(f"{path}: peft_type is {peft_type!r}; lucidlm reads PEFT files of peft_type 'LORA' only.")
    for field, what in _UNSUPPORTED.items():
        if fields.raw(field, None) not in (None, False, [], {}, ""):
            raise AdapterError(f"{path}: {what} ({field}={fields.data[field]!r}) is not supported; lucidlm reads "
                               f"plain LoRA adapters.")
    _check_init(fields, path)
    bias = fields.str("bias", default="none")
    if bias != "none":
        raise AdapterError(f"{path}: bias={bias!r} trains base biases too; lucidlm reads bias='none' only.")
    config = dict(fields.data)
    config.update(
        r=fields.int("r", default=8, low=1, high=MAX_WIDTH),
        lora_alpha=fields.float("lora_alpha", default=8.0),
        lora_dropout=fields.float("lora_dropout", default=0.0, low=0.0, high=1.0, high_open=True),
        use_rslora=fields.bool("use_rslora", default=False),
        fan_in_fan_out=fields.bool("fan_in_fan_out", default=False),
        target_modules=_target_modules(fields),
        rank_pattern=_patterns(fields, "rank_pattern", lambda f, key: f.int(key, low=1, high=MAX_WIDTH)),
        alpha_pattern=_patterns(fields, "alpha_pattern", lambda f, key: f.float(key)),
    )
    return config


_FIX = "fix the adapter config or save the adapter again (lucidlm finetune, or PEFT's save_pretrained)"


def _check_init(fields: Fields, path: Path) -> None:
    """init_lora_weights True/False/"gaussian"/"eva"/"orthogonal"/"mica" only initialise A and B
    (MiCA also freezes B while training; it computes plain LoRA): the file is plain LoRA. The
    inits that rewrite the base weights are refused by name."""
    value = fields.raw("init_lora_weights", True)
    if not isinstance(value, str):
        return
    key = value.lower()
    found = next((name for prefix, name in _BASE_REWRITING_INITS.items() if key.startswith(prefix)), None)
    if found is not None:
        merge = "merge it in PEFT (merge_and_unload) and load the merged model"
        fix = (f"Convert it in PEFT to a plain LoRA, which lucidlm reads (save_pretrained(out, "
               f"path_initial_model_for_weight_conversion=<the untrained {found} adapter's directory>)), or {merge}"
               if found in _CONVERTIBLE_INITS else merge[0].upper() + merge[1:])
        raise AdapterError(f"{path}: init_lora_weights={value!r} ({found}) changes the base weights when PEFT creates "
                           f"the adapter and again when it loads it, so its A and B do not apply to the unchanged "
                           f"base model lucidlm loads. {fix}.")


def _target_modules(fields: Fields) -> Optional[str | list[str]]:
    """PEFT allows a list of module names or one regular expression over full names."""
    value = fields.raw("target_modules", None)
    if value is None or isinstance(value, str) and value == "all-linear":
        return value
    if isinstance(value, str):
        _compile(fields, "target_modules", value)
        return value
    return fields.list("target_modules", item=str)


def _patterns(fields: Fields, key: str, value_of) -> dict[str, Any]:
    """``{regex: value}`` of rank_pattern / alpha_pattern, each regex compiled as PEFT matches it."""
    patterns = fields.object(key, default={})
    for name in patterns.data:
        _compile(fields, f"{key}[{name!r}]", name)
    return {name: value_of(patterns, name) for name in patterns.data}


@functools.lru_cache(maxsize=256)
def _boundary_regex(pattern: str) -> re.Pattern:
    return re.compile(rf"(.*\.)?({pattern})$")  # PEFT's get_pattern_key: a match at a name boundary


def _compile(fields: Fields, where: str, pattern: str) -> None:
    try:
        _boundary_regex(pattern)
    except (re.error, RecursionError, OverflowError) as exc:
        fields.fail(f"{where}: {pattern!r} is not a valid regular expression ({exc})")


def module_pattern(config: dict[str, Any], key: str, hf_name: str, default: Any) -> Any:
    """The value of ``config[key]`` (rank_pattern / alpha_pattern) for one module, else ``default``."""
    for pattern, value in (config.get(key) or {}).items():
        if _boundary_regex(pattern).match(hf_name):
            return value
    return default


def module_alpha(config: dict[str, Any], hf_name: str) -> float:
    """lora_alpha for one module, honouring PEFT's alpha_pattern (key matched at a name boundary)."""
    return float(module_pattern(config, "alpha_pattern", hf_name, config.get("lora_alpha", 8)))


def module_rank(config: dict[str, Any], hf_name: str) -> int:
    """r for one module, honouring PEFT's rank_pattern."""
    return int(module_pattern(config, "rank_pattern", hf_name, config.get("r", 8)))


def module_scaling(config: dict[str, Any], hf_name: str, r: int) -> float:
    alpha = module_alpha(config, hf_name)
    return alpha / r ** 0.5 if config.get("use_rslora") else alpha / r
