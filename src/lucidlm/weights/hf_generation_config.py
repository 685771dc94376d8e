"""What a Hugging Face model directory says about generation besides its weights and tokenizer:
``generation_config.json`` (and ``config.json``'s ``eos_token_id``), read the way transformers
reads them, every field checked (one line naming the file and the field when one is wrong).

- End tokens: transformers' ``generate`` stops on every id of ``generation_config.eos_token_id``
  (an int or a list: Llama-3-Instruct lists ``<|end_of_text|>`` and ``<|eot_id|>``), whatever
  the tokenizer's own ``eos_token`` is. ``eos_token_ids`` reads them from
  ``generation_config.json``, else ``config.json``; ``use_generation_eos_ids`` makes them the
  tokenizer's ``eos_ids`` and the model's ``eos_ids`` (for a directory without tokenizer.json);
  ``end_token_ids`` is what generation stops on and what an export writes. (transformers 5 does
  not look at config.json when a generation_config.json exists without an eos_token_id; lucidlm
  does, rather than never stop, and writes the ids into both files.)
- BOS and pad: a directory without tokenizer.json still declares them (config.json,
  generation_config.json); ``use_generation_eos_ids`` keeps them on the model and
  ``role_token_id`` gives them to an export, so transformers' ``generate()`` without a prompt
  starts from the same BOS.
- Sampling: ``sampling_settings`` gives transformers' decoding for the file: greedy unless it
  says ``"do_sample": true`` (its temperature, top-k, top-p, min-p, typical-p, epsilon and eta
  cutoffs then); a
  ``repetition_penalty``, ``no_repeat_ngram_size``, ``suppress_tokens``, ``bad_words_ids`` and
  ``sequence_bias`` apply either way. ``generation/defaults.py`` calls it.
"""

from __future__ import annotations

import json
import numbers
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Callable, Optional

from lucidlm.errors import ConfigError
from lucidlm.validation import Fields, read_json_object

GENERATION_CONFIG_NAME = "generation_config.json"
CONFIG_NAME = "config.json"
_FIX = "fix it, or replace it with the model's original {name}"
# The fields transformers' generate applies whether it samples or not (its logits processors,
# as opposed to its sampling warpers): read from a greedy file, and written for a greedy model.
# The last three are lucidlm's own (OpenAI's options, which transformers lacks and ignores in the
# file): a model saved with them in its generation_defaults keeps them.
ANY_DECODING = ("repetition_penalty", "no_repeat_ngram_size", "suppress_tokens", "bad_words_ids", "sequence_bias",
                "logit_bias", "presence_penalty", "frequency_penalty")


def read_generation_config(directory: str | Path) -> Optional[Fields]:
    """``generation_config.json`` of ``directory`` as checked ``Fields``, or None when there is none."""
    path = Path(directory) / GENERATION_CONFIG_NAME
    if not path.is_file():
        return None
    return read_json_object(path, ConfigError, "generation config", fix=_FIX.format(name=GENERATION_CONFIG_NAME))


def sampling_settings(config: Fields, token_option: Callable[[str, Any], Any]) -> dict[str, Any]:
    """The sampling defaults transformers' ``generate`` takes from this generation config:
    ``temperature=0`` (greedy) unless ``do_sample`` is true, then the file's temperature, top_k,
    top_p, min_p, typical_p, epsilon_cutoff and eta_cutoff; its repetition_penalty,
    no_repeat_ngram_size, suppress_tokens, bad_words_ids and sequence_bias in both cases (transformers
    applies its logits processors when greedy too), and lucidlm's own logit_bias, presence_penalty
    and frequency_penalty (``ANY_DECODING``). ``token_option(name, value)``: the sampler's own
    reading of an option that holds token ids (it raises ValueError on a bad one), handed in by
    the generation layer, which this one does not import."""
    found: dict[str, Any] = {}
    if config.has("repetition_penalty"):
        found["repetition_penalty"] = config.float("repetition_penalty", low=0.0, low_open=True)
    if config.has("no_repeat_ngram_size"):
        found["no_repeat_ngram_size"] = config.int("no_repeat_ngram_size", low=0)
    found.update(_token_options(config, ("suppress_tokens", "bad_words_ids", "sequence_bias", "logit_bias"),
                                token_option))
    for name in ("presence_penalty", "frequency_penalty"):
        if config.has(name):  # the sampler's bounds (float32 logits overflow beyond)
            found[name] = config.float(name, low=-1e30, high=1e30)
    if not config.bool("do_sample", default=False):
        return {"temperature": 0.0, **found}
    if config.has("temperature"):
        found["temperature"] = config.float("temperature", low=0.0)
    if config.has("top_k"):
        found["top_k"] = config.int("top_k", low=0)
    if config.has("top_p"):
        found["top_p"] = config.float("top_p", low=0.0, high=1.0, low_open=True)
    if config.has("min_p"):
        found["min_p"] = config.float("min_p", low=0.0, high=1.0)
    if config.has("typical_p"):
        found["typical_p"] = config.float("typical_p", low=0.0, high=1.0, low_open=True)
    for name in ("epsilon_cutoff", "eta_cutoff"):
        if config.has(name):
            found[name] = config.float(name, low=0.0, high=1.0, high_open=True)
    return found


def _token_options(config: Fields, names: tuple[str, ...], token_option: Callable[[str, Any], Any]) -> dict[str, Any]:
    """The fields ``names`` that hold token ids, checked as the sampler checks them (the ids
    against the vocabulary when a generation starts), a wrong one named with the file."""
    found: dict[str, Any] = {}
    for name in names:
        if config.has(name):
            try:
                found[name] = token_option(name, config.raw(name))
            except ValueError as exc:  # GenerationError is one
                config.fail(f"field {name!r}: {exc}")
    return found


def eos_token_ids(directory: str | Path, vocab_size: int, strict: bool = True) -> Optional[list[int]]:
    """The ids generation stops on: ``eos_token_id`` (an int or a list of ints, each a token id
    below ``vocab_size``) of ``generation_config.json``, else of ``config.json``; None when
    neither names one. ``strict=False`` drops ids outside the vocabulary instead of refusing the
    file: the model can never produce them (transformers' GPT2Config writes 50256 whatever the
    vocabulary size, so a small random GPT-2 carries one)."""
    return _declared_ids(directory, "eos_token_id", vocab_size, strict) or None


def _declared_ids(directory: str | Path, key: str, vocab_size: int, strict: bool) -> list[int]:
    """Field ``key`` (an id or a list of ids) of ``generation_config.json``, else of ``config.json``,
    as token ids (``_token_ids``); [] when neither names any."""
    directory = Path(directory)
    generation = read_generation_config(directory)
    sources = [generation] if generation is not None else []
    if (directory / CONFIG_NAME).is_file():
        sources.append(read_json_object(directory / CONFIG_NAME, ConfigError, "model config",
                                        fix=_FIX.format(name=CONFIG_NAME)))
    for fields in sources:
        if fields.has(key):
            ids = _token_ids(fields, key, vocab_size, strict)
            if ids:
                return ids
    return []


def use_generation_eos_ids(model: Any, directory: str | Path) -> None:
    """Give ``model`` the directory's end tokens (``eos_token_ids``): its tokenizer's ``eos_ids``
    when it names any (the tokenizer's bos/eos roles are left as its own files set them), and
    ``model.eos_ids``, which generation falls back on when there is no tokenizer (a directory
    without tokenizer.json still declares where the model stops, as transformers reads it).
    Without a tokenizer the directory's bos and pad ids are kept too (``model.bos_id``,
    ``model.pad_id``), so that an export writes them back (``role_token_id``)."""
    # Out-of-vocabulary ids are a damaged file beside a tokenizer, a config default without one.
    ids = eos_token_ids(directory, model.config.vocab_size, strict=model.tokenizer is not None) or []
    model.eos_ids = ids
    if model.tokenizer is not None and ids:
        model.tokenizer.eos_ids = ids
    if model.tokenizer is None:
        for role in _ROLES:
            try:
                found = _declared_ids(directory, f"{role}_token_id", model.config.vocab_size, strict=False)
            except ConfigError:  # not an id: lucidlm never uses these, so it is not kept rather than refused
                found = []
            setattr(model, f"{role}_id", found[0] if found else None)


_ROLES = ("bos", "pad")  # the ids besides eos that config.json and generation_config.json declare


def role_token_id(model: Any, role: str) -> Optional[int]:
    """The model's ``"bos"`` or ``"pad"`` id: its tokenizer's, or for a model without one the id
    its directory declared (``use_generation_eos_ids``); None when none is known."""
    tokenizer = getattr(model, "tokenizer", None)
    value = getattr(tokenizer if tokenizer is not None else model, f"{role}_id", None)
    return None if value is None else int(value)


def end_token_ids(model: Any) -> list[int]:
    """The ids generation stops on: the tokenizer's ``eos_ids`` (the end tokens a GGUF or Hugging
    Face directory declares), else its ``eos_id``, else the model's own ``eos_ids`` (set when
    loading a Hugging Face directory without tokenizer.json); ``[]`` when none is known."""
    tokenizer = getattr(model, "tokenizer", None)
    if tokenizer is not None:
        ids = getattr(tokenizer, "eos_ids", None)  # tokenizers with several end tokens may list them all
        if ids:
            return [int(i) for i in ids]
        eos = getattr(tokenizer, "eos_id", None)
        if eos is not None:
            return [int(eos)]
    return [int(i) for i in (getattr(model, "eos_ids", None) or [])]


def hf_eos_token_id(ids: list[int]) -> int | list[int] | None:
    """``eos_token_id`` as transformers writes it: one id as an int, several as a list, none as None."""
    return None if not ids else ids[0] if len(ids) == 1 else list(ids)


def write_generation_config(directory: str | Path, model: Any) -> None:
    """Write ``generation_config.json`` for ``model`` when it has something to say: its
    sampling defaults (``model.generation_defaults``: the embedded SmolLM2's temperature 0.2
    and top-p 0.5), as transformers writes them (``do_sample`` true unless greedy), or several
    end tokens. A file that is written always names the end tokens (``end_token_ids``) and the
    bos and pad ids: once a generation_config.json exists, transformers 5 takes none of them from
    config.json, and would never stop. ``sampling_settings`` and ``eos_token_ids`` read them back, for lucidlm's
    own directories and Hugging Face ones alike, so a converted or merged model samples and
    stops as the model it came from. An old file is removed when there is nothing to say (a
    single end token then lives in config.json alone, which transformers reads without the file;
    lucidlm then keeps its own sampling fallback, as for the model it came from)."""
    from lucidlm.staging import atomic_write_text

    path = Path(directory) / GENERATION_CONFIG_NAME
    defaults = dict(getattr(model, "generation_defaults", None) or {})
    eos_ids = end_token_ids(model)
    config: dict[str, Any] = {}
    if defaults:
        greedy = defaults.get("temperature") == 0
        config["do_sample"] = not greedy
        config.update({k: _as_json(v) for k, v in defaults.items() if not greedy or k in ANY_DECODING})
    tokenizer = getattr(model, "tokenizer", None)
    if eos_ids and (config or len(eos_ids) > 1 or tokenizer is None):
        config["eos_token_id"] = hf_eos_token_id(eos_ids)
    # transformers 5 reads no bos/pad id from config.json once this file exists (generate() without
    # a prompt then has no BOS to start from), so a file that is written names them too; without a
    # tokenizer (whose own file keeps them) it is also where a lucidlm save keeps them.
    if config or tokenizer is None:
        config.update({f"{role}_token_id": role_token_id(model, role) for role in _ROLES
                       if role_token_id(model, role) is not None})
    if not config:
        path.unlink(missing_ok=True)
        return
    atomic_write_text(path, json.dumps(config, indent=2) + "\n")


def _as_json(value: Any) -> Any:
    """A sampling default as JSON can write it, in the forms the options take and transformers
    reads: generate() also takes a set, a range, a tensor or NumPy numbers of ids, and
    sequence_bias as {(ids): bias}, which json.dumps refused after the weights were written
    (a save without its generation_config.json); the tuple-keyed dict becomes transformers'
    [[ids, bias], ...]."""
    if hasattr(value, "tolist") and not isinstance(value, (bool, int, float)):  # a tensor, an array, a NumPy number
        value = value.tolist()
    if isinstance(value, Mapping):
        if any(isinstance(key, (tuple, list)) for key in value):
            return [[_as_json(key), _as_json(bias)] for key, bias in value.items()]
        return {key if isinstance(key, str) else _as_json(key): _as_json(bias) for key, bias in value.items()}
    if isinstance(value, (set, frozenset)):
        return sorted(_as_json(v) for v in value)
    if isinstance(value, (list, tuple, range)):
        return [_as_json(v) for v in value]
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        return int(value)
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        return float(value)
    return value


def _token_ids(fields: Fields, key: str, vocab_size: int, strict: bool = True) -> list[int]:
    """The field as a list of distinct token ids (an int is a list of one), each in the vocabulary
    (``strict``) or those of them that are."""
    value = fields.raw(key)
    if isinstance(value, list):
        values = fields.list(key, item=int)
        names = [f"{key}[{i}]" for i in range(len(values))]
    else:
        values = [fields.int(key)]
        names = [key]
    ids: list[int] = []
    for name, token_id in zip(names, values):
        if not 0 <= token_id < vocab_size:
            if not strict:
                continue
            fields.fail(f"field {name!r} is {token_id}, outside the model's vocabulary of {vocab_size} tokens "
                        f"(ids 0 to {vocab_size - 1})")
        if token_id not in ids:
            ids.append(int(token_id))
    return ids


__all__ = ["GENERATION_CONFIG_NAME", "end_token_ids", "eos_token_ids", "hf_eos_token_id", "read_generation_config",
           "role_token_id", "sampling_settings", "use_generation_eos_ids", "write_generation_config"]
