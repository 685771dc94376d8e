"""A decode step in bfloat16/float16 on the CPU spells attention out (one query per row,
query heads grouped by their kv head) instead of calling torch's CPU flash attention, which
is several times slower there. The reference is torch's own SDPA, computed in float32 on the
same rotated q, k, v the model's hooks saw, with the same cache mask."""

import pytest
import torch
import torch.nn.functional as F

from lucidlm.config import ModelConfig
from lucidlm.model.transformer import Transformer


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n_kv_heads", [6, 2, 1])  # plain, grouped-query, multi-query
def test_decode_step_attention_equals_sdpa(dtype, n_kv_heads):
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=97, d_model=96, n_layers=2, n_heads=6, n_kv_heads=n_kv_heads, max_seq_len=64,
                      positions="rope", norm="rms", mlp="swiglu", d_mlp=128)
    model = Transformer(cfg).eval()
    with torch.no_grad():  # sharpen the patterns, so the test sees more than near-uniform averages
        for block in model.blocks:
            block.attn.q_proj.weight.mul_(6.0)
            block.attn.k_proj.weight.mul_(6.0)
    model = model.to(dtype)
    attn = model.blocks[1].attn
    seen = {}
    for name in ("hook_rot_q", "hook_z"):
        getattr(attn, name).add_hook(lambda x, hook, name=name: seen.__setitem__(name, x.detach()))
    prompts = torch.randint(0, 97, (3, 9))
    padding = torch.ones(3, 40, dtype=torch.bool)
    padding[1, :4] = False  # row 1 is left-padded: its first 4 slots are hidden
    model.setup_kv_cache(3, max_seq_len=40)
    with torch.no_grad():
        model.step(prompts, input_pos=torch.arange(9), attention_mask=padding)
        model.step(torch.randint(0, 97, (3, 1)), input_pos=torch.tensor([9]), attention_mask=padding)
    cache = model.kv_caches[1]
    q = seen["hook_rot_q"].transpose(1, 2).float()  # (B, nh, 1, hd)
    mask = padding[:, None, None, :].clone()  # (B, 1, 1, S): written slots 0..9, minus the padding
    mask[..., 10:] = False
    expected = F.scaled_dot_product_attention(q, cache.k.float(), cache.v.float(), attn_mask=mask,
                                              enable_gqa=n_kv_heads != 6)  # (B, nh, 1, hd)
    got = seen["hook_z"]
    assert got.dtype == dtype and got.shape == (3, 1, 6, 16)
    tolerance = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=2e-3, atol=2e-3)
    torch.testing.assert_close(got.float(), expected.transpose(1, 2), **tolerance)


@pytest.mark.parametrize("n_kv_heads", [6, 2, 1])
def test_the_compiled_spelling_equals_sdpa(n_kv_heads):
    # Under torch.compile the same attention is written as products and sums (inductor turns
    # them into loops over the cache instead of two bmm calls); aot_eager traces exactly that
    # branch without inductor's C++ build. Reference: torch's SDPA in float32, with a mask.
    cfg = ModelConfig(vocab_size=97, d_model=96, n_layers=1, n_heads=6, n_kv_heads=n_kv_heads, max_seq_len=64,
                      positions="rope", norm="rms", mlp="swiglu", d_mlp=128)
    attn = Transformer(cfg).blocks[0].attn
    g = torch.Generator().manual_seed(n_kv_heads)
    q = (torch.randn(3, 6, 1, 16, generator=g) * 3).bfloat16()  # (B, nh, 1, hd)
    k = (torch.randn(3, n_kv_heads, 40, 16, generator=g) * 3).bfloat16()  # (B, n_kv, S, hd)
    v = torch.randn(3, n_kv_heads, 40, 16, generator=g).bfloat16()
    mask = torch.rand(3, 1, 1, 40, generator=g) > 0.3  # (B, 1, 1, S)
    mask[..., 0] = True  # every row sees at least one key
    compiled = torch.compile(attn._single_query_attention, backend="aot_eager", fullgraph=True)
    got = compiled(q, k, v, mask)
    expected = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask,
                                              enable_gqa=n_kv_heads != 6, scale=attn.scale)
    assert got.dtype == torch.bfloat16 and got.shape == (3, 6, 1, 16)
    torch.testing.assert_close(got.float(), expected, rtol=1e-2, atol=1e-2)
    eager = attn._single_query_attention(q, k, v, mask)
    torch.testing.assert_close(got.float(), eager.float(), rtol=1e-2, atol=1e-2)
