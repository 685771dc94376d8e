"""One place that checks what lucidlm reads before anything is built from it.

Every file lucidlm reads (a model's ``config.json`` or GGUF metadata, ``tokenizer_config.json``,
adapter configs, checkpoints and trainer state, data meta) and every size it is about to
allocate goes through these helpers, so a bad value is refused with one line that names the
file, the field, the value and the fix, and before memory is allocated or a file written.

    fields = Fields(read_json_object(path, ConfigError), source=path, error=ConfigError)
    n_layers = fields.int("num_hidden_layers", low=1, high=MAX_LAYERS)
    theta = fields.float("rope_theta", default=10000.0, low=0.0, low_open=True)

It imports nothing from lucidlm but its errors, so every layer can use it. Import from here:
reading JSON and ``Fields`` live in ``validation_json.py``, ``check_allocation`` and the memory
limits in ``validation_memory.py``, and this module re-exports them beside the shared bounds
and the checks of plain arguments (``check_int``, ``check_float``, ``check_seed``).
"""

from __future__ import annotations

import math
import numbers
import re
from typing import Any, Optional, Type

from lucidlm.errors import LucidLMError
from lucidlm.validation_json import Fields, read_json, read_json_object, refuse_newer_format, show_value  # noqa: F401  (re-exported)
from lucidlm.validation_memory import (  # noqa: F401  (re-exported: this module was their home)
    address_space_left, check_allocation, physical_memory)

_SURROGATE = re.compile("[\ud800-\udfff]")

# Sane upper bounds: far beyond any real model, far below what would hang or exhaust memory.
MAX_LAYERS = 4096
MAX_WIDTH = 1 << 20          # d_model, ffn width, heads * head_dim
MAX_HEADS = 1 << 14
MAX_VOCAB = 1 << 24
MAX_CONTEXT = 1 << 24        # positions (rotary tables and KV caches are sized from this)
MAX_SEED = 2 ** 64 - 1   # torch.manual_seed / torch.Generator.manual_seed take 0 .. 2**64 - 1


def check_int(value: Any, name: str, error: Type[LucidLMError], low: Optional[int] = None,
              high: Optional[int] = None, fix: str = "") -> int:
    """``value`` as an int, or ``error`` naming ``name`` (an argument or ``--flag``), the value
    and what is accepted. Refuses bools, floats (even 2.0) and strings: an argument is not a
    JSON field, and silently truncating 2.5 would hide a mistake."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        _refuse(name, value, "a whole number" + _bounds(low, high, ""), error, fix)
    value = int(value)
    if (low is not None and value < low) or (high is not None and value > high):
        _refuse(name, value, "a whole number" + _bounds(low, high, ""), error, fix)
    return value


def check_float(value: Any, name: str, error: Type[LucidLMError], low: Optional[float] = None,
                high: Optional[float] = None, low_open: bool = False, high_open: bool = False,
                fix: str = "") -> float:
    """``value`` as a finite float in [low, high] (open ends with ``low_open``/``high_open``), or
    ``error`` naming ``name``, the value and the accepted range. NaN and infinities are refused."""
    wanted = "a finite number" + _bounds(low, high, ">" if low_open else "", "<" if high_open else "")
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        _refuse(name, value, wanted, error, fix)
    value = float(value)
    if (low is not None and (value <= low if low_open else value < low)) or \
            (high is not None and (value >= high if high_open else value > high)):
        _refuse(name, value, wanted, error, fix)
    return value


def check_seed(value: Any, name: str, error: Type[LucidLMError]) -> int:
    """A random seed torch accepts (0 .. 2**64 - 1), or ``error`` naming it."""
    return check_int(value, name, error, low=0, high=MAX_SEED, fix="torch takes seeds from 0 to 2**64 - 1")


def first_surrogate(text: str) -> Optional[int]:
    """The index of the first lone surrogate (U+D800..U+DFFF) in ``text``, or None. Python
    makes them from bytes that were not UTF-8 (``surrogateescape``: argv, file names); no
    tokenizer can encode them, and they cannot be written out as UTF-8."""
    if text.isascii():
        return None
    match = _SURROGATE.search(text)
    return match.start() if match else None


def printable(text: str) -> str:
    """``text`` with any lone surrogate written as its escape (``\\udce9``): what a message that
    quotes argv or a file name must be before it goes to a strict UTF-8 stream."""
    return text if first_surrogate(text) is None else text.encode("utf-8", "backslashreplace").decode("utf-8")


def _bounds(low: Any, high: Any, low_op: str = "", high_op: str = "") -> str:
    if low is not None and high is not None:
        return f" in {'(' if low_op else '['}{low}, {high}{')' if high_op else ']'}"
    if low is not None:
        return f" {low_op or '>='} {low}"
    return f" {high_op or '<='} {high}" if high is not None else ""


def _refuse(name: str, value: Any, wanted: str, error: Type[LucidLMError], fix: str) -> None:
    tail = f"; {fix}" if fix else ""
    raise error(f"{name}={show_value(value)} is invalid: expected {wanted}{tail}.")
