"""Quantized SmolLM2-135M against its exact float32 self (the parity-tested path).

- perplexity on a held-out slice of tinyshakespeare (the last 40,000 characters, which no
  lucidlm training recipe or test trains on): int8 in groups of 32 within 1 % of float32;
  int4 (groups of 32, requantized from the dequantized weights) and the GGUF's own quants
  (Q4_1 layers, Q8_0 embedding, kept exactly) within the bounds measured below;
- greedy decoding: along float32's own greedy continuation of each parity prompt, the
  quantized model picks the same token wherever float32's top-2 logit margin exceeds 0.1
  (where the margin is smaller the two tokens are a near tie that rounding may flip).
"""

from __future__ import annotations

import math

import pytest
import torch

import lucidlm

pytestmark = pytest.mark.slow

# Measured (float32 ppl 21.38 on the slice): int8 group 32 -0.63 %, int4 group 32 +3.5 %,
# gguf +0.11 % (bf16 weights +0.05 %). int8 per output channel is +1.8 % here and is not
# held to 1 %: this model's float weights are Q4_1's 4-bit grid with a scale per 32 inputs,
# which one scale per row cannot follow; int4 in groups of 64 is +32 % for the same reason.
PPL_BOUNDS = {("int8", 32): 0.01, ("int4", 32): 0.05, ("gguf", None): 0.01}
WINDOW, WINDOWS = 256, 2
MARGIN = 0.1
NEW_TOKENS = 12


def parity_prompts() -> list[str]:
    """The prompts of tests/weights/test_smollm2_parity.py, the float parity test."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "weights" / "test_smollm2_parity.py"
    spec = importlib.util.spec_from_file_location("smollm2_parity_prompts", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.PROMPTS


@pytest.fixture(scope="module")
def heldout_ids(smollm2, shared_dir) -> torch.Tensor:
    text = (shared_dir / "data" / "tinyshakespeare.txt").read_text(encoding="utf-8")[-40_000:]
    ids = smollm2.tokenizer.encode(text)
    assert len(ids) >= WINDOW * WINDOWS
    return torch.tensor(ids[: WINDOW * WINDOWS]).reshape(WINDOWS, WINDOW)


def perplexity(model, ids: torch.Tensor) -> float:
    with torch.no_grad():
        logits = model(ids).float()  # (B, T, V)
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
    return math.exp(loss.item())


@pytest.fixture(scope="module")
def float_ppl(smollm2, heldout_ids) -> float:
    return perplexity(smollm2, heldout_ids)


@pytest.mark.parametrize("scheme,group_size", list(PPL_BOUNDS))
def test_perplexity_within_bound(smollm2, heldout_ids, float_ppl, scheme, group_size):
    model = lucidlm.load("smollm2-135m", quantize=scheme, group_size=group_size)
    ppl = perplexity(model, heldout_ids)
    assert 5 < float_ppl < 40  # the slice is English the model can read
    assert abs(ppl / float_ppl - 1) < PPL_BOUNDS[scheme, group_size], (scheme, ppl, float_ppl)


def test_default_is_quantized_and_agrees_with_float_greedy(smollm2):
    from lucidlm.quantization import is_quantized
    from lucidlm.pretrained import DEFAULT_LOAD

    default = DEFAULT_LOAD["smollm2-135m"]
    model = lucidlm.load()
    assert is_quantized(model) == (default.quantize is not None)
    assert default.quantize is not None or model.dtype == default.dtype
    checked = 0
    for prompt in parity_prompts():
        ids = smollm2.tokenizer.encode(prompt)
        path = smollm2.generate(ids, max_new_tokens=NEW_TOKENS, temperature=0, stop_on_eos=False).token_ids
        full = torch.tensor([ids + list(path)])
        with torch.no_grad():
            ref = smollm2(full)[0, len(ids) - 1:-1].float()  # logits that chose each generated token
            got = model(full)[0, len(ids) - 1:-1].float()
        top2 = ref.topk(2, dim=-1).values
        clear = (top2[:, 0] - top2[:, 1]) > MARGIN
        assert torch.equal(ref.argmax(-1), torch.tensor(path))
        assert torch.equal(got.argmax(-1)[clear], ref.argmax(-1)[clear]), prompt
        checked += int(clear.sum())
    assert checked >= 40  # most steps have a clear winner: the comparison means something
