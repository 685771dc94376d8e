"""Mixed-precision training on CPU: under bfloat16 autocast the projections run in bfloat16,
but attention itself runs in float32 (torch's CPU flash-attention backward is several times
slower in bfloat16). The reference is torch's own float32 SDPA on the same rotated q, k, v."""

import pytest
import torch
import torch.nn.functional as F

from lucidlm.config import ModelConfig
from lucidlm.model.transformer import Transformer


@pytest.mark.parametrize("n_kv_heads", [4, 2])  # plain and grouped-query
def test_attention_under_cpu_autocast_is_float32_sdpa(n_kv_heads):
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=97, d_model=64, n_layers=2, n_heads=4, n_kv_heads=n_kv_heads, max_seq_len=32,
                      positions="rope", norm="rms", mlp="swiglu", d_mlp=128)
    model = Transformer(cfg)
    seen = {}
    attn = model.blocks[1].attn
    for name in ("hook_rot_q", "hook_rot_k", "hook_v", "hook_z"):
        getattr(attn, name).add_hook(lambda x, hook, name=name: seen.__setitem__(name, x.detach()))
    ids = torch.randint(0, 97, (3, 20))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(ids)
    assert seen["hook_rot_q"].dtype == torch.bfloat16  # the projection did run in bfloat16
    assert seen["hook_z"].dtype == torch.float32

    q, k, v = (seen[n].float().transpose(1, 2) for n in ("hook_rot_q", "hook_rot_k", "hook_v"))  # (B, heads, T, hd)
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=n_kv_heads != 4)
    torch.testing.assert_close(seen["hook_z"], expected.transpose(1, 2), rtol=1e-5, atol=1e-6)

    logits.float().logsumexp(-1).mean().backward()  # gradients flow back through the float32 attention
    grad = model.blocks[0].attn.q_proj.weight.grad
    assert grad is not None and grad.dtype == torch.float32 and torch.isfinite(grad).all() and grad.abs().sum() > 0


def test_float32_and_bf16_models_are_untouched_outside_autocast():
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=50, d_model=32, n_layers=1, n_heads=2, max_seq_len=16)
    model = Transformer(cfg).to(torch.bfloat16)
    seen = {}
    model.blocks[0].attn.hook_z.add_hook(lambda x, hook: seen.__setitem__("z", x))
    model(torch.randint(0, 50, (1, 8)))
    assert seen["z"].dtype == torch.bfloat16  # a bf16 model keeps bf16 attention: only autocast upcasts
