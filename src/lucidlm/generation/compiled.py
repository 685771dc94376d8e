"""The compiled prefill and decode steps of a model, and the check that keeps them honest.

``torch.compile`` protects a compiled function with *guards*: before each call, dynamo
re-checks everything the trace assumed (every module's type, flags and hook dicts, every
parameter's shape and dtype). For a model of SmolLM2's size that is ~11,000 checks, 2.5 ms
per decode step on this CPU: a quarter of the step (int4, 2 threads, measured 2026-11-23 with
torch's profiler as "TorchDynamo Cache Lookup"). A decode loop calls the same step hundreds
of times on a model that does not change, so the decode step keeps only the guards on its
inputs (ids, slot, mask, the KV cache) and global state (0.14 ms), and this module checks the
model itself once per generation instead:

- ``structure_fingerprint`` records what the trace depended on apart from tensor values: the
  module tree, each module's plain settings (flags such as ``training`` or an adapter's
  ``merged``), and every parameter's and buffer's shape, strides, dtype and device. It is
  taken when the steps are built and compared at the start of every generation; a model that
  changed is compiled again, so a merged adapter or ``model.to(...)`` is never run through a
  stale graph. Weights edited in place need nothing: they are inputs, read at every call.
- Hooks attached between steps (a callback inside a stream) are caught by two counters read
  once per step: ``HookPoint.version`` and torch's ``RemovableHandle.next_id``. A model with
  hooks runs its steps eagerly: hooks stay live Python, as they are in ``run_with_hooks``.
"""

from __future__ import annotations

import inspect
import types
from typing import Any, Callable, Optional, Sequence

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from lucidlm.model.fused import FusedLinear
from lucidlm.model.hooks import HookPoint
from lucidlm.model.traced_once import blocks_traced_once

PLAIN = (bool, int, float, str)
# torch's own bookkeeping in every module's __dict__ (its parameter, buffer, submodule and hook
# tables, covered below and by ``has_hooks``), skipped by name: ~19,000 of SmolLM2's ~24,000 attributes.
TORCH_MODULE_STATE = frozenset(vars(nn.Module())) - {"training"}
CACHE_SOURCE = "self._modules['kv_caches']"  # guards under this source stay: the cache is an input
# torch.compile(isolate_recompiles=...) came after torch 2.11, which GPU images still ship.
HAS_ISOLATE = "isolate_recompiles" in inspect.signature(torch.compile).parameters


def own_step(model: nn.Module) -> Callable[..., torch.Tensor]:
    """``model.step`` for one compiled step, with its own compiled entries.

    dynamo files compiled entries under the function's code object. torch >= 2.12 keeps each
    ``torch.compile`` apart itself (``isolate_recompiles``); before it, every compile of
    ``step`` shared one list, and the decode step's slim guards, meant for this model, would
    be run against another model's entries (a quantized model has no ``weight`` to look up:
    KeyError). A copy of the code object is a fresh list.
    """
    if HAS_ISOLATE:
        return model.step
    function = type(model).step
    code = function.__code__.replace()  # equal, but not the same object
    fresh = types.FunctionType(code, function.__globals__, function.__name__, function.__defaults__,
                               function.__closure__)
    fresh.__kwdefaults__, fresh.__qualname__ = function.__kwdefaults__, function.__qualname__
    return types.MethodType(fresh, model)


def structure_fingerprint(model: nn.Module) -> tuple:
    """Everything a traced step depends on apart from tensor values and hooks (see the module
    docstring); the KV cache is left out (dynamo keeps guarding it)."""
    parts = []
    for name, module in model.named_modules():
        if name.startswith("kv_caches"):
            continue
        if isinstance(module, FusedLinear):
            module.refresh()  # whether float parts still share the fused matrix: its ``sharing`` flag
        # None is skipped (it is no PLAIN value): an attribute that is None now and a module later
        # (``kv_caches``) moves between the instance dict and the module tree, which
        # ``named_modules`` already covers. This runs before every generation: torch's own entries
        # are skipped by name, and list comprehensions beat generators (SmolLM2: 14 -> ~6 ms a call).
        settings = tuple([(key, value) for key, value in vars(module).items()
                          if key not in TORCH_MODULE_STATE and isinstance(value, PLAIN)])
        # Strides too: the compiled steps skip inductor's checks of their inputs' layouts
        # (``LanguageModel.CPU_INDUCTOR_OPTIONS``), so a weight swapped for a transposed view of the
        # same shape must rebuild them rather than be read in the wrong order.
        tensors = tuple([(key, t.shape, t.stride(), t.dtype, t.device)
                         for table in (module._parameters, module._buffers) for key, t in table.items()
                         if t is not None])
        parts.append((name, type(module), settings, tensors))
    return tuple(parts)


def has_hooks(model: nn.Module) -> bool:
    """Whether any module has a function attached: lucidlm's hook points or torch's own hooks."""
    return any(module._forward_hooks or module._forward_pre_hooks or (isinstance(module, HookPoint) and module.active)
               for module in model.modules())


def hook_counter() -> tuple[int, int]:
    """Changes whenever a hook is attached anywhere (and, for hook points, removed)."""
    return HookPoint.version, RemovableHandle.next_id


def keep_input_guards(entries: Sequence[Any]) -> list[bool]:
    """dynamo guard filter: keep the guards on the step's arguments, the KV cache and global
    state; drop those on the model's modules (``structure_fingerprint`` covers them)."""
    return [not entry.orig_guard.source.is_unspecialized_nn_module() or entry.name.startswith(CACHE_SOURCE)
            for entry in entries]


def with_constant_floats(compiled: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """``compiled`` traced with the model's float settings (each norm's eps, attention's
    scale) as constants. With ``dynamic=True`` dynamo makes every float it reads off a module
    a symbol; the graph then uses them as constants anyway, inductor's pass that turns such
    symbols into tensors gives up, and the whole prompt graph is traced and compiled a second
    time (SmolLM2, AMD EPYC, 2 threads: the first ``generate --compile`` took 76 s, 34 s with
    constant floats; the lengths stay dynamic)."""
    def run(*args: Any) -> torch.Tensor:
        with torch._dynamo.config.patch(specialize_float=True):
            return compiled(*args)
    return run


def with_fixed_batch(compiled: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """``compiled`` (the prompt step) with dynamic lengths but a fixed batch size: one graph per
    batch size, as the decode step has. With the batch dynamic too, dynamo on torch 2.13 could not
    stamp the block region out for a batch of prompts (an internal KeyError while tracing) and
    fell back to tracing the blocks one by one for good (~11 s a trace for SmolLM2, every later
    prompt graph included). Arguments as ``Transformer.step``: ids (B, T), input_pos (T,),
    attention_mask (B, S) or None, ..."""
    def run(ids: torch.Tensor, input_pos: Any, attention_mask: Any, *rest: Any) -> torch.Tensor:
        torch._dynamo.mark_static(ids, 0)
        if attention_mask is not None:
            torch._dynamo.mark_static(attention_mask, 0)
        return compiled(ids, input_pos, attention_mask, *rest)
    return run


def with_blocks_traced_once(compiled: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """``compiled`` traced with the model's blocks as one region, stamped out once per block
    (``model/traced_once.py``). SmolLM2, AMD EPYC, 2 threads, warm inductor cache: the decode
    step's first call 19.9 -> 8.2 s (18.2 -> 6.1 in another run), the same tokens, the step
    as fast; ~12 us a call for the switch. A decode step is compiled again for every new
    cache length and batch size, so this is paid more than once.

    Where dynamo cannot stamp a region out it fails while tracing, before anything ran, and
    the step is then traced block by block for good, as without regions: a region's inputs
    must not alias (float projections fused into one matrix, CUDA's ``fuse_projections``, are
    views of it: UncapturedHigherOrderOpError), and dynamo has failed inside (an internal
    error: a prompt batch of dynamic size, before ``with_fixed_batch``). Anything else, or a
    failure without regions too, is raised as it is."""
    regions = True

    def run(*args: Any) -> torch.Tensor:
        nonlocal regions
        if regions:
            try:
                with blocks_traced_once():
                    return compiled(*args)
            except (torch._dynamo.exc.UncapturedHigherOrderOpError,  # dynamo is loaded by now
                    torch._dynamo.exc.InternalTorchDynamoError):
                regions = False
        return compiled(*args)
    return run


class CompiledSteps:
    """``step`` (``Transformer.step``) compiled twice: the decode step with fixed shapes and
    slim guards, the prefill with dynamic lengths and a fixed batch size (or eager when
    ``prefill`` is False). Both trace one block per kind of block (``with_blocks_traced_once``).

    mode / options / backend: as ``torch.compile`` takes them; the mode becomes its inductor
    options (``torch._inductor.list_mode_options``, exactly what torch does with a mode), so
    the guard filter can ride along. ``decode_options``: inductor settings for the decode step
    only, on top of ``options``."""

    def __init__(self, model: nn.Module, mode: Optional[str], options: Optional[dict[str, Any]],
                 backend: Any, prefill: bool, cuda_graphs: bool,
                 decode_options: Optional[dict[str, Any]] = None) -> None:
        self.model = model
        self.cuda_graphs = cuda_graphs
        self._settings = (mode, dict(options or {}), backend, prefill, dict(decode_options or {}))
        self._build()

    def _build(self) -> None:
        mode, options, backend, prefill, decode_only = self._settings
        if backend == "inductor":
            from torch._inductor import list_mode_options

            decode_options = {**(list_mode_options(mode, False) if mode else {}), **options, **decode_only}
            prefill_options = options  # no CUDA graph for a prompt pass: its shape changes every time
        else:
            decode_options, prefill_options = {}, {}  # modes and options are inductor's
        # isolate_recompiles: each compiled step keeps its own entries, so a decode step never
        # walks past the prefill's (or an earlier compile's) guards.
        isolate = {"isolate_recompiles": True} if HAS_ISOLATE else {}
        self.decode = with_blocks_traced_once(
            torch.compile(own_step(self.model), backend=backend, fullgraph=True, dynamic=False, **isolate,
                          options={**decode_options, "guard_filter_fn": keep_input_guards}))
        self.prefill = (with_fixed_batch(with_blocks_traced_once(with_constant_floats(
            torch.compile(own_step(self.model), backend=backend, fullgraph=True, dynamic=True, **isolate,
                          **({"options": prefill_options} if prefill_options else {})))))
                        if prefill else self.model.step)
        self.fingerprint = structure_fingerprint(self.model)
        self._look_for_hooks()

    # The compiled callables close over the model they were built for: a copy of them, in a
    # ``copy.deepcopy(model)``, ran the original's step (its weights, its KV cache) and gave the
    # copy's generations wrong tokens, and pickling failed on them. A copy keeps the settings and
    # builds its own steps for its own model at its first generation (the model may still be half
    # copied when this runs).
    def __getstate__(self) -> dict[str, Any]:
        return {"model": self.model, "cuda_graphs": self.cuda_graphs, "_settings": self._settings}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.fingerprint = None  # matches no model: check() builds the steps

    def _look_for_hooks(self) -> None:
        self.hook_count = hook_counter()
        self.hooked = has_hooks(self.model)

    def check(self) -> None:
        """Before a generation: compile again if the model changed since the trace."""
        if self.fingerprint is None or structure_fingerprint(self.model) != self.fingerprint:
            self._build()
        else:
            self._look_for_hooks()

    def decode_step(self) -> Callable[..., torch.Tensor]:
        """The callable for this step: compiled, or eager while the model has hooks."""
        # A hook attached since the last look moves a counter; a hook removed from a hooked
        # model may not (torch's handles), so a hooked model looks again each step (it runs
        # eagerly anyway, and the walk is cheap beside an eager step).
        if self.fingerprint is None:  # a copy's steps, not built yet (__setstate__)
            self._build()
        if self.hooked or hook_counter() != self.hook_count:
            self._look_for_hooks()
        return self.model.step if self.hooked else self.decode

    def prefill_step(self) -> Callable[..., torch.Tensor]:
        self.check()
        return self.model.step if self.hooked else self.prefill
