"""norm='none' (seed 002's toy model has no LayerNorm): the same network as GPT-2 with every
LayerNorm taken out, checked against transformers' GPT-2 with its norms replaced by identity."""

from __future__ import annotations

import torch
from torch import nn
from torch.testing import assert_close
from transformers import GPT2Config, GPT2LMHeadModel

import lucidlm
from lucidlm import Transformer


def test_no_norm_gpt2_matches_transformers_without_layernorms(tmp_path):
    torch.manual_seed(0)
    hf = GPT2LMHeadModel(GPT2Config(vocab_size=97, n_embd=64, n_layer=2, n_head=4, n_positions=32)).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0.0, 0.1)
    hf.save_pretrained(tmp_path)
    loaded = lucidlm.load(tmp_path)
    for block in hf.transformer.h:
        block.ln_1, block.ln_2 = nn.Identity(), nn.Identity()
    hf.transformer.ln_f = nn.Identity()

    ours = Transformer(loaded.config.replace(norm="none")).eval()
    missing, unexpected = ours.load_state_dict(loaded.state_dict(), strict=False)
    assert missing == [] and all(".ln" in k or k.startswith("ln_final") for k in unexpected)
    assert not any(isinstance(m, (nn.LayerNorm,)) or "Norm" in type(m).__name__ for m in ours.modules())
    ids = torch.randint(0, 97, (2, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(ids).logits
        assert_close(ours(ids), expected)
        assert (loaded(ids) - expected).abs().max() > 1e-2  # the norms did matter
