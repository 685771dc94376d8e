"""Gemma 3 GGUF hyperparameters that llama.cpp reads in its own way, against transformers'
Gemma3ForCausalLM set up as llama.cpp runs the file (weights copied by hand, so transformers'
GGUF reader and its config defaults play no part):

- no ``gemma3.attention.sliding_window`` key (llama.cpp's converter omits it for all-global
  models such as Rnj-1), or a window of 0: every layer is global with ``rope.freq_base``
  (llama.cpp's ``found_swa && n_swa > 0`` test);
- the 62-layer 27B scales scores by 1/sqrt(d_model / n_heads), every other size by
  1/sqrt(head_dim) (llama.cpp's ``f_attention_scale``).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import lucidlm
from lucidlm.errors import GGUFError
from lucidlm.weights.gguf_config import config_from_metadata

from gemma3_gguf_toys import VOCAB, gemma_weights, write_gemma3_gguf

transformers = pytest.importorskip("transformers")

D_MLP, ROPE_GLOBAL, ROPE_LOCAL, EPS = 32, 1e6, 1e4, 1e-6


def transformers_gemma3(weights: dict[str, np.ndarray], n_layers: int, d_model: int, n_heads: int, n_kv: int,
                        head_dim: int, layer_types: list[str], window: int, query_pre_attn_scalar: int):
    """transformers' Gemma3ForCausalLM with the GGUF's weights (its norms hold w, the GGUF 1 + w)."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    config = Gemma3TextConfig(
        vocab_size=VOCAB, hidden_size=d_model, intermediate_size=D_MLP, num_hidden_layers=n_layers,
        num_attention_heads=n_heads, num_key_value_heads=n_kv, head_dim=head_dim, max_position_embeddings=256,
        rms_norm_eps=EPS, query_pre_attn_scalar=query_pre_attn_scalar, sliding_window=window,
        layer_types=layer_types, tie_word_embeddings=True,
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": ROPE_GLOBAL},
                         "sliding_attention": {"rope_type": "default", "rope_theta": ROPE_LOCAL}})
    t = {name: torch.from_numpy(value) for name, value in weights.items()}
    state = {"model.embed_tokens.weight": t["token_embd.weight"], "lm_head.weight": t["token_embd.weight"],
             "model.norm.weight": t["output_norm.weight"] - 1}
    norms = {"attn_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm",
             "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm",
             "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
    linears = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
               "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
               "ffn_down": "mlp.down_proj"}
    for i in range(n_layers):
        state |= {f"model.layers.{i}.{hf}.weight": t[f"blk.{i}.{ours}.weight"] - 1 for ours, hf in norms.items()}
        state |= {f"model.layers.{i}.{hf}.weight": t[f"blk.{i}.{ours}.weight"] for ours, hf in linears.items()}
    model = Gemma3ForCausalLM(config).eval()
    model.load_state_dict(state, strict=True)
    return model


def logits_of(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids) if isinstance(model, lucidlm.Transformer) else model(ids).logits


@pytest.mark.parametrize("window", [None, 0], ids=["no-key", "zero"])
def test_a_file_without_a_sliding_window_is_all_global(tmp_path, window):
    shape = dict(n_layers=7, d_model=32, n_heads=2, n_kv=1, head_dim=16)
    weights = gemma_weights(**shape, d_mlp=D_MLP)
    ours = lucidlm.load(write_gemma3_gguf(tmp_path / "global.gguf", weights, **shape, d_mlp=D_MLP,
                                          window=window, rope_base=ROPE_GLOBAL, eps=EPS))
    reference = transformers_gemma3(weights, **shape, layer_types=["full_attention"] * shape["n_layers"],
                                    window=4096, query_pre_attn_scalar=shape["head_dim"])
    ids = torch.randint(4, VOCAB, (2, 40), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(logits_of(ours, ids), logits_of(reference, ids), atol=1e-4, rtol=1e-4)
    assert ours.config.sliding_window is None
    assert not any(ours.config.layer_is_local(i) for i in range(shape["n_layers"]))


@pytest.mark.parametrize("n_layers, scalar", [(8, 16), (62, 24)], ids=["head_dim", "27B:d_model/n_heads"])
def test_the_attention_scale_follows_llama_cpp(tmp_path, n_layers, scalar):
    """d_model / n_heads = 48 / 2 = 24 differs from head_dim = 16: only the 62-layer file uses 24."""
    shape = dict(n_layers=n_layers, d_model=48, n_heads=2, n_kv=1, head_dim=16)
    weights = gemma_weights(**shape, d_mlp=D_MLP, seed=1)
    ours = lucidlm.load(write_gemma3_gguf(tmp_path / "scaled.gguf", weights, **shape, d_mlp=D_MLP, window=4,
                                          rope_base=ROPE_GLOBAL, eps=EPS))
    layer_types = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(n_layers)]
    reference = transformers_gemma3(weights, **shape, layer_types=layer_types, window=4,
                                    query_pre_attn_scalar=scalar)
    ids = torch.randint(4, VOCAB, (1, 12), generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(logits_of(ours, ids), logits_of(reference, ids), atol=1e-4, rtol=1e-4)
    assert ours.config.query_pre_attn_scalar == scalar


def test_a_27b_layout_with_fewer_dimensions_than_heads_is_refused():
    meta = {"general.architecture": "gemma3", "gemma3.embedding_length": 1, "gemma3.block_count": 62,
            "gemma3.feed_forward_length": 8, "gemma3.attention.head_count": 2, "gemma3.attention.key_length": 16,
            "gemma3.vocab_size": 8}
    with pytest.raises(GGUFError, match=r"bad\.gguf: .*62-layer.*embedding_length=1 below .*head_count=2"):
        config_from_metadata(meta, "bad.gguf")
