"""bfloat16 / float16 against transformers in the same dtype: lucidlm's reduced-precision path
may round differently from transformers', but it must not land further from the float32
result than transformers' own bf16 path does.

RMSNorm: transformers' Gemma 3 norm multiplies its weight in float32 and rounds once; its Llama
norm rounds x / rms(x) first. lucidlm rounds once for every family (model/norms.py). LayerNorm
(GPT-2): torch's own layer_norm, also with a hook attached (run_with_cache)."""

from __future__ import annotations

import pytest
import torch
from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from lucidlm.model.norms import LayerNorm, RMSNorm

DIM, EPS = 640, 1e-6


def norm_weights(seed: int = 0) -> torch.Tensor:
    """(DIM,) Gemma weights w on a grid of 1/64 in [-2, 2): w and the 1 + w lucidlm stores are both
    exact in bfloat16, so the two libraries start from the same numbers."""
    return torch.randint(-128, 128, (DIM,), generator=torch.Generator().manual_seed(seed)).float() / 64


def activations(seed: int = 1) -> torch.Tensor:
    """(4, 32, DIM) bfloat16, spread over a few orders of magnitude like a residual stream."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(4, 32, DIM, generator=g) * torch.rand(4, 32, 1, generator=g).mul(8).exp2()).bfloat16()


def ours(weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    norm = RMSNorm(DIM, EPS)
    with torch.no_grad():
        norm.weight.copy_(weight)
    return norm.to(x.dtype)(x)


def theirs(cls: type, weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    norm = cls(DIM, eps=EPS)
    with torch.no_grad():
        norm.weight.copy_(weight)
    return norm.to(x.dtype)(x)


def test_bf16_rms_norm_rounds_once_as_transformers_gemma3_does():
    w, x = norm_weights(), activations()
    expected = theirs(Gemma3RMSNorm, w, x)
    got = ours(1 + w, x)  # the GGUF's (1 + weight), as lucidlm loads it
    # rsqrt against a division can move a product across a rounding boundary now and then
    assert (got != expected).float().mean() < 0.01
    torch.testing.assert_close(got, expected, atol=0, rtol=2 * torch.finfo(x.dtype).eps)  # those by one unit


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_bf16_rms_norm_is_no_further_from_float32_than_transformers(family):
    w, x = norm_weights(), activations()
    cls, stored = (LlamaRMSNorm, w) if family == "llama" else (Gemma3RMSNorm, 1 + w)
    exact = theirs(cls, w, x.float())  # float32 on the same bf16 inputs
    hf_error = (theirs(cls, w, x).float() - exact).abs().mean()
    our_error = (ours(stored, x).float() - exact).abs().mean()
    assert our_error <= hf_error * 1.01, (float(our_error), float(hf_error))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_hooked_half_precision_layer_norm_is_torchs_layer_norm(dtype):
    g = torch.Generator().manual_seed(2)
    reference = torch.nn.LayerNorm(DIM, eps=1e-5)
    with torch.no_grad():
        reference.weight.copy_(1 + 0.5 * torch.randn(DIM, generator=g))
        reference.bias.copy_(torch.randn(DIM, generator=g))
    norm = LayerNorm(DIM, 1e-5)
    norm.load_state_dict(reference.state_dict())
    reference, norm = reference.to(dtype), norm.to(dtype)
    x = (torch.randn(4, 32, DIM, generator=g) * 3).to(dtype)
    seen = []
    norm.hook_normalized.add_hook(lambda t, hook: seen.append(t) or t)  # what run_with_cache attaches
    with torch.no_grad():
        got, expected = norm(x), reference(x)
    assert seen
    # the variance's summation order may move a value across a rounding boundary now and then;
    # rounding x / std before the weight moved ~30 % of them
    assert (got != expected).float().mean() < 0.01
    torch.testing.assert_close(got, expected, atol=0, rtol=2 * torch.finfo(dtype).eps)  # those by one unit
