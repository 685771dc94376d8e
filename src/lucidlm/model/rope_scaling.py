"""RoPE frequency scaling: how a model trained on a short context reads a longer one.

RoPE turns pair i of each query/key by m * f_i at position m, with f_i = theta^(-2i/d)
(``positions.rope_inverse_frequencies``). A scaling divides each f_i by a factor (above 1 to
stretch the context; below 1 is accepted, as transformers and llama.cpp do), so that the slow
pairs, which encode "how far back", turn no further at the new context length than they did at
the old one. ``ModelConfig.rope_scaling`` names the rule, in Hugging Face's
spelling (``config.json``'s ``rope_scaling`` / ``rope_parameters``):

- ``{"rope_type": "linear", "factor": s}``: every pair divided by s (position interpolation;
  Gemma 3's global layers);
- ``{"rope_type": "llama3", "factor": s, "low_freq_factor": lo, "high_freq_factor": hi,
  "original_max_position_embeddings": n}``: Llama 3.1-3.3's piecewise rule. Pairs whose
  wavelength 2*pi/f_i fits n/hi times in the old context are kept, those longer than n/lo are
  divided by s, and the ones between blend the two smoothly;
- ``{"rope_type": "frequency_factors", "factors": [...]}``: one divisor per pair, as llama.cpp
  stores them in a GGUF's ``rope_freqs.weight`` tensor.

Other rules (dynamic NTK, YaRN, LongRoPE) change attention beyond the angles and are refused
where a loader reads them. This file is the one to change for a new rule.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch


def rope_frequency_divisors(inverse_frequencies: torch.Tensor, scaling: Optional[dict[str, Any]]) -> torch.Tensor:
    """(hd/2,) what each pair's frequency is divided by under ``scaling`` (ones for None).

    inverse_frequencies: (hd/2,) the unscaled f_i, float64."""
    if scaling is None:
        return torch.ones_like(inverse_frequencies)
    kind = scaling["rope_type"]
    if kind == "linear":
        return torch.full_like(inverse_frequencies, float(scaling["factor"]))
    if kind == "frequency_factors":
        return torch.tensor(scaling["factors"], dtype=inverse_frequencies.dtype)
    if kind == "llama3":
        return llama3_divisors(inverse_frequencies, scaling["factor"], scaling["low_freq_factor"],
                               scaling["high_freq_factor"], scaling["original_max_position_embeddings"])
    raise ValueError(f"unknown RoPE scaling {kind!r}")  # ModelConfig refuses it first


def llama3_divisors(inverse_frequencies: torch.Tensor, factor: float, low_freq_factor: float,
                    high_freq_factor: float, original_context: int) -> torch.Tensor:
    """(hd/2,) Llama 3.1's divisors: 1 for short wavelengths, ``factor`` for long ones, and
    1 / ((1 - smooth) / factor + smooth) between, with smooth going linearly in n / wavelength
    from 0 (at n / low_freq_factor) to 1 (at n / high_freq_factor)."""
    wavelengths = 2 * math.pi / inverse_frequencies  # (hd/2,) tokens per full turn
    long_wavelength = original_context / low_freq_factor  # longer than this: divided by factor
    short_wavelength = original_context / high_freq_factor  # shorter than this: kept
    smooth = (original_context / wavelengths - low_freq_factor) / (high_freq_factor - low_freq_factor)
    between = 1.0 / ((1.0 - smooth) / factor + smooth)
    divisors = torch.where(wavelengths > long_wavelength, torch.full_like(between, factor), between)
    return torch.where(wavelengths < short_wavelength, torch.ones_like(between), divisors)
