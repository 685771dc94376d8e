"""Tiny random Gemma 3 GGUF files, written the way llama.cpp's converter writes them, for the
tests that read one with lucidlm and compare it with transformers: a byte-fallback vocabulary of
270 tokens and Gemma 3's tensor names, every size chosen by the test."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import gguf
import numpy as np

PIECES = ["\u2581", "a", "b", "c", "\u2581a", "ab", "\u2581ab", "bc", "<start_of_turn>", "<end_of_turn>"]
TOKENS = ["<pad>", "<eos>", "<bos>", "<unk>", *(f"<0x{b:02X}>" for b in range(256)), *PIECES]
VOCAB = len(TOKENS)


def gemma_weights(n_layers: int, d_model: int, n_heads: int, n_kv: int, head_dim: int, d_mlp: int, seed: int = 0,
                  drop: Optional[str] = None) -> dict[str, np.ndarray]:
    """Random float32 weights under Gemma 3's GGUF names, less ``drop``. Norm weights hover
    around 1: the GGUF stores Gemma's (1 + weight)."""
    g = np.random.default_rng(seed)

    def mat(out_dim: int, in_dim: int) -> np.ndarray:
        return (g.standard_normal((out_dim, in_dim)) / np.sqrt(in_dim)).astype(np.float32)

    def scale(dim: int) -> np.ndarray:
        return (1.0 + 0.2 * g.standard_normal(dim)).astype(np.float32)

    w = {"token_embd.weight": (g.standard_normal((VOCAB, d_model)) * 0.5).astype(np.float32),
         "output_norm.weight": scale(d_model)}
    for i in range(n_layers):
        w |= {
            f"blk.{i}.attn_norm.weight": scale(d_model),
            f"blk.{i}.attn_q.weight": mat(n_heads * head_dim, d_model),
            f"blk.{i}.attn_k.weight": mat(n_kv * head_dim, d_model),
            f"blk.{i}.attn_v.weight": mat(n_kv * head_dim, d_model),
            f"blk.{i}.attn_q_norm.weight": scale(head_dim),
            f"blk.{i}.attn_k_norm.weight": scale(head_dim),
            f"blk.{i}.attn_output.weight": mat(d_model, n_heads * head_dim),
            f"blk.{i}.post_attention_norm.weight": scale(d_model),
            f"blk.{i}.ffn_norm.weight": scale(d_model),
            f"blk.{i}.ffn_gate.weight": mat(d_mlp, d_model),
            f"blk.{i}.ffn_up.weight": mat(d_mlp, d_model),
            f"blk.{i}.ffn_down.weight": mat(d_model, d_mlp),
            f"blk.{i}.post_ffw_norm.weight": scale(d_model),
        }
    w.pop(drop, None)
    return w


def write_gemma3_gguf(path: Path, weights: dict[str, np.ndarray], n_layers: int, d_model: int, n_heads: int,
                      n_kv: int, head_dim: int, d_mlp: int, window: Optional[int], rope_base: float = 1e6,
                      eps: float = 1e-6, linear_rope_factor: Optional[float] = None) -> Path:
    """A gemma3 GGUF holding ``weights``; ``window=None`` leaves the sliding-window key out;
    ``linear_rope_factor`` writes rope.scaling (the 4B and larger models scale by 8)."""
    w = gguf.GGUFWriter(str(path), "gemma3")
    w.add_context_length(256)
    w.add_embedding_length(d_model)
    w.add_block_count(n_layers)
    w.add_feed_forward_length(d_mlp)
    w.add_head_count(n_heads)
    w.add_head_count_kv(n_kv)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_freq_base(rope_base)
    w.add_layer_norm_rms_eps(eps)
    if window is not None:
        w.add_sliding_window(window)
    if linear_rope_factor is not None:
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(linear_rope_factor)
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(TOKENS)
    w.add_token_scores([0.0] * VOCAB)
    w.add_token_types([3, 3, 3, 2] + [6] * 256 + [1] * 8 + [3, 3])
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    w.add_unk_token_id(3)
    w.add_pad_token_id(0)
    w.add_add_bos_token(True)
    for name, value in weights.items():
        w.add_tensor(name, value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
