"""Multi-head causal self-attention with grouped-query heads, RoPE, padding masks and a KV cache.

Two paths compute the same thing:
- fast: ``F.scaled_dot_product_attention`` (fused kernels), used when nobody needs the
  attention pattern;
- explicit: scores -> mask -> softmax -> weighted values, spelled out so the scores and
  pattern can be hooked (``hook_attn_scores``, ``hook_pattern``) and plotted.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from lucidlm.config import ModelConfig
from lucidlm.model.fused import FusedLinear
from lucidlm.model.hook_options import head_results, per_head_linear, sum_head_results
from lucidlm.model.hooks import HookPoint
from lucidlm.model.kv_cache import KVCache
from lucidlm.model.norms import RMSNorm
from lucidlm.model.positions import apply_rope

RopeCosSin = tuple[torch.Tensor, torch.Tensor]  # each (B, T, 1, hd), from RotaryEmbedding.cos_sin


class Attention(nn.Module):
    """Holds weights and hook points only: the rotation table, the KV cache and any prefix
    belong to the Transformer, which passes them in on every call."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.d_model, cfg.q_dim, bias=cfg.attn_bias)
        self.k_proj = nn.Linear(cfg.d_model, cfg.kv_dim, bias=cfg.attn_bias)
        self.v_proj = nn.Linear(cfg.d_model, cfg.kv_dim, bias=cfg.attn_bias)
        self.o_proj = nn.Linear(cfg.q_dim, cfg.d_model, bias=cfg.attn_out_bias)
        self.dropout = cfg.dropout
        self.rope_variant = cfg.rope_variant if cfg.positions == "rope" else None
        self.use_explicit = False  # force the explicit path (e.g. to compare the two)
        self.use_attn_result = False  # hook each head's output (hook_options.py)
        self.fused_qkv: Optional[FusedLinear] = None  # q/k/v as one matmul, where it can be (fused.py)
        # A float32 decode step on the CPU calls lucidlm's C loop for its attention
        # (``torch.ops.lucidlm.decode_attention``, quantization/kernels/decode_attention.c);
        # switched on by ``blocks_kernel.use_cpu_loops`` (``LanguageModel.compile``, and
        # ``lucidlm.load`` for models on lucidlm's kernels) where that library is available.
        self.decode_kernel = False
        # Gemma 3 / Qwen 3: RMSNorm over each head's query and key (one weight shared by the
        # heads), before RoPE, so the scores stay bounded whatever the projections learn.
        self.q_norm = RMSNorm(cfg.head_dim, cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.norm_eps) if cfg.qk_norm else None
        # Scores are scaled by 1/sqrt(head_dim), or 1/sqrt(query_pre_attn_scalar) (Gemma).
        self.score_divisor = math.sqrt(cfg.query_pre_attn_scalar or cfg.head_dim)
        self.scale = 1.0 / self.score_divisor

        self.hook_q = HookPoint()  # (B, T, nh, hd)
        self.hook_k = HookPoint()  # (B, T, n_kv, hd)
        self.hook_v = HookPoint()  # (B, T, n_kv, hd)
        if self.rope_variant is not None:
            self.hook_rot_q = HookPoint()  # (B, T, nh, hd), after rotation
            self.hook_rot_k = HookPoint()  # (B, T, n_kv, hd), after rotation
        self.hook_attn_scores = HookPoint()  # (B, nh, T, S), masked, before softmax
        self.hook_pattern = HookPoint()  # (B, nh, T, S), rows sum to 1
        self.hook_z = HookPoint()  # (B, T, nh, hd): per-head mix of values

    def forward(self, x: torch.Tensor, rope: Optional[RopeCosSin], mask: Optional[torch.Tensor],
                kv_cache: Optional[KVCache] = None, input_pos: Optional[torch.Tensor] = None,
                prefix_kv: Optional[torch.Tensor] = None, key_input: Optional[torch.Tensor] = None,
                value_input: Optional[torch.Tensor] = None, kv_len: Optional[int] = None) -> torch.Tensor:
        """x: (B, T, d). rope: the rotation for these positions (RoPE models), else None.
        mask: (B, 1, T, S) bool, True = may attend, or None for plain causal over the keys.
        kv_cache, input_pos: this layer's cache and the (T,) slots to write, or None.
        kv_len: attend over the cache's first kv_len slots only (S = kv_len), or all of it.
        prefix_kv: (2, n_kv, P, hd) keys and values every query sees first (prefix tuning).
        key_input, value_input: with split inputs (hook_options.py), x is (B, T, nh, d) and
        these are (B, T, n_kv, d), one input per head."""
        B, T = x.shape[:2]
        if key_input is None:
            fused = self.fused_qkv
            if fused is not None and fused.serves(self.q_proj, self.k_proj, self.v_proj):
                q, k, v = fused(x)  # (B, T, q_dim), (B, T, kv_dim) x 2
            else:
                q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
            q = self.hook_q(q.view(B, T, self.n_heads, self.head_dim))
            k = self.hook_k(k.view(B, T, self.n_kv_heads, self.head_dim))
            v = self.hook_v(v.view(B, T, self.n_kv_heads, self.head_dim))
        else:
            q = self.hook_q(per_head_linear(self.q_proj, x, self.n_heads, self.head_dim))
            k = self.hook_k(per_head_linear(self.k_proj, key_input, self.n_kv_heads, self.head_dim))
            v = self.hook_v(per_head_linear(self.v_proj, value_input, self.n_kv_heads, self.head_dim))
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rope_variant is not None:
            q = self.hook_rot_q(apply_rope(q, *rope, self.rope_variant))
            k = self.hook_rot_k(apply_rope(k, *rope, self.rope_variant))

        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, heads, T, hd)
        if kv_cache is not None and input_pos is not None:
            k, v = kv_cache.update(input_pos, k, v, kv_len)  # (B, n_kv, S, hd)
        if prefix_kv is not None:
            P = prefix_kv.shape[-2]
            prefix_k, prefix_v = (t.to(k.dtype).expand(B, -1, -1, -1) for t in prefix_kv)  # (B, n_kv, P, hd)
            if mask is None:
                mask = causal_mask(T, k.shape[2], x.device)[None, None]
            k, v = torch.cat([prefix_k, k], dim=2), torch.cat([prefix_v, v], dim=2)
            mask = F.pad(mask, (P, 0), value=True)  # every query sees the whole prefix

        dropout_p = self.dropout if self.training else 0.0
        grouped = self.n_kv_heads != self.n_heads  # GQA/MQA: each kv head serves a group of q heads
        explicit = self.use_explicit or self.hook_pattern.active or self.hook_attn_scores.active
        if explicit:
            if grouped:
                group = self.n_heads // self.n_kv_heads
                k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
            z = self._explicit_attention(q, k, v, mask, dropout_p)
        else:
            z = self._fused_attention(q, k, v, mask, dropout_p, grouped)

        z = self.hook_z(z.transpose(1, 2))  # (B, T, nh, hd)
        if self.use_attn_result:  # opt-in: each head's output before they are summed
            result = self.hook_result(head_results(self.o_proj, z))  # (B, T, nh, d)
            return sum_head_results(self.o_proj, result)  # (B, T, d)
        return self.o_proj(z.reshape(B, T, self.n_heads * self.head_dim))

    def _fused_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor],
                         dropout_p: float, grouped: bool) -> torch.Tensor:
        if q.device.type == "cpu" and torch.is_autocast_enabled("cpu"):
            # Mixed-precision training on CPU: autocast would run SDPA in bfloat16, and torch's
            # CPU flash-attention backward is ~6x slower in bfloat16 than in float32 (torch 2.13,
            # measured on the shakespeare-char step). Attention is a small share of the FLOPs,
            # so it runs in float32 and only the projections' matmuls use bfloat16.
            with torch.autocast("cpu", enabled=False):
                return self._fused_attention(q.float(), k.float(), v.float(), mask, dropout_p, grouped)
        single_query = q.shape[2] == 1 and q.device.type == "cpu" and dropout_p == 0.0
        # Eager float32 stays on SDPA unless the C loop is switched on (``decode_kernel``): SDPA
        # beats the spelled-out form there (40 against 118 us a layer at batch 1 over 96 cached
        # positions, 120 against 252 over 1024; AMD EPYC, 2 threads).
        if single_query and (q.dtype != torch.float32 or torch.compiler.is_compiling() or self.decode_kernel):
            return self._single_query_attention(q, k, v, mask)
        if mask is None:  # no cache, no padding: keys are exactly the queries
            return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True, enable_gqa=grouped,
                                                  scale=self.scale)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, enable_gqa=grouped,
                                              scale=self.scale)

    def _single_query_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                mask: Optional[torch.Tensor]) -> torch.Tensor:
        """One new token per row against the cache, for bfloat16/float16 models on the CPU, with
        the two matmuls in float32 (a float64 model's stay float64): torch 2.13's CPU flash
        attention with a mask is slow there (SmolLM2's decode shapes, 1 thread: 250 us per
        layer at batch 1 and 1.5 ms at batch 8, against 55 and 120 us spelled out as below),
        and so are its bfloat16 batched matmuls
        on a CPU without AVX-512 BF16 (AMD EPYC, 2 threads, 80 cached positions: 44 + 46 us per
        layer at batch 1, 200 + 370 us at batch 8; in float32, conversions included, 22 + 15
        and 81 + 57 us). Same result as SDPA with ``enable_gqa``: each group of consecutive
        query heads shares one kv head. q: (B, nh, 1, hd); k, v: (B, n_kv, S, hd); mask:
        (B, 1, 1, S) bool or None."""
        B, S = q.shape[0], k.shape[2]
        grouped_q = q.view(B, self.n_kv_heads, self.n_heads // self.n_kv_heads, self.head_dim)  # (B, n_kv, g, hd)
        if self.decode_kernel and q.dtype == k.dtype == v.dtype == torch.float32 and self.head_dim % 8 == 0:
            # The same sums in one C loop that reads only the slots a row may see: ~8 us a layer at batch 1
            # and ~25 at batch 8 against inductor's ~20 and ~150 (SmolLM2's shapes, 128 slots,
            # AMD EPYC, 2 threads).
            allowed = mask.expand(B, 1, 1, S).reshape(B, S) if mask is not None else q.new_ones((B, S), dtype=torch.bool)
            z = torch.ops.lucidlm.decode_attention(grouped_q, k, v, allowed, self.scale)  # (B, n_kv, g, hd)
            return z.view(B, self.n_heads, 1, self.head_dim)
        # The scores stay a matmul even when compiled: spelled as a product and a sum, inductor
        # folded q's rotation into the loop over the cache and redid it for every cached key
        # (65 us a layer at 128 slots). A matmul takes q as a finished tensor, rotated once.
        # SmolLM2 default, AMD EPYC, 2 threads, best decode step 7.5 -> 6.7 ms (2026-11-26).
        # bf16/fp16 in float32; float64 stays float64 (a float64 model is the exact reference)
        compute_dtype = torch.promote_types(q.dtype, torch.float32)
        scores = grouped_q.to(compute_dtype) @ k.to(compute_dtype).transpose(-2, -1)  # (B, n_kv, g, S)
        scores = scores * self.scale
        if mask is not None:
            scores = scores.masked_fill(~mask.view(mask.shape[0], 1, 1, S), float("-inf"))
        pattern = torch.softmax(scores, dim=-1)  # (B, n_kv, g, S) compute_dtype
        # Compiled, the weighted sum of values is spelled out: inductor fuses it with the
        # softmax into one loop over the cache instead of a bmm call of ~20 us a layer (int4,
        # AMD EPYC, 2 threads: 85 -> 109 tok/s at batch 1; as a matmul too, 7.3 against 6.7 ms).
        if torch.compiler.is_compiling():
            z = (pattern.unsqueeze(-1) * v.to(compute_dtype).unsqueeze(2)).sum(-2)  # (B, n_kv, g, hd)
        else:
            z = pattern @ v.to(compute_dtype)  # (B, n_kv, g, hd)
        return z.to(q.dtype).view(B, self.n_heads, 1, self.head_dim)  # (B, nh, 1, hd)

    def _explicit_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            mask: Optional[torch.Tensor], dropout_p: float) -> torch.Tensor:
        T, S = q.shape[2], k.shape[2]
        if mask is None:
            mask = causal_mask(T, S, q.device)[None, None]
        scores = (q @ k.transpose(-2, -1)) / self.score_divisor  # (B, nh, T, S)
        scores = self.hook_attn_scores(scores.masked_fill(~mask, float("-inf")))
        pattern = self.hook_pattern(torch.softmax(scores, dim=-1, dtype=torch.promote_types(q.dtype, torch.float32)).to(q.dtype))
        pattern = F.dropout(pattern, dropout_p) if dropout_p > 0 else pattern
        return pattern @ v  # (B, nh, T, hd)


def causal_mask(query_len: int, key_len: int, device: torch.device | str | None = None) -> torch.Tensor:
    """(T, S) bool, True where query i may see key j. Queries are the last T of S positions,
    so with a cache (S > T) each new query sees everything before it."""
    offset = key_len - query_len
    q_pos = torch.arange(query_len, device=device)[:, None] + offset
    k_pos = torch.arange(key_len, device=device)[None, :]
    return k_pos <= q_pos
