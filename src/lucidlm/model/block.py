"""One transformer block: attention and MLP, each with a residual connection and a norm.

pre-norm  (GPT-2, LLaMA):        x = x + attn(ln1(x));   x = x + mlp(ln2(x))
post-norm (seed 000, seed 004):  x = ln1(x + attn(x));   x = ln2(x + mlp(x))   ("add & norm")
sandwich  (Gemma 2/3):           x = x + ln1_post(attn(ln1(x)));   x = x + ln2_post(mlp(ln2(x)))

A block is local (sliding-window attention, its own RoPE base) or global; the Transformer
hands each block the mask and rotation of its kind.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from lucidlm.config import ModelConfig
from lucidlm.model.attention import Attention, RopeCosSin
from lucidlm.model.decode_block import one_call_step
from lucidlm.model.hook_options import per_head
from lucidlm.model.hooks import HookPoint
from lucidlm.model.kv_cache import KVCache
from lucidlm.model.mlp import MLP
from lucidlm.model.norms import make_norm


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int = 0) -> None:
        super().__init__()
        self.pre_norm = cfg.norm_position == "pre"
        self.local = cfg.layer_is_local(index)
        self.ln1 = make_norm(cfg.norm, cfg.d_model, cfg.norm_eps, cfg.norm_bias)
        self.attn = Attention(cfg)
        self.ln2 = make_norm(cfg.norm, cfg.d_model, cfg.norm_eps, cfg.norm_bias)
        self.mlp = MLP(cfg)
        sandwich = cfg.post_sublayer_norm
        self.ln1_post = make_norm(cfg.norm, cfg.d_model, cfg.norm_eps, cfg.norm_bias) if sandwich else nn.Identity()
        self.ln2_post = make_norm(cfg.norm, cfg.d_model, cfg.norm_eps, cfg.norm_bias) if sandwich else nn.Identity()
        self.dropout = nn.Dropout(cfg.dropout) if cfg.dropout > 0 else nn.Identity()

        self.hook_resid_pre = HookPoint()  # (B, T, d)
        self.hook_attn_out = HookPoint()  # (B, T, d)
        self.hook_resid_mid = HookPoint()  # (B, T, d)
        self.hook_mlp_out = HookPoint()  # (B, T, d)
        self.hook_resid_post = HookPoint()  # (B, T, d)
        # Opt-in hook points (hook_q_input, hook_attn_in, hook_mlp_in, ...): see hook_options.py.
        self.use_split_qkv_input = self.use_attn_in = self.use_mlp_in = False
        # A float32 decode step on the CPU in one C++ call where it computes exactly what
        # forward() below does (decode_block.py); switched on by ``blocks_kernel.use_cpu_loops``.
        self.decode_kernel = False

    def forward(self, x: torch.Tensor, rope: Optional[RopeCosSin] = None, mask: Optional[torch.Tensor] = None,
                kv_cache: Optional[KVCache] = None, input_pos: Optional[torch.Tensor] = None,
                prefix_kv: Optional[torch.Tensor] = None, kv_len: Optional[int] = None) -> torch.Tensor:
        """x: (B, T, d) -> (B, T, d). The other arguments go to attention (see Attention.forward)."""
        if self.decode_kernel and prefix_kv is None and kv_len is None:
            out = one_call_step(self, x, rope, mask, kv_cache, input_pos)
            if out is not None:
                return out
        x = self.hook_resid_pre(x)
        q_in, k_in, v_in = self._attn_inputs(x)
        attn_out = self.attn(q_in, rope, mask, kv_cache, input_pos, prefix_kv, k_in, v_in, kv_len)
        attn_out = self.hook_attn_out(self.dropout(self.ln1_post(attn_out)))  # ln1_post: Gemma's, else identity
        if self.pre_norm:
            x = self.hook_resid_mid(x + attn_out)
            mlp_in = self.hook_mlp_in(x.clone()) if self.use_mlp_in else x
            mlp_out = self.hook_mlp_out(self.dropout(self.ln2_post(self.mlp(self.ln2(mlp_in)))))
            x = x + mlp_out
        else:
            x = self.hook_resid_mid(self.ln1(x + attn_out))
            mlp_in = self.hook_mlp_in(x.clone()) if self.use_mlp_in else x
            mlp_out = self.hook_mlp_out(self.dropout(self.mlp(mlp_in)))
            x = self.ln2(x + mlp_out)
        return self.hook_resid_post(x)

    def _attn_inputs(self, x: torch.Tensor) -> tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
        """Attention's query/key/value inputs: the (normed) stream, or with the opt-in split
        inputs one copy per head, (B, T, nh, d) and (B, T, n_kv, d), as TransformerLens does."""
        if not (self.use_split_qkv_input or self.use_attn_in):
            return (self.ln1(x) if self.pre_norm else x), None, None
        if self.use_attn_in:
            q_in = k_in = v_in = self.hook_attn_in(per_head(x, self.attn.n_heads))
        if self.use_split_qkv_input:
            q_in = self.hook_q_input(per_head(x, self.attn.n_heads))
            k_in = self.hook_k_input(per_head(x, self.attn.n_kv_heads))
            v_in = self.hook_v_input(per_head(x, self.attn.n_kv_heads))
        if self.pre_norm:
            q_in, k_in, v_in = self.ln1(q_in), self.ln1(k_in), self.ln1(v_in)
        return q_in, k_in, v_in
