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
into one ``ChatTemplateError`` naming the model file. The time and size checks themselves (what
each operation would build) are ``template_limits.py``; this module wires them into Jinja2.
"""

from __future__ import annotations

import functools
import time
from typing import Any, Callable, Iterator

from jinja2 import nodes
from jinja2.compiler import CodeGenerator
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment

from lucidlm.generation.template_limits import (  # noqa: F401  (MAX_CHARS, MAX_INT_BITS: re-exported)
    MAX_CHARS, MAX_INT_BITS, MAX_ITEMS, TemplateProblem, bounded_concat, bounded_iter, check_binop,
    check_format_string, check_size, check_str_method, filter_estimate, render_state, tick, weight)

MAX_SECONDS = 5.0        # a real template renders in milliseconds
MAX_DEPTH = 64           # nested calls: macros, recursive loops, caller()
MAX_TEMPLATE_CHARS = 1 << 20  # the template's own source (real ones are a few KB)


class GenerationBlock(Extension):
    """``{% generation %} ... {% endgeneration %}``: transformers marks the assistant's tokens
    with it (for training masks) and renders its body unchanged; so does this."""

    tags = {"generation"}

    def parse(self, parser: Any) -> list[nodes.Node]:
        next(parser.stream)  # the `generation` name
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def render_bounded(template: Any, values: dict[str, Any]) -> str:
    """``template.render(**values)`` under the limits."""
    render_state.deadline, render_state.seconds, render_state.depth = time.monotonic() + MAX_SECONDS, MAX_SECONDS, 0
    try:
        return template.render(**values)
    finally:
        render_state.deadline = 0.0


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
        check_binop(operator, left, right)
        return super().call_binop(context, operator, left, right)

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        tick()
        owner = getattr(__obj, "__self__", None)
        if isinstance(owner, str) and callable(__obj):
            check_str_method(owner, getattr(__obj, "__name__", ""), args, kwargs)
        if render_state.depth >= MAX_DEPTH:
            raise TemplateProblem(f"nests calls more than {MAX_DEPTH} deep (a macro that calls itself?)")
        render_state.depth += 1
        try:
            result = super().call(__context, __obj, *args, **kwargs)
        finally:
            render_state.depth -= 1
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
            check_format_string(text, args, kwargs)
            return wrapper(*args, **kwargs)
        return checked

    @staticmethod
    def _bounded_filter(name: str, function: Callable[..., Any]) -> Callable[..., Any]:
        skip = 1 if getattr(function, "jinja_pass_arg", None) is not None else 0  # context/environment first

        @functools.wraps(function)
        def bounded(*args: Any, **kwargs: Any) -> Any:
            tick()
            value, rest = (args[skip], args[skip + 1:]) if len(args) > skip else (None, ())
            check_size(filter_estimate(name, value, rest, kwargs), f"a value with the {name!r} filter")
            result = function(*args, **kwargs)
            if isinstance(result, Iterator):
                return bounded_iter(result, MAX_ITEMS)
            check_size(weight(result), f"a value with the {name!r} filter")
            return result
        return bounded
