"""The standalone attention pieces (seed 004) against torch's own: the function against
``F.scaled_dot_product_attention``, the module against ``nn.MultiheadAttention``, for
self-attention and cross-attention with masks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lucidlm.errors import InputError
from lucidlm.model import MultiHeadAttention, scaled_dot_product_attention


def randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("T_q,T_k", [(5, 5), (3, 7)])
def test_function_matches_torch_with_and_without_a_mask(T_q, T_k):
    q, k, v = randn(2, 4, T_q, 16, seed=1), randn(2, 4, T_k, 16, seed=2), randn(2, 4, T_k, 8, seed=3)
    out, weights = scaled_dot_product_attention(q, k, v)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v))
    torch.testing.assert_close(weights.sum(-1), torch.ones(2, 4, T_q))
    mask = torch.rand(2, 1, T_q, T_k, generator=torch.Generator().manual_seed(4)) > 0.3
    mask[..., 0] = True  # every query sees at least one key
    out, weights = scaled_dot_product_attention(q, k, v, mask)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, attn_mask=mask))
    assert (weights[~mask.expand_as(weights)] == 0).all()


def test_seed004s_square_mask_is_cut_to_the_sequence():
    q = k = v = randn(1, 6, 8, seed=5)
    out, weights = scaled_dot_product_attention(q, k, v, torch.tril(torch.ones(32, 32)))
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, is_causal=True))
    assert torch.equal(weights[0].triu(1), torch.zeros(6, 6))


def test_torchs_additive_float_masks_are_added():
    """nn.Transformer's causal mask is float: 0 to attend, -inf not (and any float bias is
    added): read as 1/0 it was inverted, every allowed key blocked and every blocked one seen."""
    q, k, v = randn(2, 4, 6, 16, seed=6), randn(2, 4, 6, 16, seed=7), randn(2, 4, 6, 8, seed=8)
    causal = nn.Transformer.generate_square_subsequent_mask(6)
    bias = randn(6, 6, seed=9)
    for mask in (causal, bias, causal + bias):
        out, weights = scaled_dot_product_attention(q, k, v, mask)
        torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, attn_mask=mask))
    _, weights = scaled_dot_product_attention(q, k, v, causal)
    assert torch.equal(weights[..., 0, :], torch.tensor([1.0, 0, 0, 0, 0, 0]).expand(2, 4, 6))


def test_a_fully_masked_query_gets_zeros_not_nan():
    q = k = v = randn(1, 3, 4)
    mask = torch.tensor([[False, False, False], [True, False, False], [True, True, False]])
    out, weights = scaled_dot_product_attention(q, k, v, mask)
    assert torch.equal(out[0, 0], torch.zeros(4)) and not out.isnan().any()


def copy_into_torch(ours: MultiHeadAttention, kdim=None, vdim=None) -> nn.MultiheadAttention:
    d = ours.q_proj.out_features
    theirs = nn.MultiheadAttention(d, ours.n_heads, batch_first=True, kdim=kdim, vdim=vdim)
    with torch.no_grad():
        if theirs._qkv_same_embed_dim:
            theirs.in_proj_weight.copy_(torch.cat([ours.q_proj.weight, ours.k_proj.weight, ours.v_proj.weight]))
        else:
            theirs.q_proj_weight.copy_(ours.q_proj.weight)
            theirs.k_proj_weight.copy_(ours.k_proj.weight)
            theirs.v_proj_weight.copy_(ours.v_proj.weight)
        theirs.in_proj_bias.copy_(torch.cat([ours.q_proj.bias, ours.k_proj.bias, ours.v_proj.bias]))
        theirs.out_proj.weight.copy_(ours.o_proj.weight)
        theirs.out_proj.bias.copy_(ours.o_proj.bias)
    return theirs


def test_self_attention_with_a_causal_mask_matches_nn_multiheadattention():
    torch.manual_seed(0)
    ours = MultiHeadAttention(32, 4)
    theirs = copy_into_torch(ours)
    x = randn(2, 6, 32, seed=6)
    causal = torch.tril(torch.ones(6, 6, dtype=torch.bool))
    out, weights = ours(x, mask=causal, return_weights=True)
    expected, expected_weights = theirs(x, x, x, attn_mask=~causal, average_attn_weights=False)  # True = blocked
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(weights, expected_weights)


def test_cross_attention_with_other_widths_matches_nn_multiheadattention():
    torch.manual_seed(1)
    ours = MultiHeadAttention(32, 4, kdim=20, vdim=12)
    theirs = copy_into_torch(ours, kdim=20, vdim=12)
    decoder, memory_k, memory_v = randn(2, 5, 32, seed=7), randn(2, 9, 20, seed=8), randn(2, 9, 12, seed=9)
    padding = torch.ones(2, 9, dtype=torch.bool)
    padding[1, 6:] = False  # the second source sentence is 6 tokens long
    out = ours(decoder, memory_k, memory_v, mask=padding[:, None, None, :])
    expected, _ = theirs(decoder, memory_k, memory_v, key_padding_mask=~padding)
    torch.testing.assert_close(out, expected)
    assert out.shape == (2, 5, 32)


def test_mismatched_shapes_are_an_input_error():
    with pytest.raises(InputError, match="same last size"):
        scaled_dot_product_attention(randn(1, 2, 8), randn(1, 3, 4), randn(1, 3, 4))
