"""Gemma 3 270M as ``lucidlm.load("gemma3-270m")`` gives it (``pretrained.DEFAULT_LOAD``: the
file's own quants kept: weights/gguf_quants.py's ``EXACT`` and ``MAPPED`` types block by block) against
its exact float32 self, held to what SmolLM2's default is held to
(tests/quantization/test_smollm2_quantized.py):

- perplexity on the held-out tinyshakespeare slice (its last 40,000 characters) within 1 % of
  float32's;
- greedy decoding: along float32's own greedy continuation of each prompt of the transformers
  parity test, the default picks the same token wherever float32's top-2 logit margin exceeds
  0.1 (a smaller margin is a near tie that any rounding may flip).
"""

from __future__ import annotations

import pytest
import torch
from against_float import clear_greedy_picks_kept, perplexity, prompts_of

pytestmark = pytest.mark.slow

# Measured 2026-11-27 on these 8 windows (<bos> + 255 tokens each): float32 perplexity 47.2, the
# default -0.01 % (on 16 windows: 56.4, -0.04 %). With Q4_K requantized from its floats, as
# before 2026-11-27, the default would have been +3.0 % (README, "Quantized weights").
WINDOW, WINDOWS = 256, 8
MARGIN = 0.1
NEW_TOKENS = 16


@pytest.fixture(scope="module")
def gemma3_default(gemma3_gguf):
    import lucidlm

    return lucidlm.load("gemma3-270m")


@pytest.fixture(scope="module")
def heldout_ids(gemma3, shared_dir) -> torch.Tensor:
    text = (shared_dir / "data" / "tinyshakespeare.txt").read_text(encoding="utf-8")[-40_000:]
    ids = gemma3.tokenizer.encode(text)
    assert len(ids) >= (WINDOW - 1) * WINDOWS
    windows = torch.tensor(ids[: (WINDOW - 1) * WINDOWS]).reshape(WINDOWS, WINDOW - 1)
    bos = torch.full((WINDOWS, 1), gemma3.tokenizer.bos_id)  # Gemma reads nothing well without its <bos>
    return torch.cat([bos, windows], dim=1)  # (WINDOWS, WINDOW)


def test_default_keeps_the_files_quants():
    from lucidlm.pretrained import DEFAULT_LOAD, LoadDefault

    assert DEFAULT_LOAD["gemma3-270m"] == LoadDefault(dtype=torch.float32, quantize="gguf",
                                                      off_cpu_dtype=torch.bfloat16)
    assert DEFAULT_LOAD["gemma3-270m"].on("cuda") == LoadDefault(dtype=torch.bfloat16)


def test_default_perplexity_within_one_percent_of_float32(gemma3, gemma3_default, heldout_ids):
    from lucidlm.quantization import is_quantized

    assert is_quantized(gemma3_default) and not is_quantized(gemma3)
    float_ppl = perplexity(gemma3, heldout_ids, batch=1)  # one window a forward: (1, 256, 262144) float32 logits are 268 MB
    ppl = perplexity(gemma3_default, heldout_ids, batch=1)
    assert 3 < float_ppl < 80, float_ppl  # English the model can read
    assert abs(ppl / float_ppl - 1) < 0.01, (ppl, float_ppl)


def test_default_agrees_with_float32_greedy_where_the_margin_is_clear(gemma3, gemma3_default):
    prompts = prompts_of("families/test_gemma3_parity.py") + ["The three primary colors are"]
    checked = clear_greedy_picks_kept(gemma3, gemma3_default, prompts, NEW_TOKENS, MARGIN)
    assert checked >= 50  # most steps have a clear winner: the comparison means something
