"""Quantized SmolLM2-135M against its exact float32 self (the parity-tested path).

- perplexity on a held-out slice of tinyshakespeare (the last 40,000 characters, which no
  lucidlm training recipe or test trains on): int8, per output channel and in groups of 32,
  within 1 % of float32; int4 (groups of 32, requantized from the dequantized weights) and
  the GGUF's own quants (Q4_1 layers, Q8_0 embedding, kept exactly) within the bounds
  measured below;
- greedy decoding: along float32's own greedy continuation of each parity prompt, the
  quantized model picks the same token wherever float32's top-2 logit margin exceeds 0.1
  (where the margin is smaller the two tokens are a near tie that rounding may flip).
"""

from __future__ import annotations

import pytest
import torch

import lucidlm
from against_float import clear_greedy_picks_kept, perplexity, prompts_of

pytestmark = pytest.mark.slow

# Measured 2026-11-23 on the first 16 windows (4,096 tokens; float32 ppl 47.5), with the
# same figures on all 49 windows of the slice in brackets: int8 per output channel +0.65 %
# (+0.74 %), int8 group 32 -0.09 % (-0.18 %), int4 group 32 +5.95 % (+6.2 %), gguf -0.03 %
# (-0.02 %). Per-window log-loss differences scatter (standard error of the 49-window mean:
# 0.12 % for int8 per channel, 0.4 % for int4), so two windows (what this test used to read)
# could not resolve a 1 % bound: they gave int8 per channel +1.8 % and int4 +3.5 %.
# Choosing each row's int8 scale to minimise its squared error (a clip-ratio search) lowered
# the weights' error but not the perplexity (+0.76 % on 49 windows), so the scheme stays absmax.
PPL_BOUNDS = {("int8", None): 0.01, ("int8", 32): 0.01, ("int4", 32): 0.08, ("gguf", None): 0.01}
WINDOW, WINDOWS = 256, 16
BATCH = 4  # windows per forward: bounds the (B, T, 49152) float32 logits to ~200 MB
MARGIN = 0.1
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def heldout_ids(smollm2, shared_dir) -> torch.Tensor:
    text = (shared_dir / "data" / "tinyshakespeare.txt").read_text(encoding="utf-8")[-40_000:]
    ids = smollm2.tokenizer.encode(text)
    assert len(ids) >= WINDOW * WINDOWS
    return torch.tensor(ids[: WINDOW * WINDOWS]).reshape(WINDOWS, WINDOW)


@pytest.fixture(scope="module")
def float_ppl(smollm2, heldout_ids) -> float:
    return perplexity(smollm2, heldout_ids, BATCH)


@pytest.mark.parametrize("scheme,group_size", list(PPL_BOUNDS))
def test_perplexity_within_bound(smollm2, heldout_ids, float_ppl, scheme, group_size):
    model = lucidlm.load("smollm2-135m", quantize=scheme, group_size=group_size)
    ppl = perplexity(model, heldout_ids, BATCH)
    assert 5 < float_ppl < 80  # the slice is English the model can read
    assert abs(ppl / float_ppl - 1) < PPL_BOUNDS[scheme, group_size], (scheme, ppl, float_ppl)


def test_default_perplexity_within_the_float_bound(smollm2_default, heldout_ids, float_ppl):
    """The default (the file's Q4_1 layers and Q8_0 embedding kept exactly, lucidlm's kernel, a
    float32 residual stream) is held to int8's 1 %."""
    ppl = perplexity(smollm2_default, heldout_ids, BATCH)
    assert abs(ppl / float_ppl - 1) < 0.01, (ppl, float_ppl)


def test_the_quantized_default_is_for_the_cpu_only():
    """Measured on the CPU, where torch's int4 kernel lives; on a GPU the same layers would be
    dequantized on every call, so the default there is the float path in its dtype."""
    from lucidlm.pretrained import DEFAULT_LOAD, LoadDefault

    default = DEFAULT_LOAD["smollm2-135m"]
    assert default.on("cpu") == default and default.on(torch.device("cpu")) == default
    for device in ("cuda", "cuda:1", "mps"):
        assert default.on(device) == LoadDefault(dtype=torch.bfloat16, quantize=None, quantize_embeddings=True)
    assert LoadDefault().on("cuda") == LoadDefault()
    assert LoadDefault(dtype=torch.float16, quantize="int4").on("cuda") == LoadDefault(dtype=torch.float16)


def test_default_is_quantized_and_agrees_with_float_greedy(smollm2, smollm2_default):
    from lucidlm.quantization import is_quantized
    from lucidlm.pretrained import DEFAULT_LOAD

    default = DEFAULT_LOAD["smollm2-135m"]
    model = smollm2_default
    assert is_quantized(model) == (default.quantize is not None)
    assert model.dtype == default.dtype
    if not default.quantize_embeddings:  # one float matrix in and out, quantized layers in between
        assert type(model.embed) is torch.nn.Embedding and model.unembed.weight is model.embed.weight
    checked = clear_greedy_picks_kept(smollm2, model, prompts_of("weights/test_smollm2_parity.py"), NEW_TOKENS, MARGIN)
    assert checked >= 40  # most steps have a clear winner: the comparison means something
