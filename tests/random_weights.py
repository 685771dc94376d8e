"""Random weights for parity tests, one helper for every test that builds a tiny HF model."""

from __future__ import annotations

import torch


def randomize_(model: torch.nn.Module, seed: int, norm_spread: float = 0.1) -> torch.nn.Module:
    """Weights large enough that logits are O(1): with the default 0.02 init every model's
    logits are near zero and a wrong mapping could still pass an absolute tolerance. Norm
    scales spread around 1 so that a layout slip in them cannot hide either."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 2:
                p.copy_(torch.randn(p.shape, generator=g) * 0.15)
            elif name.endswith("bias"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
            else:  # norm scales
                p.copy_(1.0 + norm_spread * torch.randn(p.shape, generator=g))
    return model.eval()


def small_llama(tokenizer, n_layers: int = 2, max_seq_len: int = 64):
    """A tiny grouped-query Llama over ``tokenizer``'s vocabulary (d_model 32, 4 heads, 2 KV heads),
    seeded and initialised at std 0.3 so its outputs are far from uniform: the fine-tuning tests' base."""
    from lucidlm.config import preset
    from lucidlm.model.transformer import Transformer

    torch.manual_seed(0)
    cfg = preset("llama", vocab_size=tokenizer.vocab_size, d_model=32, n_layers=n_layers, n_heads=4,
                 n_kv_heads=2, d_mlp=64, max_seq_len=max_seq_len)
    model = Transformer(cfg, tokenizer=tokenizer)
    model.reset_parameters(0.3)
    return model


def share_lora_with_peft(ours: torch.nn.Module, theirs: torch.nn.Module, projections=("q_proj", "v_proj")) -> None:
    """Give ``ours`` (lucidlm, LoRA added) the LoRA weights of ``theirs`` (a peft Llama), with a
    random non-zero B on both sides, so every LoRA gradient of a comparison is non-trivial."""
    their_modules = dict(theirs.named_modules())
    with torch.no_grad():
        for i, block in enumerate(ours.blocks):
            for proj in projections:
                mine = getattr(block.attn, proj)
                hf = their_modules[f"base_model.model.model.layers.{i}.self_attn.{proj}"]
                hf.lora_B["default"].weight.normal_(0, 0.1)
                mine.lora_A["default"].copy_(hf.lora_A["default"].weight)
                mine.lora_B["default"].copy_(hf.lora_B["default"].weight)
