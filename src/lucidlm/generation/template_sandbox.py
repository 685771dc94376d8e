"""Jinja2's immutable sandbox with limits on time, size and depth, for chat templates.

A chat template is a small program that arrives inside a model file. Jinja2's sandbox keeps
it away from Python's internals, but not from running forever (two nested ``range(100000)``
loops), allocating gigabytes (``'a' * 10**9``, ``'a'|center(10**9)``, doubling a string in a
loop) or recursing without end. ``BoundedSandbox`` adds the limits, all checked in the
sandbox's own hooks on the rendering thread (nothing to interrupt from outside):

- time: a deadline checked at every loop iteration (each ``for`` iterates through a guard),
  call, attribute or item lookup, operator, filter and output piece;
- size: every operation that can multiply its input (``*``, ``**``, ``%``, ``+``, ``~``,
  string methods and filters with a width, ``join``, ``replace``, ``format``, ``tojson``) is
  checked against ``MAX_CHARS`` *before* it runs, from the size its inputs would render as;
  every output piece, macro body and filter result is counted too;
- depth: nested calls (macros calling themselves) stop at ``MAX_DEPTH``.

A limit raises ``TemplateProblem``; ``chat_template.py`` turns it (and any other template error)
into one ``ChatTemplateError`` naming the model file.
"""

from __future__ import annotations

import functools
import re
import threading
import time
from string import Formatter
from typing import Any, Callable, Iterable, Iterator

from jinja2 import nodes
from jinja2.compiler import CodeGenerator
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import Namespace

MAX_SECONDS = 5.0        # a real template renders in milliseconds
MAX_CHARS = 1 << 24      # characters (or list items) one value or the whole output may reach
MAX_ITEMS = 1 << 17      # items a filter's generator may produce (``slice(10**9)|list``), above MAX_RANGE
MAX_DEPTH = 64           # nested calls: macros, recursive loops, caller()
MAX_INT_BITS = 1 << 16   # ``**`` and ``*`` on integers
MAX_TEMPLATE_CHARS = 1 << 20  # the template's own source (real ones are a few KB)

_WIDTH_METHODS = {"ljust", "rjust", "center", "zfill"}
_PERCENT_SPEC = re.compile(r"%(?:\([^)]*\))?[#0\- +]*(\*|\d+)?(?:\.(\*|\d+))?")


class TemplateProblem(Exception):
    """A chat template went past a limit above or misused a helper (the message says what it did)."""


class _State(threading.local):
    deadline: float = 0.0  # 0: not rendering (compile-time constant folding)
    depth: int = 0


_state = _State()


def render_bounded(template: Any, values: dict[str, Any]) -> str:
    """``template.render(**values)`` under the limits."""
    _state.deadline, _state.depth = time.monotonic() + MAX_SECONDS, 0
    try:
        return template.render(**values)
    finally:
        _state.deadline = 0.0


def tick() -> None:
    if _state.deadline and time.monotonic() > _state.deadline:
        raise TemplateProblem(f"ran for more than {MAX_SECONDS:g} s (an endless or huge loop)")


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


def _check_binop(operator: str, left: Any, right: Any) -> None:
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


def _check_format_string(text: str, args: tuple, kwargs: dict) -> None:
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


def _check_str_method(text: str, name: str, args: tuple, kwargs: dict) -> None:
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


def _filter_estimate(name: str, value: Any, args: tuple, kwargs: dict) -> int:
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


class _BoundedCodeGenerator(CodeGenerator):
    """Jinja2's code generator with every ``for`` loop iterating through ``bounded_iter`` (so
    a loop with an empty body still meets the deadline) and ``~`` checked like ``+``."""

    def visit_For(self, node: nodes.For, frame: Any) -> None:
        guard = nodes.EnvironmentAttribute("bounded_iter", lineno=node.lineno)
        node.iter = nodes.Call(guard, [node.iter], [], None, None, lineno=node.lineno)
        super().visit_For(node, frame)

    def visit_Concat(self, node: nodes.Concat, frame: Any) -> None:
        self.write("environment.join_operands((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


class BoundedSandbox(ImmutableSandboxedEnvironment):
    """The immutable sandbox, with the limits in the module docstring."""

    code_generator_class = _BoundedCodeGenerator
    intercepted_binops = frozenset({"*", "**", "+", "%"})  # also keeps them from compile-time folding
    concat = staticmethod(bounded_concat)
    bounded_iter = staticmethod(bounded_iter)

    def __init__(self, **options: Any) -> None:
        super().__init__(finalize=self._finalize, **options)
        del self.globals["lipsum"]  # generates any amount of text; no chat template uses it
        self.filters = {name: self._bounded_filter(name, f) for name, f in self.filters.items()}

    def add_filter(self, name: str, function: Callable[..., Any]) -> None:
        self.filters[name] = self._bounded_filter(name, function)

    @staticmethod
    def _finalize(value: Any) -> Any:  # every {{ value }} before it is turned into text
        check_size(weight(value), "an output value")
        return value

    @staticmethod
    def join_operands(values: tuple) -> str:  # a ~ b ~ c
        check_size(sum(weight(v) for v in values), "a joined string")
        return "".join(map(str, values))

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        tick()
        _check_binop(operator, left, right)
        return super().call_binop(context, operator, left, right)

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        tick()
        owner = getattr(__obj, "__self__", None)
        if isinstance(owner, str) and callable(__obj):
            _check_str_method(owner, getattr(__obj, "__name__", ""), args, kwargs)
        if _state.depth >= MAX_DEPTH:
            raise TemplateProblem(f"nests calls more than {MAX_DEPTH} deep (a macro that calls itself?)")
        _state.depth += 1
        try:
            result = super().call(__context, __obj, *args, **kwargs)
        finally:
            _state.depth -= 1
        check_size(weight(result), "a value from a call")
        return result

    def getattr(self, obj: Any, attribute: str) -> Any:
        tick()
        return super().getattr(obj, attribute)

    def getitem(self, obj: Any, argument: Any) -> Any:
        tick()
        return super().getitem(obj, argument)

    def wrap_str_format(self, value: Any) -> Any:
        wrapper = super().wrap_str_format(value)
        if wrapper is None:
            return None
        text = value.__self__

        @functools.wraps(wrapper)
        def checked(*args: Any, **kwargs: Any) -> str:
            _check_format_string(text, args, kwargs)
            return wrapper(*args, **kwargs)
        return checked

    @staticmethod
    def _bounded_filter(name: str, function: Callable[..., Any]) -> Callable[..., Any]:
        skip = 1 if getattr(function, "jinja_pass_arg", None) is not None else 0  # context/environment first

        @functools.wraps(function)
        def bounded(*args: Any, **kwargs: Any) -> Any:
            tick()
            value, rest = (args[skip], args[skip + 1:]) if len(args) > skip else (None, ())
            check_size(_filter_estimate(name, value, rest, kwargs), f"a value with the {name!r} filter")
            result = function(*args, **kwargs)
            if isinstance(result, Iterator):
                return bounded_iter(result, MAX_ITEMS)
            check_size(weight(result), f"a value with the {name!r} filter")
            return result
        return bounded
