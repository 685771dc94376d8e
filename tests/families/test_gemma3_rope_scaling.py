"""Gemma 3 4B and larger scale RoPE linearly by 8 in their global layers only: llama.cpp reads
``gemma3.rope.scaling.*`` for the global layers and keeps the sliding-window layers unscaled
(``rope_freq_scale_train_swa = 1``), as transformers' Gemma3 applies ``rope_parameters`` per
layer type. Reference: transformers' Gemma3ForCausalLM on the file's weights."""

from __future__ import annotations

import torch

import lucidlm
from lucidlm.model.positions import RotaryEmbedding
from lucidlm.model.transformer import Transformer

from gemma3_gguf_toys import VOCAB, gemma_weights, write_gemma3_gguf
from test_gemma3_gguf_edges4 import D_MLP, EPS, ROPE_GLOBAL, ROPE_LOCAL, logits_of, transformers_gemma3

SHAPE = dict(n_layers=7, d_model=32, n_heads=2, n_kv=1, head_dim=16)
WINDOW = 8


def test_linear_scaling_turns_only_the_global_layers(tmp_path):
    weights = gemma_weights(**SHAPE, d_mlp=D_MLP)
    ours = lucidlm.load(write_gemma3_gguf(tmp_path / "scaled.gguf", weights, **SHAPE, d_mlp=D_MLP, window=WINDOW,
                                          rope_base=ROPE_GLOBAL, eps=EPS, linear_rope_factor=8.0))
    assert ours.config.rope_scaling == {"rope_type": "linear", "factor": 8.0}
    layer_types = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(SHAPE["n_layers"])]
    reference = transformers_gemma3(weights, **SHAPE, layer_types=layer_types, window=WINDOW,
                                    query_pre_attn_scalar=SHAPE["head_dim"])
    reference.config.rope_parameters["full_attention"].update(rope_type="linear", factor=8.0)
    reference.model.rotary_emb.__init__(reference.config)  # the tables again, from the scaled parameters
    ids = torch.randint(4, VOCAB, (2, 40), generator=torch.Generator().manual_seed(0))
    expected = logits_of(reference, ids)
    torch.testing.assert_close(logits_of(ours, ids), expected, atol=1e-4, rtol=1e-4)
    # a reading that scaled no layer, or the sliding ones too, differs
    unscaled = Transformer(ours.config.replace(rope_scaling=None))
    unscaled.load_state_dict(ours.state_dict())
    all_scaled = Transformer(ours.config)
    all_scaled.load_state_dict(ours.state_dict())
    all_scaled.rotary_local = RotaryEmbedding(SHAPE["head_dim"], ours.config.max_seq_len, ROPE_LOCAL,
                                              ours.config.rope_variant, ours.config.rope_scaling)
    for wrong in (unscaled, all_scaled):
        assert (logits_of(wrong.eval(), ids) - expected).abs().max() > 1e-2
