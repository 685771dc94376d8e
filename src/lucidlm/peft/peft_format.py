"""Hugging Face PEFT's LoRA file format, both ways.

    DIR/adapter_config.json         LoraConfig fields (peft_type "LORA", r, lora_alpha, target_modules, ...)
    DIR/adapter_model.safetensors   base_model.model.<HF module>.lora_A.weight  (r, in)
                                    base_model.model.<HF module>.lora_B.weight  (out, r)

HF LLaMA module names map to ours one to one:
    model.layers.N.self_attn.q_proj  <->  blocks.N.attn.q_proj      (k, v, o alike)
    model.layers.N.mlp.gate_proj     <->  blocks.N.mlp.gate_proj    (up, down alike)
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Optional

from lucidlm.errors import AdapterError

PEFT_CONFIG_NAME = "adapter_config.json"
PEFT_WEIGHTS_NAME = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."

_OURS_TO_HF = [(re.compile(r"^blocks\.(\d+)\.attn\.(\w+)$"), r"model.layers.\1.self_attn.\2"),
               (re.compile(r"^blocks\.(\d+)\.mlp\.(\w+)$"), r"model.layers.\1.mlp.\2")]
_HF_TO_OURS = [(re.compile(r"^model\.layers\.(\d+)\.self_attn\.(\w+)$"), r"blocks.\1.attn.\2"),
               (re.compile(r"^model\.layers\.(\d+)\.mlp\.(\w+)$"), r"blocks.\1.mlp.\2")]
# PEFT options that change what the tensors mean; lucidlm reads only plain LoRA.
_UNSUPPORTED = {"use_dora": "DoRA", "use_qalora": "QA-LoRA", "modules_to_save": "modules_to_save",
                "layer_replication": "layer_replication", "lora_bias": "lora_bias",
                "trainable_token_indices": "trainable_token_indices", "target_parameters": "target_parameters"}


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
    path = directory / PEFT_CONFIG_NAME
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        raise AdapterError(f"{path} does not exist; an adapter directory needs {PEFT_CONFIG_NAME} and "
                           f"{PEFT_WEIGHTS_NAME} (as written by lucidlm finetune or PEFT's save_pretrained).") from None
    except json.JSONDecodeError as exc:
        raise AdapterError(f"{path} is not valid JSON ({exc}).") from None
    if config.get("peft_type") != "LORA":
        raise AdapterError(f"{path}: peft_type is {config.get('peft_type')!r}; lucidlm reads PEFT files of "
                           f"peft_type 'LORA' only.")
    for field, what in _UNSUPPORTED.items():
        if config.get(field):
            raise AdapterError(f"{path}: {what} ({field}={config[field]!r}) is not supported; lucidlm reads "
                               f"plain LoRA adapters.")
    if config.get("bias", "none") != "none":
        raise AdapterError(f"{path}: bias={config['bias']!r} trains base biases too; lucidlm reads bias='none' only.")
    return config


def module_alpha(config: dict[str, Any], hf_name: str) -> float:
    """lora_alpha for one module, honouring PEFT's alpha_pattern (key matched at a name boundary)."""
    for key, alpha in (config.get("alpha_pattern") or {}).items():
        if re.match(rf"(.*\.)?{key}$", hf_name):
            return float(alpha)
    return float(config.get("lora_alpha", 8))


def module_scaling(config: dict[str, Any], hf_name: str, r: int) -> float:
    alpha = module_alpha(config, hf_name)
    return alpha / r ** 0.5 if config.get("use_rslora") else alpha / r
