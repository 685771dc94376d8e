"""One place that checks what lucidlm reads before anything is built from it.

Every file lucidlm reads (a model's ``config.json`` or GGUF metadata, ``tokenizer_config.json``,
adapter configs, checkpoints and trainer state, data meta) and every size it is about to
allocate goes through these helpers, so a bad value is refused with one line that names the
file, the field, the value and the fix, and before memory is allocated or a file written.

    fields = Fields(read_json_object(path, ConfigError), source=path, error=ConfigError)
    n_layers = fields.int("num_hidden_layers", low=1, high=MAX_LAYERS)
    theta = fields.float("rope_theta", default=10000.0, low=0.0, low_open=True)

It imports nothing from lucidlm but its errors, so every layer can use it.
"""

from __future__ import annotations

import json
import math
import numbers
import os
import re
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence, Type, Union

from lucidlm.errors import LucidLMError

_MISSING = object()
_SURROGATE = re.compile("[\ud800-\udfff]")

# Sane upper bounds: far beyond any real model, far below what would hang or exhaust memory.
MAX_LAYERS = 4096
MAX_WIDTH = 1 << 20          # d_model, ffn width, heads * head_dim
MAX_HEADS = 1 << 14
MAX_VOCAB = 1 << 24
MAX_CONTEXT = 1 << 24        # positions (rotary tables and KV caches are sized from this)


class Fields:
    """Typed, range-checked access to one JSON object (or metadata mapping) read from ``source``.

    Each getter returns the value or raises ``error`` naming ``source``, the field, the
    value found and what would be accepted. ``where`` prefixes nested objects ("lora.alpha").
    """

    def __init__(self, data: Any, source: Union[str, Path], error: Type[LucidLMError], where: str = "",
                 fix: str = ""):
        self.source, self.error, self.where, self.fix = str(source), error, where, fix
        if not isinstance(data, Mapping):
            self._fail(f"expected a JSON object ({{...}}){' for ' + where if where else ''}, found "
                       f"{_kind(data)}")
        self.data = data

    # --- getters -------------------------------------------------------------------------
    def has(self, key: str) -> bool:
        return key in self.data and self.data[key] is not None

    def raw(self, key: str, default: Any = _MISSING) -> Any:
        if key not in self.data or self.data[key] is None:
            if default is _MISSING:
                self._fail(f"required field {self._name(key)!r} is missing")
            return default
        return self.data[key]

    def int(self, key: str, default: Any = _MISSING, low: Optional[int] = None,
            high: Optional[int] = None) -> int:
        value = self.raw(key, default)
        if value is default and default is not _MISSING:
            return value
        if isinstance(value, bool) or not isinstance(value, (int, float)) or \
                (isinstance(value, float) and not value.is_integer()):
            self._bad(key, value, "an integer")
        # 4e9 is named 4000000000, but 1e300 as written, not in 301 digits
        self._range(key, int(value) if abs(value) < 1e18 else value, low, high)
        return int(value)

    def float(self, key: str, default: Any = _MISSING, low: Optional[float] = None,
              high: Optional[float] = None, low_open: bool = False, high_open: bool = False) -> float:
        value = self.raw(key, default)
        if value is default and default is not _MISSING:
            return value
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            self._bad(key, value, "a finite number")
        value = float(value)
        if low_open and low is not None and value <= low:
            self._bad(key, value, f"a number > {low}" + (f" and < {high}" if high_open and high is not None else ""))
        if high_open and high is not None and value >= high:
            self._bad(key, value, f"a number < {high}" + (f" and >= {low}" if low is not None and not low_open else ""))
        self._range(key, value, None if low_open else low, None if high_open else high)
        return value

    def str(self, key: str, default: Any = _MISSING, choices: Optional[Sequence[str]] = None) -> str:
        value = self.raw(key, default)
        if value is default and default is not _MISSING:
            return value
        if not isinstance(value, str):
            self._bad(key, value, "a string")
        if choices is not None and value not in choices:
            self._bad(key, value, "one of " + ", ".join(map(repr, choices)))
        return value

    def bool(self, key: str, default: Any = _MISSING) -> bool:
        value = self.raw(key, default)
        if value is default and default is not _MISSING:
            return value
        if not isinstance(value, bool):
            self._bad(key, value, "true or false")
        return value

    def list(self, key: str, default: Any = _MISSING, item: Optional[type] = None) -> list:
        value = self.raw(key, default)
        if value is default and default is not _MISSING:
            return value
        # The distinct item types, gathered in C: a 49,152-token vocabulary list is checked in
        # a millisecond instead of a Python loop per item.
        kinds = set(map(type, value)) if isinstance(value, list) and item is not None else set()
        if not isinstance(value, list) or not all(_is_kind(k, item) for k in kinds):
            self._bad(key, value, f"a list{' of ' + item.__name__ + 's' if item else ''}")
        return value

    def object(self, key: str, default: Any = _MISSING) -> "Fields":
        value = self.raw(key, default)
        if value is default and default is not _MISSING:
            value = {} if value is None else value
        if not isinstance(value, Mapping):
            self._bad(key, value, "an object ({...})")
        return Fields(value, self.source, self.error, where=self._name(key), fix=self.fix)

    # --- failures ------------------------------------------------------------------------
    def fail(self, problem: str) -> None:
        """Refuse with ``problem`` (a consistency rule between fields), named like the getters'."""
        self._fail(problem)

    def _range(self, key: str, value: Union[int, float], low: Any, high: Any) -> None:
        if (low is not None and value < low) or (high is not None and value > high):
            bounds = (f"between {low} and {high}" if low is not None and high is not None
                      else f">= {low}" if low is not None else f"<= {high}")
            self._bad(key, value, f"a value {bounds}")

    def _bad(self, key: str, value: Any, wanted: str) -> None:
        self._fail(f"field {self._name(key)!r} is {_show(value)}; expected {wanted}")

    def _fail(self, problem: str) -> None:
        fix = self.fix or "fix or replace the file"
        raise self.error(f"{self.source}: {problem}. {fix[0].upper() + fix[1:]}.")

    def _name(self, key: str) -> str:
        return f"{self.where}.{key}" if self.where else key


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


def _bounds(low: Any, high: Any, low_op: str = "", high_op: str = "") -> str:
    if low is not None and high is not None:
        return f" in {'(' if low_op else '['}{low}, {high}{')' if high_op else ']'}"
    if low is not None:
        return f" {low_op or '>='} {low}"
    return f" {high_op or '<='} {high}" if high is not None else ""


def _refuse(name: str, value: Any, wanted: str, error: Type[LucidLMError], fix: str) -> None:
    tail = f"; {fix}" if fix else ""
    raise error(f"{name}={_show(value)} is invalid: expected {wanted}{tail}.")


def read_json(path: Union[str, Path], error: Type[LucidLMError], what: str = "JSON file",
              fix: str = "") -> Any:
    """The parsed JSON of ``path``, or ``error`` naming the file and whether it is missing,
    not UTF-8 or not valid JSON (with the line and column), never a raw decoder traceback."""
    path = Path(path)
    tail = f" {fix[0].upper() + fix[1:]}." if fix else ""
    try:
        text = path.read_bytes().decode("utf-8")
    except FileNotFoundError:
        raise error(f"{path}: {what} not found.{tail}") from None
    except IsADirectoryError:
        raise error(f"{path}: expected a {what}, found a directory.{tail}") from None
    except UnicodeDecodeError as exc:
        raise error(f"{path}: {what} is not UTF-8 text (byte {exc.start}).{tail}") from None
    except OSError as exc:
        raise error(f"{path}: cannot read the {what}: {exc.strerror or exc}.{tail}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise error(f"{path}: {what} is not valid JSON ({exc.msg} at line {exc.lineno}, column "
                    f"{exc.colno}); it may be truncated or damaged.{tail}") from None
    except RecursionError:
        raise error(f"{path}: {what} nests too deeply to be a real {what}.{tail}") from None


def read_json_object(path: Union[str, Path], error: Type[LucidLMError], what: str = "JSON file",
                     fix: str = "") -> Fields:
    """``read_json`` that must hold an object, returned as ``Fields`` for checked access."""
    return Fields(read_json(path, error, what, fix), source=path, error=error, fix=fix)


def check_allocation(n_bytes: Union[int, float], what: str, error: Type[LucidLMError], fix: str) -> None:
    """Refuse to allocate ``n_bytes`` for ``what`` when it exceeds this machine's memory (or
    what is left of this process's address-space limit, ``ulimit -v``), so an absurd size in a
    file or argument becomes one line instead of a multi-GB allocation."""
    total = physical_memory()
    if total and n_bytes > total:
        raise error(f"{what} would need {_human(n_bytes)}, more than this machine's "
                    f"{_human(total)} of memory. {fix[0].upper() + fix[1:]}.")
    left = address_space_left()
    if left is not None and n_bytes > left:
        raise error(f"{what} would need {_human(n_bytes)}, more than the {_human(left)} of address space this "
                    f"process may still use (ulimit -v). {fix[0].upper() + fix[1:]}.")


def address_space_left() -> Optional[int]:
    """Bytes this process may still map under its RLIMIT_AS, or None without a limit."""
    try:
        import resource

        limit = resource.getrlimit(resource.RLIMIT_AS)[0]
        if limit == resource.RLIM_INFINITY:
            return None
        with open("/proc/self/statm") as f:  # first field: pages of address space mapped now
            used = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    except (ImportError, OSError, ValueError, IndexError):
        return None
    return max(limit - used, 0)


def physical_memory() -> int:
    """Bytes of RAM on this machine (0 when the platform cannot tell)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return 0


def _human(n: Union[int, float]) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB", "PB"):
        if abs(n) < 1024 or unit == "PB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n} B"


def _is_kind(found: type, kind: type) -> bool:
    return issubclass(found, kind) and not (kind is int and issubclass(found, bool))


def _kind(value: Any) -> str:
    return {list: "a list", str: "a string", type(None): "null", bool: "a boolean", int: "a number",
            float: "a number"}.get(type(value), type(value).__name__)


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
