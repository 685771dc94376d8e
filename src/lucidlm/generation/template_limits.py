"""What a chat template's operations would build, checked before they run: the size and time
limits of the sandbox (``template_sandbox.py``), without the Jinja2 wiring.

- ``tick``: the deadline ``render_bounded`` set, checked by every hook of the sandbox;
- ``weight``: about how many characters a value renders as, counted only up to the limit;
- ``check_*`` and the size estimates: an upper bound of what ``*``, ``**``, ``%``, ``+``,
  string methods, ``str.format`` and the amplifying filters would build, refused past
  ``MAX_CHARS`` (or ``MAX_INT_BITS`` for numbers) with a ``TemplateProblem``.

``template_sandbox.py`` re-exports ``MAX_CHARS``, ``MAX_ITEMS``, ``MAX_INT_BITS`` and
``TemplateProblem``.
"""

from __future__ import annotations

import re
import threading
import time
from string import Formatter
from typing import Any, Iterable, Iterator

from jinja2.utils import Namespace

MAX_CHARS = 1 << 24      # characters (or list items) one value or the whole output may reach
MAX_ITEMS = 1 << 17      # items a filter's generator may produce (``slice(10**9)|list``), above MAX_RANGE
MAX_INT_BITS = 1 << 16   # ``**`` and ``*`` on integers

_WIDTH_METHODS = {"ljust", "rjust", "center", "zfill"}
_PERCENT_SPEC = re.compile(r"%(?:\([^)]*\))?[#0\- +]*(\*|\d+)?(?:\.(\*|\d+))?")


class TemplateProblem(Exception):
    """A chat template went past a limit above or misused a helper (the message says what it did)."""


class _State(threading.local):
    deadline: float = 0.0  # 0: not rendering (compile-time constant folding)
    seconds: float = 0.0  # the time limit of this render, for the message
    depth: int = 0


render_state = _State()


def tick() -> None:
    if render_state.deadline and time.monotonic() > render_state.deadline:
        raise TemplateProblem(f"ran for more than {render_state.seconds:g} s (an endless or huge loop)")


def weight(value: Any, budget: int = MAX_CHARS) -> int:
    """About how many characters ``value`` renders as (items count one each), counted only up
    to just past ``budget`` so that a huge or self-multiplying structure costs little to size."""
    total, stack, steps = 0, [value], 0
    while stack and total <= budget:
        item = stack.pop()
        if isinstance(item, str):
            total += len(item)
        elif isinstance(item, (list, tuple, set, frozenset)):
            total += 1 + len(item)
            stack.extend(item)
        elif isinstance(item, dict):
            total += 1 + len(item)
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, Namespace):
            stack.append(item._Namespace__attrs)  # its repr shows every attribute
        elif isinstance(item, int):
            total += item.bit_length() // 3 + 1
        else:
            total += 1
        steps += 1
        if steps % 4096 == 0:
            tick()
    return total


def check_size(size: int, what: str) -> None:
    if size > MAX_CHARS:
        raise TemplateProblem(f"builds {what} of more than {MAX_CHARS} characters")


def bounded_concat(pieces: Iterable[str]) -> str:
    """``"".join`` for template output and macro bodies, stopped at ``MAX_CHARS``."""
    kept, total = [], 0
    for piece in pieces:
        tick()
        if piece:
            total += len(piece)
            check_size(total, "an output")
            kept.append(piece)
    return "".join(kept)


def bounded_iter(iterable: Any, limit: int = 0) -> Iterator[Any]:
    """Every ``for`` loop (and every generator a filter returns) iterates through this."""
    for count, item in enumerate(iterable, 1):
        tick()
        if limit and count > limit:
            raise TemplateProblem(f"produces more than {limit} items from one filter")
        yield item


def check_binop(operator: str, left: Any, right: Any) -> None:
    numbers = (int, float)
    if operator == "**" and isinstance(left, int) and isinstance(right, int) and right > 0:
        if max(left.bit_length(), 1) * right > MAX_INT_BITS:
            raise TemplateProblem(f"computes a number of more than {MAX_INT_BITS} bits ({left} ** {right})")
    elif operator == "*":
        if isinstance(left, int) and isinstance(right, int):
            if left.bit_length() + right.bit_length() > MAX_INT_BITS:
                raise TemplateProblem(f"computes a number of more than {MAX_INT_BITS} bits")
        elif isinstance(right, int) and not isinstance(left, numbers):
            check_size(weight(left) * max(right, 0), "a repeated string or list")
        elif isinstance(left, int) and not isinstance(right, numbers):
            check_size(weight(right) * max(left, 0), "a repeated string or list")
    elif operator == "+" and not isinstance(left, numbers):
        check_size(weight(left) + weight(right), "a joined string or list")
    elif operator == "%" and isinstance(left, str):
        _check_percent_format(left, right)


def _check_percent_format(text: str, args: Any) -> None:
    """``text % args``: no width from the arguments or beyond the limit, and each conversion
    may show all of ``args`` (``%(a)s`` can repeat one big value)."""
    specs = _PERCENT_SPEC.findall(text)
    for width, precision in specs:
        _check_width(width, "a %-format width")
        _check_width(precision, "a %-format precision")
    check_size(len(text) + max(len(specs), 1) * weight(args), "a %-formatted string")


def _check_width(number: str, what: str) -> None:
    if number == "*":
        raise TemplateProblem(f"uses {what} taken from its arguments ('*'), which chat templates may not")
    if number and int(number) > MAX_CHARS:
        raise TemplateProblem(f"uses {what} of {number}, more than {MAX_CHARS} characters")


def check_format_string(text: str, args: tuple, kwargs: dict) -> None:
    """``str.format``: widths in the format specs, and each field may show all the arguments
    (``{0}{0}{0}`` repeats one)."""
    fields = 0
    for _, field, spec, _ in Formatter().parse(text):
        if spec and "{" in spec:
            raise TemplateProblem("uses a nested {...} inside a format spec, which chat templates may not")
        for number in re.findall(r"\d+", spec or ""):
            _check_width(number, "a format width")
        fields += field is not None
    check_size(len(text) + fields * (weight(list(args)) + weight(kwargs)), "a formatted string")


def _replace_size(text: str, old: Any, new: Any, count: Any = -1) -> int:
    if not (isinstance(old, str) and isinstance(new, str)):
        return len(text)  # str.replace refuses them itself
    hits = text.count(old) if old else len(text) + 1
    if isinstance(count, int) and count >= 0:
        hits = min(hits, count)
    return len(text) + hits * max(len(new) - len(old), 0)


def _join_size(separator: Any, items: Any) -> int:
    """``separator`` between ``items``; an iterator of unknown length counts as ``MAX_ITEMS``."""
    n = len(items) if isinstance(items, (str, list, tuple, dict, set, frozenset)) else MAX_ITEMS
    return weight(items) + len(str(separator)) * max(n - 1, 0)


def check_str_method(text: str, name: str, args: tuple, kwargs: dict) -> None:
    """The string methods that can build more than they are given, checked before they run."""
    if name in _WIDTH_METHODS and args and isinstance(args[0], int):
        _check_width(str(max(args[0], 0)), f"a width in .{name}()")
    elif name == "expandtabs":
        size = args[0] if args and isinstance(args[0], int) else kwargs.get("tabsize", 8)
        check_size(len(text) + text.count("\t") * (size if isinstance(size, int) else 0), "an expanded string")
    elif name == "replace" and len(args) >= 2:
        check_size(_replace_size(text, *args[:3]), "a string with .replace()")
    elif name == "join" and args:
        check_size(_join_size(text, args[0]), "a string with .join()")
    elif name == "translate":  # each character may become the longest replacement
        check_size(len(text) * max(weight(list(args)), 1), "a string with .translate()")


def filter_estimate(name: str, value: Any, args: tuple, kwargs: dict) -> int:
    """An upper bound of what the amplifying built-in filters build, before they run."""
    def arg(i: int, key: str, default: Any) -> Any:
        return args[i] if len(args) > i else kwargs.get(key, default)

    size = weight(value)
    text = value if isinstance(value, str) else ""
    if name == "center":
        width = arg(0, "width", 80)
        return max(size, width if isinstance(width, int) else MAX_CHARS + 1)
    if name == "indent":
        width = arg(0, "width", 4)
        width = len(width) if isinstance(width, str) else width if isinstance(width, int) else MAX_CHARS + 1
        return size + (text.count("\n") + 1) * max(width, 0)
    if name == "replace" and isinstance(value, str):
        return _replace_size(value, arg(0, "old", ""), arg(1, "new", ""), arg(2, "count", -1))
    if name == "wordwrap":
        width, wrap = arg(0, "width", 79), arg(2, "wrapstring", None) or "\n"
        lines = size // width + 1 if isinstance(width, int) and width > 0 else size + 1
        return size + lines * weight(wrap)
    if name == "join":
        return _join_size(arg(0, "d", ""), value)
    if name == "format" and isinstance(value, str):
        _check_percent_format(value, list(args) + list(kwargs.values()))
    return size


__all__ = ["MAX_CHARS", "MAX_INT_BITS", "MAX_ITEMS", "TemplateProblem", "bounded_concat", "bounded_iter",
           "check_binop", "check_format_string", "check_size", "check_str_method", "filter_estimate", "render_state",
           "tick", "weight"]
