"""Gemma 3 on a tiny random GGUF written here: lucidlm and transformers read the same file
and agree, with a prompt three times the sliding window so both local and global layers
matter; a file missing a tensor is refused with the tensor's name.

Fast stand-in for the real 270M file (tests/families/test_gemma3_parity.py): 7 layers give
local layers 0-4 and 6 and the global layer 5, with a window of 8 tokens.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

import lucidlm
from lucidlm.errors import MissingTensorError
from lucidlm.weights.gguf import load_gguf

D_MODEL, N_HEADS, N_KV, HEAD_DIM, D_MLP, N_LAYERS, WINDOW = 64, 2, 1, 256, 128, 7, 8
PIECES = ["\u2581", "a", "b", "c", "\u2581a", "ab", "\u2581ab", "bc", "<start_of_turn>", "<end_of_turn>"]
TOKENS = ["<pad>", "<eos>", "<bos>", "<unk>", *(f"<0x{b:02X}>" for b in range(256)), *PIECES]
VOCAB = len(TOKENS)


def gemma_weights(seed: int = 0, drop: str | None = None) -> dict[str, np.ndarray]:
    """Random float32 weights under Gemma 3's GGUF names. Norm weights hover around 1: the
    GGUF stores Gemma's (1 + weight)."""
    g = np.random.default_rng(seed)

    def mat(out_dim: int, in_dim: int) -> np.ndarray:
        return (g.standard_normal((out_dim, in_dim)) / np.sqrt(in_dim)).astype(np.float32)

    def scale(dim: int) -> np.ndarray:
        return (1.0 + 0.2 * g.standard_normal(dim)).astype(np.float32)

    w = {"token_embd.weight": (g.standard_normal((VOCAB, D_MODEL)) * 0.5).astype(np.float32),
         "output_norm.weight": scale(D_MODEL)}
    for i in range(N_LAYERS):
        w |= {
            f"blk.{i}.attn_norm.weight": scale(D_MODEL),
            f"blk.{i}.attn_q.weight": mat(N_HEADS * HEAD_DIM, D_MODEL),
            f"blk.{i}.attn_k.weight": mat(N_KV * HEAD_DIM, D_MODEL),
            f"blk.{i}.attn_v.weight": mat(N_KV * HEAD_DIM, D_MODEL),
            f"blk.{i}.attn_q_norm.weight": scale(HEAD_DIM),
            f"blk.{i}.attn_k_norm.weight": scale(HEAD_DIM),
            f"blk.{i}.attn_output.weight": mat(D_MODEL, N_HEADS * HEAD_DIM),
            f"blk.{i}.post_attention_norm.weight": scale(D_MODEL),
            f"blk.{i}.ffn_norm.weight": scale(D_MODEL),
            f"blk.{i}.ffn_gate.weight": mat(D_MLP, D_MODEL),
            f"blk.{i}.ffn_up.weight": mat(D_MLP, D_MODEL),
            f"blk.{i}.ffn_down.weight": mat(D_MODEL, D_MLP),
            f"blk.{i}.post_ffw_norm.weight": scale(D_MODEL),
        }
    w.pop(drop, None)
    return w


def write_gemma3_gguf(path: Path, drop: str | None = None) -> Path:
    writer = gguf.GGUFWriter(str(path), "gemma3")
    writer.add_context_length(256)
    writer.add_embedding_length(D_MODEL)
    writer.add_block_count(N_LAYERS)
    writer.add_feed_forward_length(D_MLP)
    writer.add_head_count(N_HEADS)
    writer.add_head_count_kv(N_KV)
    writer.add_key_length(HEAD_DIM)
    writer.add_value_length(HEAD_DIM)
    writer.add_rope_freq_base(1000000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_sliding_window(WINDOW)
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(TOKENS)
    writer.add_token_scores([0.0] * VOCAB)
    writer.add_token_types([3, 3, 3, 2] + [6] * 256 + [1] * 8 + [3, 3])
    writer.add_bos_token_id(2)
    writer.add_eos_token_id(1)
    writer.add_unk_token_id(3)
    writer.add_pad_token_id(0)
    writer.add_add_bos_token(True)
    for name, value in gemma_weights(drop=drop).items():
        writer.add_tensor(name, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def tiny_gemma(tmp_path_factory):
    path = write_gemma3_gguf(tmp_path_factory.mktemp("gemma") / "tiny-gemma3.gguf")
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
    path = write_gemma3_gguf(tmp_path / "broken.gguf", drop="blk.3.attn_k_norm.weight")
    with pytest.raises(MissingTensorError, match=r"blocks\.3\.attn\.k_norm\.weight"):
        load_gguf(path)
