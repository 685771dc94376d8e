"""Which linear layers a LoRA adapter goes on: ``--targets`` text -> module names, with PEFT's matching rule.

A plain name (``q_proj``, or a short form ``q``) matches every module whose name is it or ends
with ``.`` + it; an entry with regex characters must match the whole module name; ``all-linear``
takes every linear layer but the output head; ``default`` is what PEFT picks for the
architecture when ``target_modules`` is unset (q_proj and v_proj; GPT-2's c_attn). On GPT-2, its
own names (``c_attn``, ``c_proj``, ``c_fc``) map to lucidlm's (``gpt2_names.py``). Kept apart from ``lora.py`` because the training
CLI expands targets before any model is adapted.
"""

from __future__ import annotations

import re
from typing import Iterable

from torch import nn

from lucidlm.errors import AdapterError
from lucidlm.peft.gpt2_names import GPT2_TARGETS, is_gpt2

# What a user may type instead of the full module name (``--targets q,v``).
SHORT_TARGETS = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "o_proj",
                 "gate": "gate_proj", "up": "up_proj", "down": "down_proj"}
DEFAULT_TARGETS = "default"


def default_targets(model: nn.Module) -> list[str]:
    """PEFT's targets for the architecture when none are given (its
    TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING): GPT-2's fused q/k/v, else q and v."""
    return ["c_attn"] if is_gpt2(model) else ["q_proj", "v_proj"]


def linear_module_names(model: nn.Module) -> list[str]:
    """Names of the linear layers LoRA may target (the output head is not one of them)."""
    return [name for name, module in model.named_modules()
            if isinstance(module, nn.Linear) and name != "unembed" and name]


def expand_targets(targets: str | Iterable[str]) -> list[str]:
    """``"q,v"`` or ``["q_proj", "v"]`` -> ``["q_proj", "v_proj"]``; "all-linear" stays as is."""
    if isinstance(targets, str):
        targets = [t for t in targets.split(",")] if "," in targets else [targets]
    expanded = [SHORT_TARGETS.get(t.strip(), t.strip()) for t in targets if t.strip()]
    if not expanded:
        raise AdapterError("no LoRA target modules given; name some, e.g. q_proj,v_proj or all-linear.")
    return expanded


def resolved_targets(model: nn.Module, targets: str | Iterable[str]) -> list[str]:
    """``expand_targets``, with ``default`` replaced by the architecture's own targets."""
    patterns = expand_targets(targets)
    return default_targets(model) if patterns == [DEFAULT_TARGETS] else patterns


def match_targets(model: nn.Module, targets: str | Iterable[str]) -> list[str]:
    """Module names matched by ``targets``, with PEFT's rule: a plain name matches a module
    whose name is it or ends with ``.`` + it (``q_proj`` -> ``blocks.3.attn.q_proj``); an
    entry with regex characters must match the whole module name (``blocks\\.[0-3]\\.attn\\..*``)."""
    candidates = linear_module_names(model)
    patterns = resolved_targets(model, targets)
    if patterns == ["all-linear"]:
        return candidates
    if any(p in GPT2_TARGETS for p in patterns) and is_gpt2(model):  # GPT-2's names: c_attn, c_proj, c_fc
        patterns = [q for p in patterns for q in GPT2_TARGETS.get(p, [p])]
    chosen: list[str] = []
    for pattern in patterns:
        if re.fullmatch(r"[\w.]+", pattern):
            found = [n for n in candidates if n == pattern or n.endswith("." + pattern)]
        else:
            try:
                regex = re.compile(pattern)
            except re.error as exc:
                raise AdapterError(f"LoRA target {pattern!r} is not a valid regular expression ({exc}).") from None
            found = [n for n in candidates if regex.fullmatch(n)]
        if not found:
            suffixes = sorted({n.rsplit(".", 1)[-1] for n in candidates})
            raise AdapterError(
                f"LoRA target {pattern!r} matches no linear layer of this model. Linear layers are named: "
                f"{', '.join(suffixes)} (or use all-linear, or a regex over full names like blocks.0.attn.q_proj)."
            )
        chosen.extend(n for n in found if n not in chosen)
    return [n for n in candidates if n in chosen]  # in model order
