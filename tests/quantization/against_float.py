"""Holding a quantized model to its exact float32 self, as the pretrained models' default-load
tests do (test_smollm2_quantized.py, test_gemma3_quantized.py): perplexity over held-out
windows, and float32's greedy picks kept wherever its top-2 margin is clear."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import torch

from lucidlm.evaluation import nll_sums

TESTS = Path(__file__).resolve().parents[1]


def prompts_of(test_file: str) -> list[str]:
    """``PROMPTS`` of another test module (``test_file`` relative to tests/), e.g. a parity test's."""
    path = TESTS / test_file
    spec = importlib.util.spec_from_file_location(f"prompts_of_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return list(module.PROMPTS)


def perplexity(model, ids: torch.Tensor, batch: int) -> float:
    """exp(mean next-token cross-entropy) over the windows ``ids`` (W, T), each scored whole (its
    own first token, a <bos> the caller put there, being context), ``batch`` windows a forward."""
    total = sum(sum(nll_sums(model, rows)) for rows in ids.split(batch))  # rows (b, T) each
    return math.exp(total / (ids.shape[0] * (ids.shape[1] - 1)))


def clear_greedy_picks_kept(reference, model, prompts: list[str], new_tokens: int, margin: float) -> int:
    """Along ``reference``'s own greedy continuation of each prompt, assert that ``model`` picks
    the same token wherever the reference's top-2 logit margin exceeds ``margin`` (a smaller one
    is a near tie that any rounding may flip); returns how many picks were compared."""
    checked = 0
    for prompt in prompts:
        ids = reference.tokenizer.encode(prompt)
        path = reference.generate(ids, max_new_tokens=new_tokens, temperature=0, stop_on_eos=False).token_ids
        full = torch.tensor([ids + list(path)])
        with torch.no_grad():
            ref = reference(full)[0, len(ids) - 1:-1].float()  # the logits that chose each generated token
            got = model(full)[0, len(ids) - 1:-1].float()
        top2 = ref.topk(2, dim=-1).values
        clear = (top2[:, 0] - top2[:, 1]) > margin
        assert torch.equal(ref.argmax(-1), torch.tensor(path))
        assert torch.equal(got.argmax(-1)[clear], ref.argmax(-1)[clear]), prompt
        checked += int(clear.sum())
    return checked
