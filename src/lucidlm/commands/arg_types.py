"""argparse ``type=`` checks shared by every command: a bad value is refused while the command
line is parsed, before a model is loaded or a file written, with the flag (argparse adds it),
the value and what is accepted. Each reuses lucidlm's own checker for that kind of value, so
``--device foo`` and ``lucidlm.load(device="foo")`` say the same thing."""

from __future__ import annotations

import argparse
from typing import Callable

from lucidlm.errors import LucidLMError


def device(value: str) -> str:
    """A device this machine has: auto, cpu, cuda, cuda:N (N < the GPU count), mps."""
    from lucidlm.devices import resolve_device

    _check(lambda: resolve_device(value))
    return value


def dtype(value: str) -> str:
    """A float dtype name: float32, bfloat16, float16 (or fp32, bf16, fp16, half)."""
    from lucidlm.devices import resolve_dtype

    _check(lambda: resolve_dtype(value))
    return value


def text(value: str) -> str:
    """Text that is valid UTF-8. Python hands argv bytes that are not UTF-8 over as lone
    surrogates (surrogateescape); name the first bad byte instead of failing later."""
    from lucidlm.validation import first_surrogate

    at = first_surrogate(value)
    if at is not None:
        code = ord(value[at])
        what = f"byte 0x{code - 0xDC00:02x}" if 0xDC80 <= code <= 0xDCFF else f"lone surrogate U+{code:04X}"
        raise argparse.ArgumentTypeError(f"{shown(value)} is not UTF-8 text ({what} at character {at}); pass "
                                         f"UTF-8 text (e.g. convert it with iconv -t UTF-8).")
    return value


def shown(value: str) -> str:
    safe = value.encode("utf-8", "backslashreplace").decode("utf-8")
    return repr(safe if len(safe) <= 40 else safe[:37] + "...")


def _check(call: Callable[[], object]) -> None:
    try:
        call()
    except LucidLMError as exc:  # lucidlm's own one-line message becomes argparse's
        raise argparse.ArgumentTypeError(str(exc)) from None
