"""The request fields /v1/completions and /v1/chat/completions share, checked before the
request waits for the model: types and ranges here, the sampling values by generate's own
rules (``check_options``), a field no endpoint knows with the closest known one, and a field
OpenAI has that lucidlm serve cannot honour refused by name, with the reason.
"""

from __future__ import annotations

import json
import re
from functools import partial
from typing import Any, Iterable, Optional

from lucidlm.errors import GenerationError
from lucidlm.serving.api_errors import RequestError, as_request_error
from lucidlm.suggest import did_you_mean
from lucidlm.validation import check_int, check_seed

# request field -> generate's option; generate checks the values (llama.cpp's and vLLM's names last)
SAMPLING_FIELDS = {"temperature": "temperature", "top_p": "top_p", "presence_penalty": "presence_penalty",
                   "frequency_penalty": "frequency_penalty", "stop": "stop", "top_k": "top_k", "min_p": "min_p",
                   "repeat_penalty": "repetition_penalty", "repetition_penalty": "repetition_penalty"}
COMMON_FIELDS = ("model", "n", "stream", "stream_options", "seed", "logit_bias", "cache_prompt", *SAMPLING_FIELDS)
# OpenAI's bookkeeping (its logs, storage, tiers, caching keys): nothing in the answer depends on them
IGNORED_FIELDS = ("user", "metadata", "store", "service_tier", "safety_identifier", "prompt_cache_key")
MAX_N = 128  # OpenAI's bound on n
MAX_STOP = 4  # OpenAI's bound on stop strings

_TOOLS = "tool calling is not supported: lucidlm serve answers in plain text"
# field: (the values that ask for nothing beyond plain text, why any other value is refused)
NOT_SUPPORTED: dict[str, tuple[tuple[Any, ...], str]] = {
    "suffix": ((), "lucidlm serve continues a prompt, it does not fill in text before a suffix"),
    "best_of": ((1,), "it would rank best_of samples by likelihood on the server; ask for n choices instead"),
    "tools": (([],), _TOOLS), "tool_choice": (("none",), _TOOLS), "functions": (([],), _TOOLS),
    "function_call": (("none",), _TOOLS), "parallel_tool_calls": ((True, False), _TOOLS),
    "response_format": (({"type": "text"},), 'JSON mode and structured outputs are not supported (the model writes '
                                              'free text); leave response_format out or give {"type": "text"}'),
    "audio": ((), "audio output is not supported: the model writes text"),
    "modalities": ((["text"],), "the model writes text only"),
    "prediction": ((), "predicted outputs are not supported"),
    "reasoning_effort": ((), "it is a setting of OpenAI's reasoning models, which this is not"),
    "verbosity": ((), "it is a setting of OpenAI's reasoning models, which this is not"),
    "web_search_options": ((), "web search is not supported"),
}


def shown(value: Any) -> str:
    """A JSON value as the client wrote it, cut short."""
    text = json.dumps(value)
    return text if len(text) <= 60 else text[:57] + "..."


def given_fields(body: dict[str, Any], known: Iterable[str], endpoint: str) -> dict[str, Any]:
    """The body's fields that are not null (clients send null for "not given"). A field the
    endpoint does not know is refused with the closest known one; one OpenAI has that asks for
    what lucidlm serve cannot do (tools, JSON mode) with the reason."""
    known = tuple(known)
    fields = {name: value for name, value in body.items() if value is not None}
    for name, value in fields.items():
        if name not in known and name not in IGNORED_FIELDS:
            supported = sorted(set(known) - set(NOT_SUPPORTED))
            raise RequestError(f"unknown field {name!r} for {endpoint}; its fields are {', '.join(supported)}"
                               f"{did_you_mean(name, known) or '.'}", param=name)
        if name in NOT_SUPPORTED:
            asks_nothing, why = NOT_SUPPORTED[name]
            if not any(type(value) is type(ok) and value == ok for ok in asks_nothing):  # True is no 1 here
                raise RequestError(f"{name}={shown(value)} is not supported: {why}.", param=name)
    return fields


def whole_number(fields: dict[str, Any], name: str, default: Optional[int], low: int,
                 high: Optional[int] = None, fix: str = "") -> Optional[int]:
    if name not in fields:
        return default
    return check_int(fields[name], name, partial(RequestError, param=name), low=low, high=high, fix=fix)


def flag(fields: dict[str, Any], name: str, label: Optional[str] = None, note: str = "") -> bool:
    """A true/false field (false when absent); ``label`` names it in the message (a nested field),
    ``note`` adds to it (`` (the number of alternatives is top_logprobs)``)."""
    value = fields.get(name, False)
    if not isinstance(value, bool):
        raise RequestError(f"{label or name}={shown(value)} is invalid: expected true or false{note}.",
                           param=label or name)
    return value


def stream_flags(fields: dict[str, Any]) -> tuple[bool, bool]:
    """(stream, stream_options.include_usage)."""
    stream = flag(fields, "stream")
    options = fields.get("stream_options")
    if options is None:
        return stream, False
    if not stream:
        raise RequestError("stream_options is only for streamed answers; add \"stream\": true or drop stream_options.",
                           param="stream_options")
    if not isinstance(options, dict):
        raise RequestError(f"stream_options={shown(options)} is invalid: expected an object such as "
                           f'{{"include_usage": true}}.', param="stream_options")
    for key in options:
        if key not in ("include_usage", "include_obfuscation"):  # no obfuscation is sent: nothing to turn off
            raise RequestError(f"unknown field stream_options.{key}{did_you_mean(key, ['include_usage']) or ''}; "
                               f"stream_options takes include_usage.", param="stream_options")
    flag(options, "include_obfuscation", "stream_options.include_obfuscation")
    return stream, flag(options, "include_usage", "stream_options.include_usage")


def sampling_options(fields: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """The fields that are generate's options, under generate's names, and the names map back
    (``{"repetition_penalty": "repeat_penalty"}``) for messages. ``seed`` is left out: each
    choice gets its own (``choice_seed``)."""
    options: dict[str, Any] = {}
    names: dict[str, str] = {}
    for field, option in SAMPLING_FIELDS.items():
        if field not in fields:
            continue
        if option in options:
            raise RequestError(f"{names[option]} and {field} are the same setting; give one of them.", param=field)
        options[option], names[option] = fields[field], field
    stops = options.get("stop")
    if isinstance(stops, list) and len(stops) > MAX_STOP:
        raise RequestError(f"stop has {len(stops)} strings; OpenAI's API takes at most {MAX_STOP}.", param="stop")
    if "logit_bias" in fields:
        options["logit_bias"], names["logit_bias"] = token_biases(fields["logit_bias"]), "logit_bias"
    if "seed" in fields:
        check_seed(fields["seed"], "seed", partial(RequestError, param="seed"))
    if "cache_prompt" in fields:  # llama.cpp's server's name for generate's reuse_cache
        options["reuse_cache"], names["reuse_cache"] = flag(fields, "cache_prompt"), "cache_prompt"
    try:
        check_options(options)
    except GenerationError as exc:
        raise as_request_error(exc, names) from None
    return options, names


def check_options(options: dict[str, Any]) -> None:
    """generate's own checks, which need no model (token ids against the vocabulary come later)."""
    from lucidlm.generation import check_options as generation_checks

    generation_checks(**options)


def token_biases(value: Any) -> dict[int, float]:
    """OpenAI's logit_bias, ``{"13": -100}`` (token ids as JSON keys, which are strings), as
    generate's ``{13: -100.0}``; biases in OpenAI's range, -100 (bans the token) to 100."""
    if not isinstance(value, dict):
        raise RequestError(f'logit_bias={shown(value)} is invalid: expected an object of token ids to biases, e.g. '
                           f'{{"13": -100}}.', param="logit_bias")
    biases = {}
    for key, bias in value.items():
        if not re.fullmatch(r"[0-9]{1,18}", key):
            raise RequestError(f"logit_bias key {shown(key)} is not a token id: use the id as a string of digits, "
                               f'e.g. {{"13": -100}}.', param="logit_bias")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not -100 <= bias <= 100:  # NaN too
            raise RequestError(f"logit_bias[{key}]={shown(bias)} is invalid: expected a number in [-100, 100], "
                               f"OpenAI's range (-100 bans the token, 100 all but forces it).", param="logit_bias")
        biases[int(key)] = float(bias)
    return biases


def choice_seed(seed: Optional[int], choice: int) -> Optional[int]:
    """The seed of the ``choice``-th sample of a prompt: seed, seed + 1, ... so choice 0 is what
    ``generate(seed=seed)`` gives and every choice is reproducible on its own (None: fresh entropy)."""
    return None if seed is None else (seed + choice) % 2 ** 64
