"""Freezing and counting parameters: shared by every fine-tuning method (LoRA, adapters, prefix).

Each method first freezes the whole base model with ``freeze_base`` and then switches its own
new parameters back on; ``count_parameters`` / ``trainable_parameters_report`` say how many are
trained (the line PEFT's ``print_trainable_parameters`` prints). ``attached_methods`` /
``check_one_method`` say which methods a model carries and refuse a second one beside it.
"""

from __future__ import annotations

from torch import nn

from lucidlm.errors import AdapterError

METHODS = ("lora", "adapter", "prefix")  # each method's module class says which it is: ``peft_method``
_WHAT = {"lora": "a LoRA adapter", "adapter": "bottleneck adapters", "prefix": "a prefix"}
_HOW_TO_REMOVE = {  # each a sentence: how to get from "model with this method" to a plain model
    "lora": "Merge the LoRA into the weights first (merge_and_unload(model); lucidlm merge for a saved adapter) or "
            "drop it (unload_lora(model))",
    "adapter": "Bottleneck adapters cannot be merged into the weights: save them (save_adapter) and start from a "
               "fresh base model",
    "prefix": "A prefix cannot be merged into the weights: save it (save_adapter) and start from a fresh base model",
}


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


def attached_methods(model: nn.Module) -> list[str]:
    """The fine-tuning methods attached to ``model`` ("lora", "adapter", "prefix"), in that order."""
    found = {getattr(module, "peft_method", None) for module in model.modules()}
    return [method for method in METHODS if method in found]


def check_one_method(model: nn.Module, adding: str) -> None:
    """Refuse to attach ``adding`` beside another method: the new one would freeze the other
    (``freeze_base``), wrap or replace its layers, and ``save_adapter`` writes one method only."""
    others = [method for method in attached_methods(model) if method != adding]
    if others:
        raise AdapterError(f"the model already has {_WHAT[others[0]]}, so {_WHAT[adding]} cannot be added: lucidlm "
                           f"attaches one fine-tuning method at a time. {_HOW_TO_REMOVE[others[0]]}.")


def unmergeable_note(model: nn.Module) -> str:
    """For ``merge_adapter`` on a model without a LoRA: what it carries instead and why that cannot
    be merged (" It has bottleneck adapters. ..."), or "" when it carries no other method."""
    others = [method for method in attached_methods(model) if method != "lora"]
    return f" It has {_WHAT[others[0]]}. {_HOW_TO_REMOVE[others[0]]}." if others else ""
