"""A block's decode step in one C++ call, where that call computes exactly what block.py does.

An eager decode step of a pre-norm block on lucidlm's CPU kernels is ~15 module calls and ~25
small torch ops around four quantized matmuls; at SmolLM2's size the calls cost more than the
arithmetic (batch 1, 2 threads: ~13 ms a token, of which the kernels take ~6).
``torch.ops.lucidlm.decode_block`` (quantization/kernels/decode_block_op.cpp) makes the same
kernel calls from C++ and writes the element-wise steps between them (RoPE, the cache write,
the residual sums, the gate's product) in torch's order, so its output and the cache it writes
are bit for bit the modules' (tests/model/test_decode_block.py).

block.py stays the definition. ``one_call_step`` stands in for it only where nothing could tell
the difference; anything else returns None and the modules run:

- a decode step: one new token per row, or a few (up to ``MAX_TOKENS``: speculative decoding's
  checking pass, a chat turn's short continuation of a kept cache), float32 on the CPU, a KV
  cache and the rotation given, no prefix, no autograd, not inside a compiled graph. T tokens
  in one call give each token exactly what T one-token steps give (each row of the kernel is
  computed on its own, each query reads only the slots up to its own), so a speculative
  check agrees with plain decoding to the bit (up to the unembedding: a float32 one multiplies
  the T rows at once), where the modules' T-token pass (SDPA) differs in the last bits;
- a pre-norm block of the LLaMA kind: RMSNorm (with Gemma's sandwich norms or without),
  RoPE (with Qwen 3 / Gemma 3's q/k norms or without), a SwiGLU or GeGLU MLP, every matmul on
  lucidlm's blocks kernel without a bias (q/k/v and gate/up fused by ``model/fused.py`` where
  they can be, else one by one), the C loops switched on for its norms and attention, no
  dropout in effect, no opt-in hook sites;
- nothing is listening: no function on any of the block's hook points, no torch hook on the
  modules it replaces (a hook on the block itself still runs: it wraps this call as it
  wrapped the modules).

``one_call_stack`` goes one further: where every block of the model would take the call and
none has a torch hook of its own, ``Transformer.step`` hands all of them to one
``torch.ops.lucidlm.decode_stack`` call (``decode_block`` for each layer, from C++), which saves
the ~30 us of Python each block's call costs around its arithmetic.

``blocks_kernel.use_cpu_loops`` switches it on (``Block.decode_kernel``) with the other C loops.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from lucidlm.model.attention import RopeCosSin
from lucidlm.model.hooks import HookPoint
from lucidlm.model.mlp import ACTIVATIONS
from lucidlm.model.norms import RMSNorm


def one_call_step(block: nn.Module, x: torch.Tensor, rope: Optional[RopeCosSin], mask: Optional[torch.Tensor],
                  kv_cache: Optional[nn.Module], input_pos: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """x (B, T, d) -> the block's output (B, T, d), having written token t's key and value into
    ``kv_cache`` at ``input_pos[t]`` (T,); or None where the modules must run (module docstring)."""
    if not _a_decode_step(x, rope, mask, input_pos) or kv_cache is None:
        return None
    operands = _operands(block, kv_cache)
    if operands is None:
        return None
    (attn, ln1, q_norm, k_norm, ln1_post, ln2, ln2_post, qkv, o, gate_up, activation, down), k_cache, v_cache = operands
    if k_cache.shape[0] != x.shape[0]:  # fewer rows than the cache holds (KVCache.update's first rows)
        return None
    cos, sin = rope
    return torch.ops.lucidlm.decode_block(
        x, ln1.weight, ln1.eps, qkv, _weight(q_norm), _weight(k_norm), _eps(q_norm if q_norm is not None else k_norm),
        cos, sin, attn.rope_variant == "interleaved", k_cache, v_cache, input_pos, mask, attn.scale, attn.n_heads, o,
        _weight(ln1_post), _eps(ln1_post), ln2.weight, ln2.eps, gate_up, activation, down, _weight(ln2_post),
        _eps(ln2_post))


def one_call_stack(blocks: Sequence[nn.Module], block_class: type, x: torch.Tensor, rope: Optional[RopeCosSin],
                   rope_local: Optional[RopeCosSin], mask: Optional[torch.Tensor], local_mask: Optional[torch.Tensor],
                   kv_caches: Sequence[Optional[nn.Module]], input_pos: Optional[torch.Tensor],
                   steady: Optional[dict] = None) -> Optional[torch.Tensor]:
    """x (B, T, d) -> the output of all ``blocks`` (B, T, d) in one C++ call
    (``torch.ops.lucidlm.decode_stack``: ``decode_block`` for each layer in turn), where every
    block would take ``one_call_step`` and is a plain ``block_class`` with no torch hook of its
    own (a hook on a block wraps that block's call, so that block must be called); else None,
    and the blocks run one by one, each deciding for itself. A local block (``block.local``)
    gets ``rope_local`` and ``local_mask``, as in ``Transformer.step``.

    Why: one decode_block call from Python costs ~30 us besides its arithmetic (the module call,
    the checks here, boxing 26 arguments): ~1 ms of SmolLM2's 7 ms batch-1 token.

    ``steady``: a dict the caller keeps across a run of decode steps between which nothing can
    change the model (``Transformer.steady_decode``). The blocks' operands are then looked up
    at its first step and kept in it for the others, as long as no hook point and no global
    torch hook changed and the caches are the same; each step's check of ~450 modules costs
    ~0.9 ms of a 6 ms SmolLM2 token on 2 cores, their memory pushed out of the CPU's caches by
    the step's weights."""
    if not _a_decode_step(x, rope, mask, input_pos):
        return None
    if (steady is not None and not global_module_hooks() and steady.get("caches") is kv_caches
            and steady.get("version") == HookPoint.version):
        plan = steady["plan"]
    else:
        plan = _stack_plan(blocks, block_class, kv_caches)
        if steady is not None:
            steady.update(caches=kv_caches, version=HookPoint.version, plan=plan)
    if plan is None:
        return None
    norms, optional_norms, matmuls, counts, k_caches, v_caches, floats, ints, local = plan
    if k_caches[0].shape[0] != x.shape[0]:  # fewer rows than the caches hold: the modules write their first rows
        return None
    ropes = [rope_local if is_local else rope for is_local in local]
    cos, sin = [r[0] for r in ropes], [r[1] for r in ropes]
    masks = [local_mask if is_local else mask for is_local in local]
    return torch.ops.lucidlm.decode_stack(x, norms, optional_norms, matmuls, counts, cos, sin, masks, k_caches,
                                          v_caches, input_pos, floats, ints)


def _stack_plan(blocks: Sequence[nn.Module], block_class: type, kv_caches: Sequence[Optional[nn.Module]],
                ) -> Optional[tuple]:
    """decode_stack's per-layer operands, flattened (its C++ comment lists them), and which
    blocks are local; None where some block cannot take the call (``one_call_stack``)."""
    norms, optional_norms, matmuls, counts, k_caches, v_caches, floats, ints, local = ([] for _ in range(9))
    for block, kv_cache in zip(blocks, kv_caches, strict=True):
        if (type(block) is not block_class or not block.decode_kernel or kv_cache is None or block._forward_hooks
                or block._forward_pre_hooks or "forward" in block.__dict__):
            return None
        operands = _operands(block, kv_cache)
        if operands is None:
            return None
        (attn, ln1, q_norm, k_norm, ln1_post, ln2, ln2_post, qkv, o, gate_up, activation, down), k, v = operands
        norms += (ln1.weight, ln2.weight)
        optional_norms += (_weight(q_norm), _weight(k_norm), _weight(ln1_post), _weight(ln2_post))
        for operand_list in (qkv, o, gate_up, down):
            matmuls += operand_list
            counts.append(len(operand_list))
        k_caches.append(k)
        v_caches.append(v)
        floats += (ln1.eps, _eps(q_norm if q_norm is not None else k_norm), attn.scale, _eps(ln1_post), ln2.eps,
                   _eps(ln2_post))
        ints += (int(attn.rope_variant == "interleaved"), attn.n_heads, activation)
        local.append(block.local)
    return norms, optional_norms, matmuls, counts, k_caches, v_caches, floats, ints, local


def nothing_listens(model: nn.Module) -> bool:
    """No function on any hook point of ``model`` and no torch hook on any of its modules or
    global: running it calls no code but its own (``Transformer.steady_decode`` asks)."""
    return not global_module_hooks() and not any(
        m.active if isinstance(m, HookPoint) else (m._forward_hooks or m._forward_pre_hooks) for m in model.modules())


def _a_decode_step(x: torch.Tensor, rope: Optional[RopeCosSin], mask: Optional[torch.Tensor],
                   input_pos: Optional[torch.Tensor]) -> bool:
    """Whether these are a decode step's inputs the C++ step takes: 1 to ``MAX_TOKENS`` new tokens
    a row, float32 on the CPU, their slots, a rotation and a mask, no autograd, not inside a
    compiled graph."""
    if torch.compiler.is_compiling():  # first: a traced graph reads nothing below (no guard on shapes)
        return False
    return not (input_pos is None or rope is None or mask is None or not 1 <= x.shape[1] <= MAX_TOKENS
                or x.dtype != torch.float32 or not x.is_cpu or torch.is_grad_enabled())


def _operands(block: nn.Module, kv_cache: nn.Module) -> Optional[tuple]:
    """(the block's plan, its k cache, its v cache) where the C++ step computes this block; else None."""
    if not _quiet(block):  # first: cached, where the plan is looked up afresh
        return None
    plan = _plan(block)
    if plan is None:
        return None
    k_cache, v_cache = kv_cache._buffers["k"], kv_cache._buffers["v"]
    if k_cache.dtype != torch.float32:
        return None
    return plan, k_cache, v_cache


# Tokens a row one call takes. Its attention scores each query on its own, where the modules'
# SDPA multiplies whole matrices: SmolLM2 int4, 2 threads, one row (AMD EPYC Zen 5, 2026-12-07),
# one call against the modules, after 40 cached tokens: 6 tokens 6.5 vs 18.9 ms, 32 21.7 vs
# 55.9; after 700: 64 59.8 vs 82.8, 256 284 vs 292; after 3000: 32 94.5 vs 100.4, 64 185 vs 174.
MAX_TOKENS = 32

ACTIVATION_CODES = ((F.silu, 0), (ACTIVATIONS["gelu_tanh"], 1))  # the gate's activation -> the operator's code


def _plan(block: nn.Module) -> Optional[tuple]:
    """The modules and each matmul's blocks-kernel operands (a list of 3 tensors a matmul), where the
    block is one the C++ step computes; else None.

    Checked afresh every step (a wrapper in a layer's place, a reloaded weight, a torch hook or a
    flag may come between two steps), so it reads the registered children from ``_modules``
    directly: ``nn.Module.__getattr__`` costs ~1 us a name on a slow CPU, and ~40 names a block
    made this check a tenth of a batch-1 step."""
    child = block._modules
    ln1, ln2, ln1_post, ln2_post, attn, mlp = (child[name] for name in ("ln1", "ln2", "ln1_post", "ln2_post", "attn",
                                                                        "mlp"))
    a, m = attn._modules, mlp._modules
    q_norm, k_norm = a.get("q_norm"), a.get("k_norm")
    norms = [n for n in (ln1, ln2, ln1_post, ln2_post, q_norm, k_norm) if n is not None and type(n) is not nn.Identity]
    activation = next((code for fn, code in ACTIVATION_CODES if mlp.gate_activation is fn), None)
    # the loops the modules would run (use_cpu_loops switches them on together): the same sums
    if not (block.pre_norm and type(ln1) is RMSNorm and type(ln2) is RMSNorm
            and all(type(n) is RMSNorm and n.row_kernel for n in norms) and attn.decode_kernel
            and (type(child["dropout"]) is nn.Identity or not block.training)
            and not (block.use_split_qkv_input or block.use_attn_in or block.use_mlp_in)
            and not (attn.use_explicit or attn.use_attn_result)
            and attn.rope_variant in ("half", "interleaved") and activation is not None
            and attn.head_dim % 8 == 0  # the operator's attention loop takes heads in vectors of 8 values
            and (q_norm is None or k_norm is None or q_norm.eps == k_norm.eps)):  # the operator takes one eps
        return None
    qkv = _matmuls(a.get("fused_qkv"), (a["q_proj"], a["k_proj"], a["v_proj"]))
    gate_up = _matmuls(m.get("fused_gate_up"), (m["gate_proj"], m["up_proj"]))
    o, down = _matmuls(None, (a["o_proj"],)), _matmuls(None, (m["down_proj"],))
    if qkv is None or gate_up is None or o is None or down is None:
        return None
    if any(n._forward_hooks or n._forward_pre_hooks for n in (attn, mlp, *norms)):
        return None
    return (attn, ln1, _norm(q_norm), _norm(k_norm), _norm(ln1_post), ln2, _norm(ln2_post), qkv, o, gate_up,
            activation, down)


def _matmuls(fused: Optional[nn.Module], parts: tuple[nn.Module, ...]) -> Optional[list[torch.Tensor]]:
    """The blocks-kernel operands of ``parts``' matmuls: the fused layer's (3 tensors) where it
    still serves them, else each part's (3 each); None where one is not on the kernel, has a
    bias, or has a torch hook."""
    layers = (fused.kernel,) if fused is not None and fused.serves(*parts) else parts
    if fused is not None and layers[0] is fused.kernel and (fused._forward_hooks or fused._forward_pre_hooks):
        return None
    operands: list[torch.Tensor] = []
    for layer in layers:
        ops = getattr(layer, "blocks_operands", _none)()
        if ops is None or layer._buffers.get("bias") is not None or layer._forward_hooks or layer._forward_pre_hooks:
            return None
        operands += ops
    return operands


def _norm(module: Optional[nn.Module]) -> Optional[nn.Module]:
    return None if module is None or type(module) is nn.Identity else module


def _weight(norm: Optional[nn.Module]) -> Optional[torch.Tensor]:
    return norm.weight if norm is not None else None


def _eps(norm: Optional[nn.Module]) -> float:
    return norm.eps if norm is not None else 0.0


def _none() -> None:
    return None


def _quiet(block: nn.Module) -> bool:
    """No function on any hook point inside ``block`` and no global torch module hook. Which hook
    points are active is looked up again only when ``HookPoint.version`` moved (any hook added
    or removed anywhere)."""
    if global_module_hooks():
        return False
    seen = block.__dict__.get("_hook_points_checked")
    if seen is None or seen[0] != HookPoint.version:
        idle = not any(m.active for m in block.modules() if isinstance(m, HookPoint))
        seen = block.__dict__["_hook_points_checked"] = (HookPoint.version, idle)
    return seen[1]


def global_module_hooks() -> bool:
    """Whether a torch forward hook is registered for every module (``register_module_forward_hook``)."""
    hooks = nn.modules.module
    return bool(hooks._global_forward_hooks or hooks._global_forward_pre_hooks)
