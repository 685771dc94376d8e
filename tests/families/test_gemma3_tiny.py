"""Gemma 3 on a tiny random GGUF written here: lucidlm and transformers read the same file
and agree, with a prompt three times the sliding window so both local and global layers
matter; a file missing a tensor is refused with the tensor's name.

Fast stand-in for the real 270M file (tests/families/test_gemma3_parity.py): 7 layers give
local layers 0-4 and 6 and the global layer 5, with a window of 8 tokens.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

import lucidlm
from lucidlm.errors import MissingTensorError
from lucidlm.weights.gguf import load_gguf

from gemma3_gguf_toys import VOCAB, gemma_weights, write_gemma3_gguf

D_MODEL, N_HEADS, N_KV, HEAD_DIM, D_MLP, N_LAYERS, WINDOW = 64, 2, 1, 256, 128, 7, 8


def write_tiny(path: Path, drop: str | None = None) -> Path:
    shape = dict(n_layers=N_LAYERS, d_model=D_MODEL, n_heads=N_HEADS, n_kv=N_KV, head_dim=HEAD_DIM, d_mlp=D_MLP)
    return write_gemma3_gguf(path, gemma_weights(**shape, drop=drop), **shape, window=WINDOW)


@pytest.fixture(scope="module")
def tiny_gemma(tmp_path_factory):
    path = write_tiny(tmp_path_factory.mktemp("gemma") / "tiny-gemma3.gguf")
    from transformers import AutoModelForCausalLM

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reference = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                         dtype=torch.float32).eval()
    return path, lucidlm.load(path), reference


def test_config_has_gemma3s_layer_pattern(tiny_gemma):
    _, ours, reference = tiny_gemma
    cfg = ours.config
    local = ["sliding_attention" if cfg.layer_is_local(i) else "full_attention" for i in range(N_LAYERS)]
    assert local == list(reference.config.layer_types)
    assert cfg.sliding_window == reference.config.sliding_window == WINDOW
    assert (cfg.rope_theta, cfg.rope_local_theta) == (1e6, 1e4)
    assert cfg.query_pre_attn_scalar == reference.config.query_pre_attn_scalar


def test_logits_match_transformers_past_the_sliding_window(tiny_gemma):
    _, ours, reference = tiny_gemma
    ids = torch.randint(0, VOCAB, (2, 3 * WINDOW), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = reference(ids).logits
        got = ours(ids)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    # the window matters: a global-only model would give other logits at the end
    with torch.no_grad():
        wide = lucidlm.Transformer(ours.config.replace(sliding_window=None, global_layer_every=None))
        wide.load_state_dict(ours.state_dict())
        assert (wide(ids)[:, -1] - expected[:, -1]).abs().max() > 1e-2


def test_cached_greedy_decoding_matches_transformers(tiny_gemma):
    _, ours, reference = tiny_gemma
    prompt = torch.randint(4, VOCAB, (1, 2 * WINDOW + 3), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = reference.generate(prompt, max_new_tokens=12, do_sample=False, eos_token_id=None,
                                      pad_token_id=0)[0, prompt.shape[1]:].tolist()
    got = ours.generate(prompt[0].tolist(), max_new_tokens=12, temperature=0, stop_on_eos=False).token_ids
    assert got == expected


def test_a_missing_tensor_is_named(tmp_path):
    path = write_tiny(tmp_path / "broken.gguf", drop="blk.3.attn_k_norm.weight")
    with pytest.raises(MissingTensorError, match=r"blocks\.3\.attn\.k_norm\.weight"):
        load_gguf(path)
