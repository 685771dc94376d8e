"""lucidlm's C loop for a float32 decode step's attention (quantization/kernels/decode_attention.c,
``torch.ops.lucidlm.decode_attention``) against torch's own SDPA computed in float64 on the same
q, k, v and mask, and its use by a compiled model on the CPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lucidlm.config import ModelConfig
from lucidlm.language_model import LanguageModel
from lucidlm.quantization import blocks_kernel


@pytest.fixture(autouse=True, scope="module")
def kernels_loaded():
    # built by scripts/install.sh on CI's machines (AVX-512 VNNI or AVX2): test_blocks_kernel.py says so
    assert blocks_kernel.available(), blocks_kernel.unavailable_reason()


def reference(q, k, v, mask, scale):
    """SDPA in float64: q (B, H, G, D) grouped by kv head -> (B, H, G, D)."""
    B, H, G, D = q.shape
    z = F.scaled_dot_product_attention(q.double().reshape(B, H * G, 1, D), k.double(), v.double(),
                                       attn_mask=mask[:, None, None, :], enable_gqa=G > 1, scale=scale)
    return z.reshape(B, H, G, D)


@pytest.mark.parametrize("B,H,G,D,S", [(1, 3, 3, 64, 128), (3, 2, 4, 72, 37), (2, 1, 1, 128, 9), (8, 3, 3, 64, 256),
                                       (1, 4, 2, 8, 5)])
def test_equals_sdpa_over_a_cache_slice_with_padding_and_gaps(B, H, G, D, S):
    g = torch.Generator().manual_seed(B * 1000 + S)
    q = torch.randn(B, H, G, D, generator=g) * 2
    cache_k = torch.randn(B, H, S + 11, D, generator=g) * 2  # the cache is longer: attend over a slice of it
    cache_v = torch.randn(B, H, S + 11, D, generator=g)
    k, v = cache_k[:, :, :S], cache_v[:, :, :S]
    mask = torch.rand(B, S, generator=g) > 0.25
    mask[:, -1] = True  # the new token sees itself
    mask[0, : S // 3] = False  # row 0 left-padded
    got = torch.ops.lucidlm.decode_attention(q, k, v, mask, 0.3)
    assert got.dtype == torch.float32 and got.shape == (B, H, G, D)
    torch.testing.assert_close(got.double(), reference(q, k, v, mask, 0.3), rtol=1e-5, atol=1e-5)


def test_keys_with_their_own_slot_stride_and_a_row_that_sees_nothing():
    g = torch.Generator().manual_seed(7)
    B, H, G, D, S = 2, 3, 2, 16, 12
    q = torch.randn(B, H, G, D, generator=g)
    k = torch.randn(B, S, H, D, generator=g).transpose(1, 2)  # (B, H, S, D), slots H * D apart
    v = torch.randn(B, S, H, D, generator=g).transpose(1, 2)
    mask = torch.ones(B, S, dtype=torch.bool)
    mask[1] = False  # row 1 may attend nowhere: NaN, as a softmax over nothing is in torch
    got = torch.ops.lucidlm.decode_attention(q, k, v, mask, 0.25)
    torch.testing.assert_close(got[0].double(), reference(q, k, v, mask, 0.25)[0], rtol=1e-5, atol=1e-5)
    assert torch.isnan(got[1]).all()


def test_refuses_what_it_cannot_read():
    q, k, v, mask = torch.randn(1, 2, 2, 16), torch.randn(1, 2, 5, 16), torch.randn(1, 2, 5, 16), torch.ones(1, 5, dtype=torch.bool)
    with pytest.raises(RuntimeError, match="float32"):
        torch.ops.lucidlm.decode_attention(q.bfloat16(), k, v, mask, 1.0)
    with pytest.raises(RuntimeError, match="multiple of 8"):
        torch.ops.lucidlm.decode_attention(q[..., :12], k[..., :12], v[..., :12], mask, 1.0)
    with pytest.raises(RuntimeError, match="shapes do not agree"):
        torch.ops.lucidlm.decode_attention(q, k, v, torch.ones(1, 4, dtype=torch.bool), 1.0)


def tiny_model(n_kv_heads: int = 2) -> LanguageModel:
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=40, d_model=64, n_layers=2, n_heads=4, n_kv_heads=n_kv_heads, max_seq_len=64,
                      positions="rope", norm="rms", mlp="swiglu", d_mlp=96)
    return LanguageModel(cfg).eval()


def test_compile_switches_it_on_on_the_cpu_and_a_decode_step_equals_the_eager_one():
    model = tiny_model()
    assert not any(m.decode_kernel for m in model.modules() if hasattr(m, "decode_kernel"))
    eager = tiny_model()
    model.compile(backend="eager")  # dynamo's tracing without inductor's build: the op runs as such
    assert all(block.attn.decode_kernel for block in model.blocks)
    prompts = [[1, 5, 9, 2, 7], [3, 3, 8]]  # the second row is left-padded
    from lucidlm.generation import generate_batch
    got = generate_batch(model, prompts, max_new_tokens=12, temperature=0, stop_on_eos=False)
    want = generate_batch(eager, prompts, max_new_tokens=12, temperature=0, stop_on_eos=False)
    assert [r.token_ids for r in got] == [r.token_ids for r in want]


def test_a_layers_decode_attention_goes_through_the_kernel_and_equals_sdpa(monkeypatch):
    model = tiny_model(n_kv_heads=1)
    attn = model.blocks[0].attn
    attn.decode_kernel = True
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, 1, 16, generator=g)  # (B, nh, 1, hd)
    k, v = torch.randn(2, 1, 20, 16, generator=g), torch.randn(2, 1, 20, 16, generator=g)
    mask = torch.ones(2, 1, 1, 20, dtype=torch.bool)
    mask[1, ..., :6] = False
    calls, real = [], torch.ops.lucidlm.decode_attention
    monkeypatch.setattr(torch.ops.lucidlm, "decode_attention", lambda *args: calls.append(args[0].shape) or real(*args))
    got = attn._fused_attention(q, k, v, mask, 0.0, grouped=True)
    assert calls == [(2, 1, 4, 16)]
    expected = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=mask, enable_gqa=True,
                                              scale=attn.scale)
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5)


def test_off_where_the_kernels_are_not_available(monkeypatch):
    monkeypatch.setattr(blocks_kernel, "available", lambda: False)
    model = tiny_model()
    assert blocks_kernel.use_cpu_loops(model) is False
    assert not any(block.attn.decode_kernel for block in model.blocks)


def test_the_embedded_default_takes_it_eagerly_and_the_exact_float_path_does_not():
    import lucidlm
    from lucidlm.generation import generate_batch

    default = lucidlm.load()  # Q4_1 layers on lucidlm's kernels
    layers = [block.attn for block in default.blocks]
    assert all(layer.decode_kernel for layer in layers)
    assert not any(block.attn.decode_kernel for block in lucidlm.load(dtype="float32").blocks)
    prompts = [default.tokenizer.encode("The capital of France is"), default.tokenizer.encode("def fib(n):")]
    for block in default.blocks:
        block.decode_kernel = False  # each layer through its module (test_decode_block.py covers the one-call step)
    got = generate_batch(default, prompts, max_new_tokens=24, temperature=0, stop_on_eos=False)
    for layer in layers:
        layer.decode_kernel = False  # SDPA, as before the loader switched the loop on
    want = generate_batch(default, prompts, max_new_tokens=24, temperature=0, stop_on_eos=False)
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
