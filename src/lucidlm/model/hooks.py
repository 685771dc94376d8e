"""Hook points: named places where an activation can be read or replaced.

Every intermediate tensor of the model passes through a ``HookPoint``; its module path is
the hook's name (``blocks.0.attn.hook_pattern``), as in TransformerLens. A forward hook is
``fn(activation, hook) -> new_activation | None``; a backward hook is
``fn(grad, hook) -> new_grad | None`` and sees the gradient of the loss with respect to this
hook's output. With no function attached a hook point is a few attribute checks: ``__call__``
is overridden so it skips nn.Module's call machinery, which is what makes hook points free
when unused. torch's own module hooks (``register_forward_hook`` and the like, which generic
tools such as baukit attach by module name) still run: a hook point that has one goes
through nn.Module's machinery.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from lucidlm.errors import HookError

HookFn = Callable[[torch.Tensor, "HookPoint"], Optional[torch.Tensor]]


class HookPoint(nn.Module):
    # Bumped whenever any hook point gains or loses a function: a compiled decode loop reads
    # it once per step to notice hooks attached mid-generation (generation/compiled.py).
    version = 0
    # Set on a point when torch's own hooks are registered on it (register_forward_hook): one flag
    # for __call__ to read instead of torch's four hook dicts. A class default, so models
    # pickled without the attribute load.
    maybe_torch_hooked = False

    def __init__(self) -> None:
        super().__init__()
        self.fns: list[HookFn] = []
        self.bwd_fns: list[HookFn] = []
        self.name: str = ""  # filled in by Transformer once the module tree is built

    def add_hook(self, fn: HookFn, dir: str = "fwd") -> None:
        if dir not in ("fwd", "bwd"):
            raise HookError(f"hook direction {dir!r} at {self.name!r}: expected 'fwd' or 'bwd'.")
        (self.fns if dir == "fwd" else self.bwd_fns).append(fn)
        HookPoint.version += 1

    def remove_hooks(self, dir: str = "both") -> None:
        if dir in ("fwd", "both"):
            self.fns.clear()
        if dir in ("bwd", "both"):
            self.bwd_fns.clear()
        HookPoint.version += 1

    def remove_hook(self, fn: HookFn, dir: str = "fwd") -> None:
        """Detach one attachment of ``fn`` (the last, by identity: the same function may be
        attached twice, or elsewhere)."""
        fns = self.fns if dir == "fwd" else self.bwd_fns
        for i in range(len(fns) - 1, -1, -1):
            if fns[i] is fn:
                del fns[i]
                break
        HookPoint.version += 1

    @property
    def active(self) -> bool:
        return bool(self.fns) or bool(self.bwd_fns) or self._torch_hooked()

    def _torch_hooked(self) -> bool:
        """Whether torch's own hooks are registered on this point (``register_forward_hook``, ...)."""
        return bool(self._forward_hooks or self._forward_pre_hooks or self._backward_hooks or self._backward_pre_hooks)

    def _register_torch_hook(self, register: Callable[..., RemovableHandle], *args: Any,
                             **kwargs: Any) -> RemovableHandle:
        handle = register(*args, **kwargs)
        self.maybe_torch_hooked = True
        HookPoint.version += 1  # what caches which points are active (decode_block.py) looks again
        return handle

    # torch's own registrations, passed through with their arguments (see nn.Module's for them)
    def register_forward_hook(self, *args: Any, **kwargs: Any) -> RemovableHandle:
        return self._register_torch_hook(super().register_forward_hook, *args, **kwargs)

    def register_forward_pre_hook(self, *args: Any, **kwargs: Any) -> RemovableHandle:
        return self._register_torch_hook(super().register_forward_pre_hook, *args, **kwargs)

    def register_full_backward_hook(self, *args: Any, **kwargs: Any) -> RemovableHandle:
        return self._register_torch_hook(super().register_full_backward_hook, *args, **kwargs)

    def register_full_backward_pre_hook(self, *args: Any, **kwargs: Any) -> RemovableHandle:
        return self._register_torch_hook(super().register_full_backward_pre_hook, *args, **kwargs)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        if not self.fns and not self.bwd_fns and not self.maybe_torch_hooked:
            return x
        # A torch hook on the point (a plain register_forward_hook, baukit, nnsight) needs torch's
        # machinery around forward: skipping it always dropped such hooks silently.
        if self.maybe_torch_hooked and self._torch_hooked():  # (a handle's remove() leaves the flag set)
            return super().__call__(x)
        return self.forward(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Run the attached functions (``__call__`` skips this when there are none)."""
        for fn in self.fns:
            out = fn(x, self)
            if out is not None:
                _check_same_shape(out, x, fn, self.name, "activation")
                x = out
        if self.bwd_fns and x.requires_grad:
            x = x.view_as(x)  # a node of our own: its gradient is this hook's output's alone
            x.register_hook(self._grad_hook(list(self.bwd_fns)))  # bound now: removing hooks later keeps this pass's
        return x

    def _grad_hook(self, fns: list[HookFn]) -> Callable[[torch.Tensor], Optional[torch.Tensor]]:
        """TransformerLens's rule for several backward hooks on one point (torch's full backward
        hooks): each sees this output's own gradient, and the last one that returns a value sets
        the gradient passed on. Chained, a x2 then a x3 hook would pass on x6 where TL gives x3."""
        def on_grad(grad: torch.Tensor) -> Optional[torch.Tensor]:
            passed_on = None
            for fn in fns:
                out = fn(grad, self)
                if out is not None:
                    _check_same_shape(out, grad, fn, self.name, "gradient")
                    passed_on = out
            return passed_on
        return on_grad

    def extra_repr(self) -> str:
        return self.name


def _check_same_shape(out: object, x: torch.Tensor, fn: HookFn, name: str, what: str) -> None:
    fn_name = getattr(fn, "__name__", repr(fn))
    if not isinstance(out, torch.Tensor):
        raise HookError(f"hook function {fn_name} at {name!r} returned {type(out).__name__}; return a tensor of the "
                        f"{what}'s shape {tuple(x.shape)}, or None to leave it unchanged.")
    if out.shape != x.shape:
        raise HookError(f"hook function {fn_name} at {name!r} returned shape {tuple(out.shape)}, but the {what} "
                        f"there has shape {tuple(x.shape)}; return a tensor of the same shape (or None).")
