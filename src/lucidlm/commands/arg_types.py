"""argparse ``type=`` checks shared by every command: a bad value is refused while the command
line is parsed, before a model is loaded or a file written, with the flag (argparse adds it),
the value and what is accepted. (Devices, dtypes and sampling settings are checked by
lucidlm's own helpers first thing in each command, so the API and the CLI say the same.)"""

from __future__ import annotations

import argparse
import math
import os


def text(value: str) -> str:
    """Text that is valid UTF-8. Python hands argv bytes that are not UTF-8 over as lone
    surrogates (surrogateescape); name the first bad byte instead of failing later."""
    from lucidlm.validation import first_surrogate

    at = first_surrogate(value)
    if at is not None:
        try:  # an ASCII locale (LC_ALL=C, PYTHONUTF8=0) escapes UTF-8's bytes too: give back the text they are
            return os.fsencode(value).decode("utf-8")
        except UnicodeError:  # bytes that are not UTF-8, or a surrogate no byte made (from Python)
            pass
        code = ord(value[at])
        what = f"byte 0x{code - 0xDC00:02x}" if 0xDC80 <= code <= 0xDCFF else f"lone surrogate U+{code:04X}"
        raise argparse.ArgumentTypeError(f"{shown(value)} is not UTF-8 text ({what} at character {at}); pass "
                                         f"UTF-8 text (e.g. convert it with iconv -t UTF-8).")
    return value


class BadValue(argparse.ArgumentTypeError, ValueError):
    """A value refused with its own message: argparse shows it after the flag, and chat's /set,
    which parses its values with the same functions, catches it as a ValueError."""


def token_ids(value: str) -> list[int]:
    """``13,198`` -> [13, 198]: token ids separated by commas (checked against the model later).
    A negative one is refused here, with the flag as typed: the sampler's message would name the
    Python option and show the ids as a list."""
    try:
        ids = [int(part) for part in value.split(",")]
    except ValueError:
        raise BadValue(f"{shown(value)} is not a list of token ids: give whole numbers separated by commas, "
                       f"e.g. 13,198.") from None
    negative = [i for i in ids if i < 0]
    if negative:
        raise BadValue(f"{shown(value)} is not a list of token ids: {negative[0]} is negative; give whole numbers "
                       f">= 0 separated by commas, e.g. 13,198.")
    return ids


def token_sequences(value: str) -> list[list[int]]:
    """``13;464,3290`` -> [[13], [464, 3290]]: token id sequences separated by semicolons."""
    return [token_ids(part) for part in value.split(";")]


def token_bias(value: str) -> tuple[list[int], float]:
    """``464,3290=-5`` -> ([464, 3290], -5.0): token ids, ``=``, the bias (``-inf`` bans)."""
    ids, sep, bias = value.rpartition("=")
    try:
        found = [int(part) for part in ids.split(",")], float(bias)
    except ValueError:
        raise BadValue(f"{shown(value)} is not IDS=BIAS: give token ids separated by commas, '=' and a number, "
                       f"e.g. 13=-100 or 464,3290=-5.") from None
    token_ids(ids)  # a negative id, refused with its own reason
    if math.isnan(found[1]) or found[1] == math.inf:  # "nan", "inf", or "1e309", which float() makes inf
        raise BadValue(f"{shown(value)} is not IDS=BIAS with a usable bias: {bias.strip()} is "
                       f"{'NaN' if math.isnan(found[1]) else 'infinite'}; give a finite number (-100 to 100 is "
                       f"OpenAI's range), or -inf to ban.")
    return found


def logit_bias(value: str) -> tuple[int, float]:
    """``13=-100`` -> (13, -100.0): one token id, ``=``, the bias (``--logit-bias``)."""
    ids, bias = token_bias(value)
    if len(ids) != 1:
        raise BadValue(f"{shown(value)} is not ID=BIAS: one token id per --logit-bias, e.g. 13=-100 "
                       f"(--sequence-bias biases a sequence of them).")
    return ids[0], bias


def logit_biases(value: str) -> dict[int, float]:
    """``13=-100,198=2`` -> {13: -100.0, 198: 2.0}: one token per ID=BIAS, separated by commas."""
    found = {}
    for part in value.split(","):
        token, bias = logit_bias(part)
        found[token] = bias
    return found


def sequence_biases(value: str) -> list[list]:
    """``464,3290=-5;13=2`` -> [[[464, 3290], -5.0], [[13], 2.0]]: IDS=BIAS separated by semicolons."""
    return [list(token_bias(part)) for part in value.split(";")]


def port(value: str) -> int:
    """A TCP port, 0 to 65535 (0: the system picks a free one)."""
    try:
        number = int(value)
    except ValueError:
        number = -1
    if not 0 <= number <= 65535:
        raise BadValue(f"{shown(value)} is not a port: give a whole number from 1 to 65535, or 0 for a free one.")
    return number


def parallel_rows(value: str) -> int:
    """``serve --parallel``: how many rows a batch may hold, 1 or more."""
    try:
        number = int(value)
    except ValueError:
        number = 0
    if number < 1:
        raise BadValue(f"{shown(value)} is not a number of rows: give a whole number >= 1, the most requests' rows "
                       f"decoded as one batch (1: one request at a time).")
    return number


def shown(value: str) -> str:
    from lucidlm.validation import printable

    safe = printable(value)
    return repr(safe if len(safe) <= 40 else safe[:37] + "...")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Each option's default after its help (unless the help says it, or there is none), and
    the "examples:" epilog kept one command per line, so each can be pasted as it is."""

    def _get_help_string(self, action: argparse.Action) -> str:
        help_text = action.help or ""
        if action.default is None or "default" in help_text:
            return help_text
        return super()._get_help_string(action) or help_text

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        if text.startswith("examples:"):
            return "".join(indent + line for line in text.splitlines(keepends=True))
        return super()._fill_text(text, width, indent)

