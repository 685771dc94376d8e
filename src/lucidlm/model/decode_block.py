"""A block's decode step in one C++ call, where that call computes exactly what block.py does.

An eager decode step of a pre-norm LLaMA-style block on lucidlm's CPU kernels is ~15 module
calls and ~25 small torch ops around four quantized matmuls; at SmolLM2's size the calls cost
more than the arithmetic (batch 1, 2 threads: ~13 ms a token, of which the kernels take ~6).
``torch.ops.lucidlm.decode_block`` (quantization/kernels/decode_block_op.cpp) makes the same
kernel calls from C++ and writes the element-wise steps between them (RoPE, the cache write,
the residual sums, the gate's product) in torch's order, so its output and the cache it writes
are bit for bit the modules' (tests/model/test_decode_block.py).

block.py stays the definition. ``one_call_step`` stands in for it only where nothing could tell
the difference; anything else returns None and the modules run:

- a decode step: one new token per row, float32 on the CPU, a KV cache and the rotation given,
  no prefix, no autograd, not inside a compiled graph;
- the block is the plain pre-norm one: RMSNorm, fused q/k/v and gate/up on lucidlm's blocks
  kernel (``model/fused.py``, still serving their parts), RoPE without q/k norms, SwiGLU,
  o_proj and down_proj on the kernel, no biases, no dropout in effect, no opt-in hook sites;
- nothing is listening: no function on any of the block's hook points, no torch hook on the
  modules it replaces (a hook on the block itself still runs: it wraps this call as it
  wrapped the modules).

``blocks_kernel.use_cpu_loops`` switches it on (``Block.decode_kernel``) with the other C loops.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from lucidlm.model.hooks import HookPoint
from lucidlm.model.norms import RMSNorm

RopeCosSin = tuple[torch.Tensor, torch.Tensor]  # each (B, 1, 1, hd), from RotaryEmbedding.cos_sin


def one_call_step(block: nn.Module, x: torch.Tensor, rope: Optional[RopeCosSin], mask: Optional[torch.Tensor],
                  kv_cache: Optional[nn.Module], input_pos: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """x (B, 1, d) -> the block's output (B, 1, d), having written this token's key and value into
    ``kv_cache`` at ``input_pos`` (1,); or None where the modules must run (module docstring)."""
    if (kv_cache is None or input_pos is None or rope is None or mask is None or x.shape[1] != 1
            or x.dtype != torch.float32 or not x.is_cpu or torch.is_grad_enabled() or torch.compiler.is_compiling()):
        return None
    plan = _plan(block)
    if plan is None or not _quiet(block):
        return None
    k_cache, v_cache = kv_cache._buffers["k"], kv_cache._buffers["v"]
    if k_cache.dtype != torch.float32:
        return None
    attn, ln1, qkv, o, ln2, gate_up, down = plan
    cos, sin = rope
    return torch.ops.lucidlm.decode_block(
        x, ln1.weight, ln1.eps, *qkv, cos, sin, attn.rope_variant == "interleaved", k_cache, v_cache, input_pos,
        mask, attn.scale, attn.n_heads, *o, ln2.weight, ln2.eps, *gate_up, *down)


def _plan(block: nn.Module) -> Optional[tuple]:
    """(attn, ln1, qkv, o, ln2, gate_up, down): the modules and each matmul's blocks-kernel
    operands, where the block is the plain one the C++ step computes; else None.

    Checked afresh every step (a LoRA wrapper, a reloaded weight, a torch hook or a flag may come
    between two steps), so it reads the registered children from ``_modules`` directly:
    ``nn.Module.__getattr__`` costs ~1 us a name on a slow CPU, and ~40 names a block made this
    check a tenth of a batch-1 step."""
    child = block._modules
    ln1, ln2, attn, mlp = child["ln1"], child["ln2"], child["attn"], child["mlp"]
    if not (block.pre_norm and type(ln1) is RMSNorm and type(ln2) is RMSNorm
            and type(child["ln1_post"]) is nn.Identity and type(child["ln2_post"]) is nn.Identity
            and (type(child["dropout"]) is nn.Identity or not block.training)
            and not (block.use_split_qkv_input or block.use_attn_in or block.use_mlp_in)
            and not (attn.use_explicit or attn.use_attn_result) and attn.q_norm is None
            and attn.rope_variant in ("half", "interleaved") and mlp.gate_activation is F.silu):
        return None
    a, m = attn._modules, mlp._modules
    fused_qkv, fused_gate_up, o_proj, down_proj = a.get("fused_qkv"), m.get("fused_gate_up"), a["o_proj"], m["down_proj"]
    if (fused_qkv is None or fused_gate_up is None or not fused_qkv.serves(a["q_proj"], a["k_proj"], a["v_proj"])
            or not fused_gate_up.serves(m["gate_proj"], m["up_proj"])):
        return None
    linears = (fused_qkv.kernel, o_proj, fused_gate_up.kernel, down_proj)
    operands = [getattr(layer, "blocks_operands", _none)() for layer in linears]
    if any(ops is None for ops in operands) or o_proj.bias is not None or down_proj.bias is not None:
        return None
    if any(m._forward_hooks or m._forward_pre_hooks for m in (ln1, ln2, attn, mlp, fused_qkv, fused_gate_up, *linears)):
        return None
    qkv, o, gate_up, down = operands
    return attn, ln1, qkv, o, ln2, gate_up, down


def _none() -> None:
    return None


def _quiet(block: nn.Module) -> bool:
    """No function on any hook point inside ``block`` and no global torch module hook. Which hook
    points are active is looked up again only when ``HookPoint.version`` moved (any hook added
    or removed anywhere)."""
    hooks = nn.modules.module
    if hooks._global_forward_hooks or hooks._global_forward_pre_hooks:
        return False
    seen = block.__dict__.get("_hook_points_checked")
    if seen is None or seen[0] != HookPoint.version:
        idle = not any(m.active for m in block.modules() if isinstance(m, HookPoint))
        seen = block.__dict__["_hook_points_checked"] = (HookPoint.version, idle)
    return seen[1]
