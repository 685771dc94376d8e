"""RoPE layouts: ``half`` matches Hugging Face's rotate_half, ``interleaved`` matches seed 001's
complex-number form, and the Q/K row permutation turns one into the other exactly."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from lucidlm.config import ModelConfig
from lucidlm.model.positions import (
    RotaryEmbedding,
    apply_rope_complex,
    permute_qk_to_half,
    permute_qk_to_interleaved,
    rope_angles,
)
from lucidlm.model.transformer import Transformer

HEAD_DIM = 64
MAX_LEN = 1024


def _positions(T: int, seed: int) -> torch.Tensor:
    """(2, T): one row counting up, one shuffled (positions need not be sorted, e.g. padding)."""
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.arange(T), torch.randperm(T, generator=g)])


def _qk(T: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, T, 4, HEAD_DIM, generator=g), torch.randn(2, T, 2, HEAD_DIM, generator=g)  # (B, T, nh, hd)


def _hf_rotate(q, k, cos, sin):
    hq, hk = apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin)  # HF wants (B, nh, T, hd)
    return hq.transpose(1, 2), hk.transpose(1, 2)


@pytest.mark.parametrize("theta", [10000.0, 500000.0])
@pytest.mark.parametrize("T", [16, 512])
def test_half_matches_hf_apply_rotary_pos_emb(theta, T):
    """The layout: HF's rotate_half formula with exact (float64) angles, over 512 positions."""
    q, k = _qk(T, seed=1)
    positions = _positions(T, seed=2)
    angles = rope_angles(MAX_LEN, HEAD_DIM, theta)[positions]  # (B, T, hd/2), float64
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()  # HF duplicates halves
    want_q, want_k = _hf_rotate(q.double(), k.double(), cos, sin)
    rope = RotaryEmbedding(HEAD_DIM, MAX_LEN, theta, "half")
    assert_close(rope(q, positions), want_q.float())
    assert_close(rope(k, positions), want_k.float())


@pytest.mark.parametrize("theta", [10000.0, 500000.0])
def test_half_matches_hf_llama_rotary_embedding(theta):
    """End to end with HF's own cos/sin table (LlamaRotaryEmbedding)."""
    hf_rope = LlamaRotaryEmbedding(LlamaConfig(hidden_size=4 * HEAD_DIM, num_attention_heads=4, rope_theta=theta,
                                               max_position_embeddings=MAX_LEN))
    rope = RotaryEmbedding(HEAD_DIM, MAX_LEN, theta, "half")
    q, k = _qk(512, seed=3)
    positions = _positions(512, seed=4)
    want_q, want_k = _hf_rotate(q, k, *hf_rope(q, positions))
    short = positions < 64  # (B, T): where float32 angles are still exact to ~1e-6
    assert_close(rope(q, positions)[short], want_q[short])
    assert_close(rope(k, positions)[short], want_k[short])
    # HF rounds each angle m*theta_i to float32 (error ~ m * 2^-24 rad, so ~3e-5 at m=511);
    # we compute angles in float64. Far positions agree to that bound, not to fp32 epsilon.
    assert_close(rope(q, positions), want_q, atol=2e-4, rtol=0)
    assert_close(rope(k, positions), want_k, atol=2e-4, rtol=0)


@pytest.mark.parametrize("theta", [10000.0, 500000.0])
def test_interleaved_matches_complex_form(theta):
    q, _ = _qk(512, seed=5)
    positions = _positions(512, seed=6)
    rope = RotaryEmbedding(HEAD_DIM, MAX_LEN, theta, "interleaved")
    assert_close(rope(q, positions), apply_rope_complex(q, positions, theta))


def test_layouts_differ_without_permutation():
    """Guard for the tests below: the two variants really are different functions."""
    q, _ = _qk(32, seed=7)
    positions = _positions(32, seed=8)
    half = RotaryEmbedding(HEAD_DIM, MAX_LEN, 10000.0, "half")(q, positions)
    interleaved = RotaryEmbedding(HEAD_DIM, MAX_LEN, 10000.0, "interleaved")(q, positions)
    assert (half - interleaved).abs().max() > 0.5


def test_permute_round_trip_is_exact():
    g = torch.Generator().manual_seed(9)
    weight, bias = torch.randn(4 * HEAD_DIM, 96, generator=g), torch.randn(4 * HEAD_DIM, generator=g)
    for t in (weight, bias):
        there = permute_qk_to_interleaved(t, 4)
        assert not torch.equal(there, t)
        assert torch.equal(permute_qk_to_half(there, 4), t)
        assert torch.equal(permute_qk_to_interleaved(permute_qk_to_half(t, 4), 4), t)


def _llama_like(rope_variant: str) -> ModelConfig:
    return ModelConfig(vocab_size=97, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_mlp=96, max_seq_len=256,
                       positions="rope", rope_variant=rope_variant, rope_theta=10000.0, norm="rms", mlp="swiglu",
                       attn_bias=True)


def _with_qk_permuted(model: Transformer, permute, variant: str) -> Transformer:
    cfg = model.config
    other = Transformer(cfg.replace(rope_variant=variant)).eval()
    state = dict(model.state_dict())
    for i in range(cfg.n_layers):
        for p, heads in (("q", cfg.n_heads), ("k", cfg.n_kv_heads)):
            for kind in ("weight", "bias"):
                key = f"blocks.{i}.attn.{p}_proj.{kind}"
                state[key] = permute(state[key], heads)
    other.load_state_dict(state)
    return other


def test_permuting_qk_and_switching_variant_keeps_logits():
    torch.manual_seed(10)
    half = Transformer(_llama_like("half")).eval()
    with torch.no_grad():
        for name, p in half.named_parameters():  # weights large enough that positions matter
            if p.ndim == 2:
                p.normal_(0.0, 0.15)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.1)
    ids = torch.randint(0, 97, (2, 200))
    with torch.no_grad():
        want = half(ids)
        interleaved = _with_qk_permuted(half, permute_qk_to_interleaved, "interleaved")
        assert_close(interleaved(ids), want)
        back = _with_qk_permuted(interleaved, permute_qk_to_half, "half")
        for name, tensor in half.state_dict().items():
            assert torch.equal(back.state_dict()[name], tensor), name
        # Switching the variant without permuting is a different model (a long input tells).
        unpermuted = Transformer(half.config.replace(rope_variant="interleaved")).eval()
        unpermuted.load_state_dict(half.state_dict())
        assert (unpermuted(ids) - want).abs().max() > 1e-2


@pytest.mark.parametrize("variant", ["half", "interleaved"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotation_equals_the_split_form_bit_for_bit(variant, dtype):
    """apply_rope spells each pair's rotation as x * cos + partner * signed sin; it must give
    exactly the floats of the textbook form (x1 cos - x2 sin, x1 sin + x2 cos), computed here
    from the float64 angles rounded to float32 as the table is."""
    q, _ = _qk(64, seed=11)
    q = q.to(dtype)
    positions = _positions(64, seed=12)
    rope = RotaryEmbedding(HEAD_DIM, MAX_LEN, 10000.0, variant)
    angles = rope_angles(MAX_LEN, HEAD_DIM, 10000.0)[positions].unsqueeze(2)  # (B, T, 1, hd/2)
    cos, sin = angles.cos().float(), angles.sin().float()
    x = q.float()
    if variant == "half":
        x1, x2 = x[..., :HEAD_DIM // 2], x[..., HEAD_DIM // 2:]
        want = torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)
    else:
        x1, x2 = x[..., 0::2], x[..., 1::2]
        want = torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).flatten(-2)
    assert torch.equal(rope(q, positions), want.to(dtype))
