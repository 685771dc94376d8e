"""LoRA: low-rank updates to frozen linear layers (Hu et al., 2021; seed 004 section 3.2).

    y = W x + b  +  (alpha / r) * B (A dropout(x))        A: (r, in), B: (out, r), B = 0 at start

Because B starts at zero the adapted model starts out *equal* to the base model, and only
A and B (r * (in + out) numbers per layer) are trained. After training, ``merge`` folds the
update into W (W + scale * B @ A) so inference costs nothing extra; ``unmerge`` takes it out.

``LoRALinear`` is an ``nn.Linear`` that keeps the base ``weight``/``bias`` under their usual
names (so loaders, hooks and ``state_dict`` names of the base are unchanged) and holds any
number of named adapters beside them; one is active at a time.
"""

from __future__ import annotations

import math
import re
from typing import Iterable, Iterator, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from lucidlm.errors import AdapterError
from lucidlm.peft.gpt2_names import GPT2_TARGETS, is_gpt2, tie_fused_qkv

# What a user may type instead of the full module name (``--targets q,v``).
SHORT_TARGETS = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "o_proj",
                 "gate": "gate_proj", "up": "up_proj", "down": "down_proj"}
LORA_INITS = ("kaiming", "gaussian")


class LoRALinear(nn.Linear):
    """A frozen ``nn.Linear`` plus named low-rank adapters (``lora_A[name]``, ``lora_B[name]``)."""

    def __init__(self, base: nn.Linear) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight  # the same Parameter objects: tying and names survive
        self.bias = base.bias
        self.lora_A = nn.ParameterDict()  # name -> (r, in)
        self.lora_B = nn.ParameterDict()  # name -> (out, r)
        self.scaling: dict[str, float] = {}
        self.lora_dropout: dict[str, float] = {}
        self.active_adapter: Optional[str] = None
        self.merged_adapter: Optional[str] = None  # the adapter currently folded into weight
        self.disabled = False  # True: behave exactly like the base layer

    def add_adapter(self, name: str, r: int, alpha: float, dropout: float = 0.0, init: str = "kaiming") -> None:
        if name in self.lora_A:
            raise AdapterError(f"this layer already has a LoRA adapter named {name!r}; pick another name.")
        device, dtype = self.weight.device, self.weight.dtype
        dtype = dtype if dtype.is_floating_point else torch.float32
        A = torch.empty(r, self.in_features, device=device, dtype=dtype)
        if init == "kaiming":  # PEFT's default: the same init nn.Linear gives its weight
            nn.init.kaiming_uniform_(A, a=math.sqrt(5))
        else:  # the LoRA paper's Gaussian (PEFT: std = 1/r)
            nn.init.normal_(A, std=1.0 / r)
        self.lora_A[name] = nn.Parameter(A)
        self.lora_B[name] = nn.Parameter(torch.zeros(self.out_features, r, device=device, dtype=dtype))
        self.scaling[name] = alpha / r
        self.lora_dropout[name] = float(dropout)
        if self.active_adapter is None:
            self.active_adapter = name

    def rank(self, name: str) -> int:
        return self.lora_A[name].shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight, self.bias)  # (..., out)
        name = self.active_adapter
        if self.disabled or name is None or self.merged_adapter is not None:
            return out
        A, B = self.lora_A[name], self.lora_B[name]
        dropped = F.dropout(x, self.lora_dropout[name], self.training) if self.lora_dropout[name] > 0 else x
        update = F.linear(F.linear(dropped.to(A.dtype), A), B)  # (..., r) -> (..., out)
        return out + (update * self.scaling[name]).to(out.dtype)

    # -- merging: fold the update into W, in float32 (a bf16 merge drifts) --
    def delta_weight(self, name: str) -> torch.Tensor:
        """scale * B @ A in float32, (out, in)."""
        return (self.lora_B[name].float() @ self.lora_A[name].float()) * self.scaling[name]

    def merge(self) -> None:
        if self.merged_adapter is not None:
            raise AdapterError(f"LoRA adapter {self.merged_adapter!r} is already merged into this layer; "
                               f"call unmerge() before merging again.")
        if self.active_adapter is None:
            raise AdapterError("this layer has no LoRA adapter to merge.")
        with torch.no_grad():
            merged = self.weight.float() + self.delta_weight(self.active_adapter)
            self.weight.copy_(merged.to(self.weight.dtype))
        self.merged_adapter = self.active_adapter

    def unmerge(self) -> None:
        if self.merged_adapter is None:
            raise AdapterError("no LoRA adapter is merged into this layer; nothing to unmerge.")
        with torch.no_grad():
            restored = self.weight.float() - self.delta_weight(self.merged_adapter)
            self.weight.copy_(restored.to(self.weight.dtype))
        self.merged_adapter = None

    def as_linear(self) -> nn.Linear:
        """A plain nn.Linear holding the (possibly merged) base weights."""
        linear = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None, device="meta")
        linear.weight, linear.bias = self.weight, self.bias
        return linear

    def extra_repr(self) -> str:
        adapters = ", ".join(f"{n}(r={self.rank(n)}, scale={self.scaling[n]:g})" for n in self.lora_A)
        return (f"in_features={self.in_features}, out_features={self.out_features}, adapters=[{adapters}], "
                f"active={self.active_adapter!r}, merged={self.merged_adapter!r}")


# ---------------------------------------------------------------------------------------
# Model-level: choose layers, attach, switch, merge.
# ---------------------------------------------------------------------------------------

def lora_layers(model: nn.Module) -> Iterator[tuple[str, LoRALinear]]:
    for name, module in model.named_modules():
        if isinstance(module, LoRALinear):
            yield name, module


def adapter_names(model: nn.Module) -> list[str]:
    names: dict[str, None] = {}
    for _, layer in lora_layers(model):
        names.update(dict.fromkeys(layer.lora_A))
    return list(names)


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


def match_targets(model: nn.Module, targets: str | Iterable[str]) -> list[str]:
    """Module names matched by ``targets``, with PEFT's rule: a plain name matches a module
    whose name is it or ends with ``.`` + it (``q_proj`` -> ``blocks.3.attn.q_proj``); an
    entry with regex characters must match the whole module name (``blocks\\.[0-3]\\.attn\\..*``)."""
    candidates = linear_module_names(model)
    patterns = expand_targets(targets)
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


def add_lora(model: nn.Module, name: str = "default", r: int = 8, alpha: float = 16, dropout: float = 0.0,
             targets: str | Sequence[str] = ("q_proj", "v_proj"), init: str = "kaiming") -> list[str]:
    """Attach a LoRA adapter called ``name`` to every linear layer matched by ``targets``,
    make it the active one, and freeze everything else. Returns the adapted module names."""
    if isinstance(r, bool) or not isinstance(r, int) or r <= 0:
        raise AdapterError(f"LoRA rank r={r!r} must be a positive integer (typical: 4, 8, 16).")
    if init not in LORA_INITS:
        raise AdapterError(f"unknown LoRA init {init!r}; choose one of {', '.join(LORA_INITS)}.")
    if not _finite(dropout) or not 0.0 <= dropout < 1.0:
        raise AdapterError(f"LoRA dropout={dropout!r} must be in [0, 1).")
    if not _finite(alpha):
        raise AdapterError(f"LoRA alpha={alpha!r} must be a finite number (updates are scaled by alpha / r; "
                           f"typical: 2 * r).")
    if name in adapter_names(model):
        raise AdapterError(f"the model already has a LoRA adapter named {name!r}; pick another name.")
    if any(layer.merged_adapter for _, layer in lora_layers(model)):
        raise AdapterError("a LoRA adapter is merged into the model; unmerge it before adding another.")
    chosen = match_targets(model, targets)
    for module_name in chosen:
        linear = model.get_submodule(module_name)
        limit = min(linear.in_features, linear.out_features)
        if r > limit:
            raise AdapterError(
                f"LoRA rank r={r} is larger than {module_name} allows: its weight is "
                f"({linear.out_features}, {linear.in_features}), so r must be <= {limit}."
            )
    freeze_base(model)
    for module_name in chosen:
        layer = _as_lora(model, module_name)
        layer.add_adapter(name, r, alpha, dropout, init)
    if "c_attn" in expand_targets(targets) and is_gpt2(model):
        tie_fused_qkv(model, name)  # one LoRA on the fused q/k/v: the three share A (gpt2_names.py)
    set_adapter(model, name)
    return chosen


def _finite(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _as_lora(model: nn.Module, module_name: str) -> LoRALinear:
    module = model.get_submodule(module_name)
    if isinstance(module, LoRALinear):
        return module
    layer = LoRALinear(module)
    parent_name, _, child = module_name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, layer)
    return layer


def _check_known(model: nn.Module, name: str) -> None:
    names = adapter_names(model)
    if name not in names:
        raise AdapterError(f"no LoRA adapter named {name!r}; the model has: {', '.join(names) or 'none'}.")


def set_adapter(model: nn.Module, name: str) -> None:
    """Make ``name`` the active LoRA adapter (and the only trainable one)."""
    _check_known(model, name)
    layers = list(lora_layers(model))
    if any(layer.merged_adapter not in (None, name) for _, layer in layers):
        raise AdapterError(f"another LoRA adapter is merged into the weights; unmerge it before switching to {name!r}.")
    for _, layer in layers:
        layer.active_adapter = name if name in layer.lora_A else None
        for adapter, param in layer.lora_A.items():
            param.requires_grad_(adapter == name)
            layer.lora_B[adapter].requires_grad_(adapter == name)


def merge_adapter(model: nn.Module) -> None:
    """Fold the active adapter into the base weights (W += scale * B @ A, in float32)."""
    layers = [layer for _, layer in lora_layers(model) if layer.active_adapter is not None]
    if not layers:
        raise AdapterError("the model has no active LoRA adapter to merge.")
    merged = [layer.merged_adapter for layer in layers if layer.merged_adapter is not None]
    if merged:
        raise AdapterError(f"LoRA adapter {merged[0]!r} is already merged; call unmerge_adapter() first.")
    for layer in layers:
        layer.merge()


def unmerge_adapter(model: nn.Module) -> None:
    """Take the merged adapter back out of the base weights."""
    layers = [layer for _, layer in lora_layers(model) if layer.merged_adapter is not None]
    if not layers:
        raise AdapterError("no LoRA adapter is merged into the model; nothing to unmerge.")
    for layer in layers:
        layer.unmerge()


def unload_lora(model: nn.Module, merge: bool = False) -> nn.Module:
    """Replace every LoRALinear by a plain nn.Linear (merging the active adapter first when
    ``merge``): the model is then an ordinary model that saves and loads like any other."""
    if merge and not any(layer.merged_adapter for _, layer in lora_layers(model)):
        merge_adapter(model)
    for module_name, layer in list(lora_layers(model)):
        parent_name, _, child = module_name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, layer.as_linear())
    return model


def merge_and_unload(model: nn.Module) -> nn.Module:
    return unload_lora(model, merge=True)


def lora_state_dict(model: nn.Module, name: str) -> dict[str, torch.Tensor]:
    """``{module_name: (A, B)}`` flattened to ``module.lora_A`` / ``module.lora_B`` keys."""
    _check_known(model, name)
    state: dict[str, torch.Tensor] = {}
    for module_name, layer in lora_layers(model):
        if name in layer.lora_A:
            state[f"{module_name}.lora_A"] = layer.lora_A[name].detach()
            state[f"{module_name}.lora_B"] = layer.lora_B[name].detach()
    return state


# ---------------------------------------------------------------------------------------
# Shared by every method: freezing and counting.
# ---------------------------------------------------------------------------------------

def freeze_base(model: nn.Module) -> None:
    """Stop gradients for every parameter; each method then switches its own ones back on."""
    for param in model.parameters():
        param.requires_grad_(False)


def count_parameters(model: nn.Module) -> tuple[int, int]:
    """(trainable, all), each shared parameter (a tied embedding) counted once."""
    params = list(model.parameters())  # parameters() already yields a shared tensor once
    return sum(p.numel() for p in params if p.requires_grad), sum(p.numel() for p in params)


def trainable_parameters_report(model: nn.Module) -> str:
    """The line PEFT's ``print_trainable_parameters`` prints."""
    trainable, total = count_parameters(model)
    return (f"trainable params: {trainable:,d} || all params: {total:,d} || "
            f"trainable%: {100 * trainable / max(total, 1):.4f}")
