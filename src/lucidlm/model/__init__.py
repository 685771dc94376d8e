"""The model: one Transformer built from a ModelConfig, and its parts (one file each)."""

from lucidlm.model.hooks import HookPoint
from lucidlm.model.kv_cache import KVCache
from lucidlm.model.multihead import MultiHeadAttention, scaled_dot_product_attention
from lucidlm.model.positions import permute_qk_to_half, permute_qk_to_interleaved
from lucidlm.model.transformer import Transformer

__all__ = ["HookPoint", "KVCache", "MultiHeadAttention", "Transformer", "permute_qk_to_half",
           "permute_qk_to_interleaved", "scaled_dot_product_attention"]
