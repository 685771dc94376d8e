"""What each LLaMA-shaped Hugging Face architecture changes in LlamaForCausalLM's reading and writing.

``LlamaForCausalLM``, ``Qwen2ForCausalLM`` and ``Qwen3ForCausalLM`` (Qwen 2, 2.5 and 3) share the
tensor names, the rotate_half RoPE, RMSNorm, SwiGLU and grouped-query attention; what differs is
data here, read from transformers' ``modeling_qwen2.py`` / ``modeling_qwen3.py`` and their configs:

- Qwen 2 / 2.5: q/k/v projections always carry a bias and o_proj never does (config.json has no
  ``attention_bias`` switch); no MLP bias.
- Qwen 3: an RMSNorm over each head's query and key before RoPE (``q_norm``/``k_norm``: plain
  weight * x / rms(x) with ``rms_norm_eps``, our RMSNorm as it is); one ``attention_bias`` switch
  for q/k/v and o; ``head_dim`` is 128 when config.json leaves it out, not hidden/heads.
- Both: each layer's ``layer_types`` entry, or when config.json has none, ``use_sliding_window:
  true`` making layers ``max_window_layers`` and above attend within a window: a pattern lucidlm
  does not build, so a model with any sliding layer is refused; ``use_sliding_window: false``
  (every released checkpoint) is full attention everywhere, whatever ``sliding_window`` says
  (transformers sets it to None). Both default to a 32768-token context.
- LlamaConfig refuses a hidden_size that num_attention_heads does not divide; Qwen's configs do not.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class LlamaShapedFamily:
    title: str  # for messages
    architecture: str  # config.json's architectures entry; model_type is the family's key
    qk_norm: bool = False  # q_norm/k_norm weights per head
    qkv_bias: Optional[bool] = None  # fixed by the architecture; None: config.json's attention_bias
    out_bias: Optional[bool] = None  # o_proj's, fixed; None: the same switch as q/k/v
    mlp_bias_switch: bool = False  # config.json has mlp_bias
    default_head_dim: Optional[int] = None  # head_dim when config.json has none; None: hidden_size // heads
    heads_divide_hidden: bool = False  # the config class refuses hidden_size % num_attention_heads != 0
    sliding_window_switch: bool = False  # config.json's use_sliding_window / max_window_layers / layer_types
    default_max_positions: int = 2048  # max_position_embeddings when config.json has none (the config class's)


LLAMA_SHAPED: dict[str, LlamaShapedFamily] = {
    "llama": LlamaShapedFamily("LLaMA", "LlamaForCausalLM", mlp_bias_switch=True, heads_divide_hidden=True),
    "qwen2": LlamaShapedFamily("Qwen 2", "Qwen2ForCausalLM", qkv_bias=True, out_bias=False, sliding_window_switch=True,
                               default_max_positions=32768),
    "qwen3": LlamaShapedFamily("Qwen 3", "Qwen3ForCausalLM", qk_norm=True, default_head_dim=128,
                               sliding_window_switch=True, default_max_positions=32768),
}


def attention_biases(family: LlamaShapedFamily, switch: bool) -> tuple[bool, bool]:
    """(q/k/v bias, o_proj bias) of a model of ``family`` whose attention_bias switch is ``switch``."""
    qkv = switch if family.qkv_bias is None else family.qkv_bias
    return qkv, (qkv if family.out_bias is None else family.out_bias)
