"""Seed 000's NumPy forward pass, kept as an oracle for the torch model.

The practice model of seed 000 ("Implementing an LLM's forward pass"): embedding lookup;
einsum Q/K/V projections with (model_dim, heads, head_dim) weights; split ("rotate_half")
RoPE; causal softmax attention; an output projection of shape (heads, head_dim,
model_dim); residual + RMS post-norm; a ReLU MLP with its residual + RMS post-norm.
Generalised here to N layers and a final unembedding (tied to the embedding matrix unless
one is given). Everything is computed in float64 so the reference is the accurate side.

``practice_weights`` draws weights exactly as the seed draws them (standard normal, stored
as float16), and ``to_state_dict`` hands the same numbers to ``Transformer(preset("seed000"))``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np


@dataclass
class PracticeLayer:
    q: np.ndarray  # (model_dim, heads, head_dim)
    k: np.ndarray  # (model_dim, heads, head_dim)
    v: np.ndarray  # (model_dim, heads, head_dim)
    out: np.ndarray  # (heads, head_dim, model_dim): the seed's "upproj_weights"
    w0: np.ndarray  # (model_dim, hidden_dim)
    w1: np.ndarray  # (hidden_dim, model_dim)


@dataclass
class PracticeWeights:
    vocab: np.ndarray  # (vocab_size, model_dim)
    layers: list[PracticeLayer]
    unembed: Optional[np.ndarray] = None  # (vocab_size, model_dim); None -> use vocab


def practice_weights(n_layers: int = 1, vocab_size: int = 32768, model_dim: int = 512, num_heads: int = 4,
                     head_dim: int = 64, hidden_dim: Optional[int] = None, seed: int = 0) -> PracticeWeights:
    """Weights drawn as seed 000 draws them: np.random.normal(...).astype(np.float16)."""
    rng = np.random.default_rng(seed)
    hidden_dim = hidden_dim or 4 * model_dim

    def normal(*shape: int) -> np.ndarray:
        return rng.normal(size=shape).astype(np.float16)

    vocab = normal(vocab_size, model_dim)
    layers = [
        PracticeLayer(
            q=normal(model_dim, num_heads, head_dim), k=normal(model_dim, num_heads, head_dim),
            v=normal(model_dim, num_heads, head_dim), out=normal(num_heads, head_dim, model_dim),
            w0=normal(model_dim, hidden_dim), w1=normal(hidden_dim, model_dim),
        )
        for _ in range(n_layers)
    ]
    return PracticeWeights(vocab=vocab, layers=layers)


# -- the forward pass, one function per step of the seed ---------------------------------

def embeddings_lookup(input_ids: np.ndarray, vocab: np.ndarray) -> np.ndarray:
    return vocab[input_ids]  # (seq, model_dim)


def qkv_proj(x: np.ndarray, layer: PracticeLayer) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    q = np.einsum("sd,dnh->snh", x, layer.q)  # (seq, heads, head_dim)
    k = np.einsum("sd,dnh->snh", x, layer.k)
    v = np.einsum("sd,dnh->snh", x, layer.v)
    return q, k, v


def apply_rotary_emb(x: np.ndarray, theta_base: float = 10_000.0) -> np.ndarray:
    """Split RoPE: rotate pairs (i, i + dim/2) by angle m * theta_i at position m."""
    dim = x.shape[-1]
    theta = 1.0 / (theta_base ** (np.arange(0, dim, 2) / dim))
    m = np.arange(x.shape[0])
    freqs = m[:, None] * theta[None, :]  # (seq, dim/2)
    cos, sin = np.cos(freqs)[:, None, :], np.sin(freqs)[:, None, :]  # broadcast over heads
    x1, x2 = x[..., : dim // 2], x[..., dim // 2:]
    return np.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)


def softmax(x: np.ndarray) -> np.ndarray:
    e_x = np.exp(x - np.max(x, axis=-1, keepdims=True))  # subtract the max: no overflow
    return e_x / np.sum(e_x, axis=-1, keepdims=True)


def attention_scores(q: np.ndarray, k: np.ndarray) -> np.ndarray:
    """(seq_q, heads, seq_k) causal attention pattern."""
    qk = np.einsum("snh,tnh->snt", q, k) / np.sqrt(q.shape[-1])
    seq = q.shape[0]
    allowed = np.arange(seq)[:, None] >= np.arange(seq)[None, :]
    qk = qk + np.where(allowed, 0.0, -np.inf)[:, None, :]
    return softmax(qk)


def rms_norm(x: np.ndarray, gamma: float = 1.0) -> np.ndarray:
    rms = np.sqrt(np.sum(x ** 2, axis=-1, keepdims=True) / x.shape[-1])
    return gamma * x / rms


def mlp(x: np.ndarray, w0: np.ndarray, w1: np.ndarray) -> np.ndarray:
    hidden = np.maximum(np.einsum("sd,df->sf", x, w0), 0)  # ReLU
    return np.einsum("sf,fd->sd", hidden, w1) + x  # the seed's MLP includes its residual


def practice_layer(x: np.ndarray, layer: PracticeLayer) -> np.ndarray:
    q, k, v = qkv_proj(x, layer)
    q, k = apply_rotary_emb(q), apply_rotary_emb(k)
    pattern = attention_scores(q, k)
    mixed = np.einsum("snt,tnh->snh", pattern, v)
    attention_out = np.einsum("snh,nhd->sd", mixed, layer.out)
    x = rms_norm(x + attention_out)  # residual, then post-norm
    return rms_norm(mlp(x, layer.w0, layer.w1))


def forward(input_ids: np.ndarray, weights: PracticeWeights) -> np.ndarray:
    """Logits (seq, vocab_size) for a 1-D array of token ids, computed in float64."""
    vocab = weights.vocab.astype(np.float64)
    if input_ids.ndim != 1:
        raise ValueError(f"the practice model takes a 1-D array of ids, got shape {input_ids.shape}")
    if input_ids.min() < 0 or input_ids.max() >= vocab.shape[0]:
        raise ValueError(f"token ids must be in [0, {vocab.shape[0]}); ids at or above the vocabulary size are incorrect")
    x = embeddings_lookup(input_ids, vocab)
    for layer in weights.layers:
        x = practice_layer(x, PracticeLayer(**{f: getattr(layer, f).astype(np.float64) for f in layer.__dataclass_fields__}))
    unembed = vocab if weights.unembed is None else weights.unembed.astype(np.float64)
    return x @ unembed.T


def to_state_dict(weights: PracticeWeights) -> dict[str, "np.ndarray"]:
    """The same numbers under lucidlm's parameter names (nn.Linear weights are (out, in))."""
    d = weights.vocab.shape[1]
    state = {"embed.weight": weights.vocab}
    for i, layer in enumerate(weights.layers):
        n, h = layer.q.shape[1], layer.q.shape[2]
        state[f"blocks.{i}.attn.q_proj.weight"] = layer.q.reshape(d, n * h).T
        state[f"blocks.{i}.attn.k_proj.weight"] = layer.k.reshape(d, n * h).T
        state[f"blocks.{i}.attn.v_proj.weight"] = layer.v.reshape(d, n * h).T
        state[f"blocks.{i}.attn.o_proj.weight"] = layer.out.reshape(n * h, d).T
        state[f"blocks.{i}.mlp.up_proj.weight"] = layer.w0.T
        state[f"blocks.{i}.mlp.down_proj.weight"] = layer.w1.T
        state[f"blocks.{i}.ln1.weight"] = np.ones(d, dtype=np.float32)  # the seed's gamma = 1
        state[f"blocks.{i}.ln2.weight"] = np.ones(d, dtype=np.float32)
    if weights.unembed is not None:
        state["unembed.weight"] = weights.unembed
    return {name: np.ascontiguousarray(value) for name, value in state.items()}
