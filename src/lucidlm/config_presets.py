"""The named model presets, as plain data: one dict of ``ModelConfig`` fields per name.

Data only, so that adding a preset touches no code; ``config.preset(name)`` builds one (and
checks it), and ``config.py`` re-exports ``PRESETS``.
"""

from __future__ import annotations

from typing import Any

PRESETS: dict[str, dict[str, Any]] = {
    # OpenAI GPT-2 small (124M): learned positions, pre-LayerNorm, GELU(tanh), biases, tied.
    "gpt2": dict(
        name="gpt2", vocab_size=50257, d_model=768, n_layers=12, n_heads=12, max_seq_len=1024,
        positions="learned", norm="layer", norm_eps=1e-5, mlp="gelu_tanh", attn_bias=True,
        mlp_bias=True, tie_embeddings=True,
    ),
    # A LLaMA-3-style architecture at a size that trains on a laptop: RoPE (theta 500k),
    # RMSNorm, SwiGLU with multiple_of rounding, grouped-query attention, untied head.
    "llama": dict(
        name="llama", vocab_size=32000, d_model=512, n_layers=8, n_heads=8, n_kv_heads=2,
        max_seq_len=2048, positions="rope", rope_theta=500000.0, norm="rms", norm_eps=1e-5,
        mlp="swiglu", multiple_of=256,
    ),
    # Meta's Llama 3 8B shape (for reading; instantiating it needs ~32 GB in fp32).
    "llama3-8b": dict(
        name="llama", vocab_size=128256, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8,
        max_seq_len=8192, positions="rope", rope_theta=500000.0, norm="rms", norm_eps=1e-5,
        mlp="swiglu", multiple_of=1024, ffn_dim_multiplier=1.3,
    ),
    # SmolLM2-135M: the embedded pretrained model (LLaMA family, GQA 9/3, tied embeddings).
    "smollm2-135m": dict(
        name="llama", vocab_size=49152, d_model=576, n_layers=30, n_heads=9, n_kv_heads=3,
        head_dim=64, d_mlp=1536, max_seq_len=8192, positions="rope", rope_theta=100000.0,
        norm="rms", norm_eps=1e-5, mlp="swiglu", tie_embeddings=True,
    ),
    # Gemma 3 270M (Google): 5 sliding-window layers (512 tokens, RoPE base 10k) then one
    # global layer (base 1M); RMSNorm before and after each sub-layer and on each q/k head;
    # GeGLU; embeddings scaled by sqrt(d_model); one key/value head; tied embeddings.
    "gemma3-270m": dict(
        name="gemma3", vocab_size=262144, d_model=640, n_layers=18, n_heads=4, n_kv_heads=1, head_dim=256,
        d_mlp=2048, max_seq_len=32768, positions="rope", rope_theta=1000000.0, rope_local_theta=10000.0,
        sliding_window=512, global_layer_every=6, query_pre_attn_scalar=256.0, qk_norm=True,
        post_sublayer_norm=True, norm="rms", norm_eps=1e-6, mlp="geglu", tie_embeddings=True,
        scale_embeddings=True,
    ),
    # Seed 000's NumPy practice model: split RoPE, post-RMSNorm without eps or learned
    # scale in the reference, ReLU MLP 4x wide, no biases; one layer; logits through the
    # (tied) embedding matrix.
    "seed000": dict(
        name="seed000", vocab_size=32768, d_model=512, n_layers=1, n_heads=4, head_dim=64,
        d_mlp=2048, max_seq_len=256, positions="rope", rope_variant="half", rope_theta=10000.0,
        norm="rms", norm_eps=0.0, norm_position="post", final_norm=False, mlp="relu",
        tie_embeddings=True,
    ),
    # nanoGPT's documented CPU Shakespeare run (character level).
    "shakespeare-char": dict(
        name="gpt", vocab_size=65, d_model=128, n_layers=4, n_heads=4, max_seq_len=64,
        positions="learned", norm="layer", norm_bias=False, mlp="gelu", tie_embeddings=True,
        dropout=0.0,
    ),
    # Seed 004's word-level Shakespeare model: sinusoidal positions, add & norm (post-norm
    # LayerNorm), GELU MLP widened 2x, biases everywhere, separate prediction layer.
    "seed004-words": dict(
        name="seed004", vocab_size=25670, d_model=128, n_layers=1, n_heads=4, d_mlp=256,
        max_seq_len=64, positions="sinusoidal", norm="layer", norm_eps=1e-6, norm_position="post",
        final_norm=False, mlp="gelu_tanh", attn_bias=True, mlp_bias=True, unembed_bias=True, init="lecun",
    ),
}


__all__ = ["PRESETS"]
