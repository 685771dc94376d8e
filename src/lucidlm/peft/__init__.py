"""Parameter-efficient fine-tuning: train a few new numbers, keep the base model frozen.

- ``lora.py``      LoRA: low-rank updates W + (alpha/r) B A, several named adapters, merge/unmerge
  (the layer is ``lora_linear.py``, choosing layers ``lora_targets.py``)
- ``adapters.py``  Houlsby bottleneck adapters after attention and MLP outputs
- ``prefix.py``    prefix tuning: trained keys/values every attention layer can see
- ``trainable.py`` freezing the base and counting trainable parameters (every method)
- ``files.py``     save/load adapters (LoRA in Hugging Face PEFT's format, see ``peft_format.py``)

    model = lucidlm.load(dtype="float32")  # float weights: the default keeps quantized layers
    add_lora(model, r=8, alpha=16, targets=("q_proj", "v_proj"))
    ... train ...
    save_adapter(model, "out/")            # PeftModel.from_pretrained(hf_model, "out/") reads it
    lucidlm.load(adapter="out/")           # and so does lucidlm
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

from torch import nn

from lucidlm.peft.adapters import (BottleneckAdapter, adapted_layers, add_adapters, adapter_parameter_count,  # noqa: F401
                                   set_adapters_disabled)
from lucidlm.peft.files import load_adapter, method_of, save_adapter
from lucidlm.peft.lora import (LoRALinear, adapter_names, add_lora, count_parameters, freeze_base, lora_layers,
                               match_targets, merge_adapter, merge_and_unload, set_adapter,
                               trainable_parameters_report, unload_lora, unmerge_adapter)
from lucidlm.peft.prefix import (PrefixEncoder, add_prefix, freeze_prefix, prefix_encoder,  # noqa: F401
                                 prefix_parameter_count, set_prefix_disabled)


@contextmanager
def disable_adapters(model: nn.Module) -> Iterator[nn.Module]:
    """Run the base model inside the block (for a base-vs-tuned comparison): LoRA, adapters
    and prefixes are switched off, a merged LoRA is taken out, and after the block each is as
    it was before it (so blocks nest, and a part switched off beforehand stays off). Norms
    trained by ``add_adapters(train_norms=True)`` are the model's own weights: they stay."""
    lora = [layer for _, layer in lora_layers(model)]
    merged = any(layer.merged_adapter for layer in lora)
    if merged:
        unmerge_adapter(model)
    switches = [layer for _, layer in adapted_layers(model)] + lora  # each has a `disabled` flag
    encoder = prefix_encoder(model)
    if encoder is not None:
        switches.append(encoder)
    previous = [part.disabled for part in switches]
    for part in switches:
        part.disabled = True
    try:
        yield model
    finally:
        for part, was in zip(switches, previous):
            part.disabled = was
        if merged:
            merge_adapter(model)


__all__ = [
    "LoRALinear", "add_lora", "set_adapter", "merge_adapter", "unmerge_adapter", "merge_and_unload", "unload_lora",
    "adapter_names", "lora_layers", "match_targets", "freeze_base", "count_parameters", "trainable_parameters_report",
    "BottleneckAdapter", "add_adapters", "adapter_parameter_count",
    "PrefixEncoder", "add_prefix", "freeze_prefix", "prefix_parameter_count",
    "save_adapter", "load_adapter", "method_of", "disable_adapters",
]
