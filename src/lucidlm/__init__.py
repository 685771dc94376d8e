"""lucidlm: a glass-box toolkit for decoder-only transformer language models.

The names below are imported on first use (PEP 562), so ``import lucidlm`` and the
``lucidlm --help`` command start without importing torch.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_LAZY = {  # public name -> module that defines it
    "load": "lucidlm.loading",
    "Transformer": "lucidlm.model",
    "LanguageModel": "lucidlm.language_model",
    "ModelConfig": "lucidlm.config",
    "PRESETS": "lucidlm.config",
    "preset": "lucidlm.config",
    "quantize": "lucidlm.quantization",
    "perplexity": "lucidlm.evaluation",
    "LucidLMError": "lucidlm.errors",
}
__all__ = [*_LAZY, "__version__"]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'lucidlm' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
