"""The command line's --quantize choices are the schemes lucidlm knows, plus "gguf"."""

from __future__ import annotations

from lucidlm.commands.generate import QUANTIZE_CHOICES
from lucidlm.quantization import SCHEMES


def test_quantize_flag_offers_every_scheme_and_gguf():
    # QUANTIZE_CHOICES is spelled out so that `lucidlm generate --help` imports no torch; a new
    # scheme in swap.SCHEMES must appear there too (convert's --quantize reads the same tuple)
    assert sorted(QUANTIZE_CHOICES) == sorted([*SCHEMES, "gguf"])
