""""Did you mean ...?" for names a user typed: commands, flags, model and preset names, and the
keyword arguments of the public functions and config classes (``keywords_checked``)."""

from __future__ import annotations

import difflib
import functools
import inspect
from typing import Any, Callable, Iterable, Optional, TypeVar

T = TypeVar("T")


def did_you_mean(value: str, choices: Iterable[str]) -> str:
    """``"; did you mean 'x'?"`` for the closest of ``choices``, or ``""`` when none is close."""
    choices = [str(c) for c in choices]
    matches = difflib.get_close_matches(value, choices, n=1, cutoff=0.6)
    if not matches:  # a prefix typed short ("smollm2") is close to nothing by ratio but is a clear hint
        matches = [c for c in choices if c.startswith(value) and len(value) >= 3][:1]
    return f"; did you mean {matches[0]!r}?" if matches else ""


def keyword_options(fn: Callable[..., Any]) -> list[str]:
    """The names ``fn`` takes by keyword, in signature order (``self`` left out)."""
    params = inspect.signature(fn).parameters.values()
    return [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name != "self"]


def unknown_keyword_message(name: str, unknown: list[str], options: list[str]) -> str:
    """``"f() has no option 'x'; its options are a, b; did you mean 'a'?"``"""
    return (f"{name}() has no option {unknown[0]!r}; its options are {', '.join(options)}"
            f"{did_you_mean(unknown[0], options) or '.'}")


def unknown_fields_message(name: str, unknown: list[str], options: list[str]) -> str:
    """ModelConfig.from_dict's wording for config fields that do not exist."""
    unknown = sorted(unknown)
    return (f"{name}: unknown config field(s) {unknown}; valid fields are: {', '.join(sorted(options))}"
            f"{did_you_mean(unknown[0], options) or '.'}")


def keywords_checked(error_cls: type[Exception], message: Callable[[str, list[str], list[str]], str]
                     = unknown_keyword_message) -> Callable[[T], T]:
    """Decorator: a keyword the function (or a class's ``__init__``) does not take raises
    ``error_cls`` naming its options and the closest one, instead of Python's bare TypeError.

        @keywords_checked(AdapterError)
        def add_lora(model, name="default", r=8, ...): ...
        add_lora(model, rank=4)   # AdapterError: add_lora() has no option 'rank'; ... did you mean 'r'?

    Nothing is checked on a call that works: the signature is read only after the call has
    failed with a TypeError, so a function called in a loop pays one extra frame. The wrapper
    keeps the function's name, docstring and signature (``functools.wraps``), so ``help()``
    and ``inspect.signature`` show the real parameters. On a class, its ``__init__`` is
    wrapped and the class returned (put it above ``@dataclass``)."""
    def decorate(target: T) -> T:
        if isinstance(target, type):
            init = target.__init__  # type: ignore[misc]
            target.__init__ = _checked(init, error_cls, message, target.__name__)  # type: ignore[misc]
            return target
        return _checked(target, error_cls, message, None)  # type: ignore[return-value]
    return decorate


def _checked(fn: Callable[..., Any], error_cls: type[Exception], message: Callable[[str, list[str], list[str]], str],
             label: Optional[str]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except TypeError:
            if kwargs:  # a keyword the signature lacks can only have failed the call itself
                params = inspect.signature(fn).parameters
                if not any(p.kind is p.VAR_KEYWORD for p in params.values()):
                    options = keyword_options(fn)
                    unknown = [k for k in kwargs if k not in options]
                    if unknown:
                        raise error_cls(message(label or wrapper.__name__, unknown, options)) from None
            raise
    return wrapper
