"""Reading JSON files and checking their fields: ``read_json``, ``read_json_object`` and ``Fields``.

Part of the validation helper (``validation.py``, which re-exports all of it): a missing,
unreadable, non-UTF-8 or damaged file becomes one line naming the file, and each field read
through ``Fields`` is type- and range-checked, a refusal naming file, field, value, what is
accepted and the fix. ``Fields`` also wraps non-JSON mappings (GGUF metadata).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence, Type, Union

from lucidlm.errors import LucidLMError

_MISSING = object()


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

    def format_version(self, key: str, reads: int, to: str) -> int:
        """The file's format number in ``key``: 1 when absent (files written before the field
        existed), and refused when newer than ``reads`` (see ``refuse_newer_format``)."""
        version = self.int(key, default=1, low=1)
        refuse_newer_format(self.source, key, version, reads, to, self.error)
        return version

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
        self._fail(f"field {self._name(key)!r} is {show_value(value)}; expected {wanted}")

    def _fail(self, problem: str) -> None:
        fix = self.fix or "fix or replace the file"
        raise self.error(f"{self.source}: {problem}. {fix[0].upper() + fix[1:]}.")

    def _name(self, key: str) -> str:
        return f"{self.where}.{key}" if self.where else key


def refuse_newer_format(source: Union[str, Path], key: str, version: int, reads: int, to: str,
                        error: Type[LucidLMError]) -> None:
    """Refuse a file whose format number ``version`` is newer than the ``reads`` this lucidlm
    knows: a later format may lay its contents out otherwise, so reading it as this one would be
    silently wrong. ``to`` finishes "upgrade lucidlm to ..." ("load this adapter")."""
    if version > reads:
        raise error(f"{source} has {key} {version}, newer than this lucidlm reads ({reads}); "
                    f"upgrade lucidlm to {to}.")


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


def _is_kind(found: type, kind: type) -> bool:
    return issubclass(found, kind) and not (kind is int and issubclass(found, bool))


def _kind(value: Any) -> str:
    return {list: "a list", str: "a string", type(None): "null", bool: "a boolean", int: "a number",
            float: "a number"}.get(type(value), type(value).__name__)


def show_value(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
