"""Sampling defaults that come from the model, the same for ``generate()`` and the CLI.

A sampling option left at ``None`` takes the model's own value, found (first match wins) in

1. the model file: GGUF ``general.sampling.*`` keys (llama.cpp's), or a Hugging Face
   ``generation_config.json`` beside the weights, read as transformers' ``generate`` reads it:
   greedy (temperature 0) unless it says ``"do_sample": true``, then its temperature, top_k,
   top_p, min_p, typical_p, epsilon_cutoff and eta_cutoff, and only those (transformers adds
   its own top-k 50 when the file names no top_k; lucidlm does not); a ``temperature``
   without ``do_sample`` is ignored, as transformers ignores it; its repetition_penalty,
   no_repeat_ngram_size, suppress_tokens, bad_words_ids and
   sequence_bias apply either way, and so do lucidlm's own logit_bias, presence_penalty and
   frequency_penalty, which a saved model writes there (``weights/hf_generation_config.py``);
2. the table below, for models whose files carry none (a GGUF without sampling keys, a
   pretrained name, a directory without generation_config.json);
3. ``FALLBACK``: plain sampling from the model's distribution (temperature 1), as
   TransformerLens's ``generate`` does (transformers with no generation_config.json would be
   greedy; llama.cpp's CLI samples at temperature 0.8 with top-k 40, top-p 0.95, min-p 0.05).

An explicit value always wins, key by key (``temperature=0.7`` keeps the model's top_p);
``top_p=1``, ``top_k=0``, ``min_p=0``, ``typical_p=1``, ``epsilon_cutoff=0``, ``eta_cutoff=0``
switch a model default off. ``model.generation_defaults`` (a dict, set by ``lucidlm.load``)
shows what applies; assign to it to change it for a session.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

SAMPLING_KEYS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "typical_p", "epsilon_cutoff",
                 "eta_cutoff", "no_repeat_ngram_size", "suppress_tokens", "bad_words_ids",
                 "sequence_bias", "logit_bias", "presence_penalty", "frequency_penalty")
FALLBACK: dict[str, Any] = {"temperature": 1.0}

# Per-model defaults, by lucidlm's pretrained name, the model's own name (GGUF general.name) or
# a GGUF file's name without its quantization suffix, lower-cased. Why each value:
# - SmolLM2-135M-Instruct: its model card samples with temperature 0.2 and top-p 0.9. The
#   4-bit Q4_1 file lucidlm embeds is less sure of itself: for the README's "What is the
#   capital of France?" it gives 14% to French openings ("L'", "La") that ramble, so top-p 0.9
#   answers Paris in 15 of 20 seeds. top-p 0.5 keeps only the tokens that make up half of the
#   sharpened distribution: the same answers where the model is sure, and 20 of 20 seeds name
#   Paris (tests/generation/test_sampling_defaults.py).
# - Gemma 3: Google's generation_config.json for the instruction-tuned models
#   (temperature 1, top-k 64, top-p 0.95).
MODEL_DEFAULTS: dict[str, dict[str, Any]] = {
    "smollm2-135m": {"temperature": 0.2, "top_p": 0.5},
    "smollm2 135m instruct": {"temperature": 0.2, "top_p": 0.5},
    "smollm2-135m-instruct": {"temperature": 0.2, "top_p": 0.5},  # the embedded file, loaded by its path
    "gemma3-270m": {"temperature": 1.0, "top_k": 64, "top_p": 0.95},
    "gemma 3 270m it": {"temperature": 1.0, "top_k": 64, "top_p": 0.95},
}

_GGUF_KEYS = {"general.sampling.temp": "temperature", "general.sampling.top_k": "top_k",
              "general.sampling.top_p": "top_p", "general.sampling.min_p": "min_p",
              "general.sampling.penalty_repeat": "repetition_penalty"}


def sampling_defaults_for(source: Any, name: Optional[str] = None) -> dict[str, Any]:
    """The model's sampling defaults: from its file, else the table, else ``{}``.

    source: what ``lucidlm.load`` was given (a pretrained name, a .gguf file, a directory);
    name: the model's own name when the loader knows it (GGUF ``general.name``)."""
    found: dict[str, Any] = {}
    keys = [str(source).lower(), (name or "").lower()]
    path = Path(str(source)).expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":
        found, name = _from_gguf(path)
        keys += [(name or "").lower(), path.name.split(".")[0].lower()]  # SmolLM2-135M-Instruct.Q4_1.gguf
    elif path.is_dir():
        found = _from_generation_config(path)
    if found:
        return found
    for key in keys:
        if key in MODEL_DEFAULTS:
            return dict(MODEL_DEFAULTS[key])
    return {}


def apply_sampling_defaults(model: Any, options: dict[str, Any]) -> dict[str, Any]:
    """``options`` with every sampling option left at None filled from the model, then FALLBACK."""
    model_defaults = getattr(model, "generation_defaults", None) or {}
    filled = dict(options)
    for key in SAMPLING_KEYS:
        if filled.get(key) is None:
            value = model_defaults.get(key, FALLBACK.get(key))
            if value is not None:
                filled[key] = value
    return filled


def _from_gguf(path: Path) -> tuple[dict[str, Any], Optional[str]]:
    try:
        # lucidlm's own header reader: the loader has just parsed this header, so it comes from
        # the in-process cache (~2 ms), where gguf.GGUFReader took 4.6 s on SmolLM2's file
        from lucidlm.weights.gguf_reader import GGUFFile

        metadata = GGUFFile(path).metadata
        fields = {key: metadata[key] for key in (*_GGUF_KEYS, "general.name") if key in metadata}
    except Exception:  # noqa: BLE001 - a file the loader rejects is reported by the loader, not here
        return {}, None
    name = fields.get("general.name")
    return _checked_gguf_sampling(fields, path), name if isinstance(name, str) else None


def _checked_gguf_sampling(fields: dict[str, Any], path: Path) -> dict[str, Any]:
    """The file's general.sampling.* values, each checked at load (with the bounds the sampler
    takes) so that a bad one is refused naming the file and the key, not by a later generate()
    call naming a value its caller never passed."""
    from lucidlm.errors import GGUFError
    from lucidlm.validation import Fields

    checked = Fields(fields, path, GGUFError, fix="remove or correct that key (gguf's gguf_set_metadata.py or "
                                                  "gguf_new_metadata.py scripts) or convert the model again")
    bounds: dict[str, dict[str, Any]] = {
        "temperature": dict(low=0.0), "top_p": dict(low=0.0, high=1.0, low_open=True),
        "min_p": dict(low=0.0, high=1.0), "repetition_penalty": dict(low=0.0, low_open=True)}
    found: dict[str, Any] = {}
    for key, ours in _GGUF_KEYS.items():
        if key in fields:
            found[ours] = (checked.int(key, low=0) if ours == "top_k" else checked.float(key, **bounds[ours]))
    return found


def _from_generation_config(directory: Path) -> dict[str, Any]:
    """A Hugging Face generation_config.json's decoding, as transformers reads it (greedy unless
    do_sample is true); ``{}`` when the directory has none. A damaged file is a ConfigError
    naming it and the field: the same reader gives the loader the file's eos ids."""
    from lucidlm.weights.hf_generation_config import read_generation_config, sampling_settings

    config = read_generation_config(directory)
    return {} if config is None else sampling_settings(config, _token_option)


def _token_option(name: str, value: Any) -> Any:
    """A generation config's option that holds token ids, as the sampler reads and checks it."""
    from lucidlm.generation.sampling import SamplingSettings

    return getattr(SamplingSettings(**{name: value}), name)
