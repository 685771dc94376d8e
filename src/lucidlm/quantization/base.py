"""What every quantized layer shares: the ``QuantizedLinear`` contract and the embedding.

A scheme (``int8.py``, ``int4.py``) is one subclass of ``QuantizedLinear`` that says how a
float matrix becomes integer codes plus per-group scales, how they are stored, and which
kernel multiplies by them. Everything else (swapping modules, saving, GGUF) talks to this
contract only, so a new scheme is one new file registered in ``SCHEMES``.

Two layouts of the same numbers:
- the *plain* layout is what ``state_dict`` holds and the safetensors file stores
  (documented per scheme, independent of torch's kernels);
- the *kernel* layout is whatever the fastest matmul on the device wants (for int4 on CPU,
  torch's opaque packed tiles). ``_load_from_state_dict`` converts plain -> kernel.

Weights are buffers, not parameters: they cannot train, and asking a quantized module to
train raises a QuantizationError that names the fix.
"""

from __future__ import annotations

from typing import Any, ClassVar, Optional

import torch
from torch import nn

from lucidlm.devices import as_dtype
from lucidlm.errors import QuantizationError
from lucidlm.quantization import blocks_kernel
from lucidlm.validation import check_int

# Matmuls with quantized weights run in this dtype on CPU: torch's int8/int4 weight kernels
# are fast only with bfloat16 activations (their float32 paths are 10-50x slower here).
DEFAULT_COMPUTE_DTYPE = torch.bfloat16
BLOCKS_KERNEL_DTYPES = (torch.float32, torch.bfloat16)  # the activations lucidlm's kernel reads and writes


def check_group_size_value(group_size: Any, name: str = "group_size") -> Optional[int]:
    """A group size as given: None (the scheme's default) or a whole number >= 1. A bool (True
    would be groups of 1) or a float (even 32.0) is refused, as every other count is; ``name``
    is what the message calls it (``--group-size`` on the command line)."""
    if group_size is None:
        return None
    return check_int(group_size, name, QuantizationError, low=1,
                     fix="pass one such as 32, or leave it out for the scheme's default")


def check_group_size(name: str, in_features: int, group_size: Optional[int], scheme: type["QuantizedLinear"]) -> None:
    """Refuse a group size that is not a positive whole number, that does not tile
    ``in_features``, or that the scheme's kernels cannot run."""
    if group_size is None:
        return
    check_group_size_value(group_size, f"{name}: group_size")
    allowed = scheme.group_sizes
    if in_features % group_size:
        divisors = [g for g in allowed or (16, 32, 64, 128, 256) if in_features % g == 0]
        if allowed and not divisors:  # "use a group size that divides it" could not be followed
            raise QuantizationError(
                f"{name}: the input width {in_features} is not a multiple of any group size {scheme.scheme} takes "
                f"({', '.join(map(str, allowed))}), so {scheme.scheme} cannot quantize this layer; use "
                f"quantize='int8' (per channel, group_size=None, takes any width).")
        raise QuantizationError(
            f"{name}: group_size={group_size!r} does not divide the input width {in_features}, so {scheme.scheme} "
            f"groups cannot tile the rows. Use a group size that divides {in_features}"
            f"{' (e.g. ' + ', '.join(map(str, divisors)) + ')' if divisors else ''}."
        )
    if allowed and group_size not in allowed:
        raise QuantizationError(
            f"{name}: {scheme.scheme} takes groups of {', '.join(map(str, allowed))} (the sizes its CPU kernels run), "
            f"not {group_size}; use one of those.")


def check_finite_weight(name: str, weight: torch.Tensor,
                        compute_dtype: torch.dtype = DEFAULT_COMPUTE_DTYPE) -> None:
    """Refuse a weight holding NaN or inf: its group's scale would carry it into every code of
    the group (and the model's logits), where the float model had one bad value. Refuse too a
    weight whose scales ``compute_dtype`` cannot hold (float16 stops at 65504): they would be
    inf, and the logits NaN. Scales and int4 zeros lie within the weight's own range."""
    low, high = torch.aminmax(weight.detach().float())
    if not (torch.isfinite(low) and torch.isfinite(high)):
        bad = int((~torch.isfinite(weight.detach())).sum())
        raise QuantizationError(f"{name}: the weight holds {bad} NaN or infinite value(s), so it cannot be quantized; "
                                f"the model is damaged (a diverged run?): load it again from a good file.")
    largest, limit = max(-float(low), float(high)), torch.finfo(compute_dtype).max
    if largest > limit:
        raise QuantizationError(f"{name}: the weight reaches {largest:.3g}, beyond what {compute_dtype} scales hold "
                                f"({limit:.6g}); use compute_dtype=torch.bfloat16 (float32's range).")


def kernel_layout_fits(out_features: int, in_features: int, group_size: Optional[int],
                       compute_dtype: torch.dtype = DEFAULT_COMPUTE_DTYPE) -> bool:
    """Whether a CPU matrix of this shape, grouping and compute dtype can use lucidlm's kernel
    (built and supported here), for a layer made where it is preferred (``blocks_kernel.prefer``)."""
    return compute_dtype == torch.bfloat16 and blocks_kernel.fits(out_features, in_features, group_size) and \
        blocks_kernel.available()


class QuantizedLinear(nn.Module):
    """y = x @ dequantize(W).T + b, with W kept as integer codes and scales.

    Subclasses set ``scheme`` and implement ``quantize_weight`` (float -> plain tensors),
    ``dequantize_plain`` (plain -> float, the scheme's definition), ``_install`` (plain ->
    the module's kernel buffers) and ``_matmul``.
    """

    scheme: ClassVar[str] = ""
    default_group_size: ClassVar[Optional[int]] = None
    group_sizes: ClassVar[Optional[tuple[int, ...]]] = None  # the only ones its kernels run; None: any divisor
    plain_names: ClassVar[tuple[str, ...]] = ()  # plain-layout tensors, in state_dict order
    compute_dtypes: ClassVar[tuple[torch.dtype, ...]] = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
    # Whether the CPU matmul is lucidlm's own (``blocks_kernel.py``) instead of torch's: wanted
    # when the layer is made inside ``blocks_kernel.prefer()``, used where it fits (``_install``).
    uses_blocks_kernel = False

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 group_size: Optional[int] = None, compute_dtype: torch.dtype = DEFAULT_COMPUTE_DTYPE) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.group_size = group_size
        self.compute_dtype = compute_dtype
        self.installs = 0  # bumped whenever the weights are replaced (model/fused.py watches it)
        self.wants_blocks_kernel = blocks_kernel.preferred()
        self.bias: Optional[torch.Tensor]
        self.register_buffer("bias", torch.zeros(out_features) if bias else None)

    # -- construction ------------------------------------------------------------------
    @classmethod
    def from_float(cls, linear: nn.Linear, group_size: Optional[int] = None, name: str = "linear",
                   compute_dtype: torch.dtype = DEFAULT_COMPUTE_DTYPE) -> "QuantizedLinear":
        group_size = cls.default_group_size if group_size is None else group_size
        check_group_size(name, linear.in_features, group_size, cls)
        check_finite_weight(name, linear.weight, compute_dtype)
        plain = cls.quantize_weight(linear.weight.detach().float(), group_size, compute_dtype)
        bias = linear.bias.detach() if linear.bias is not None else None
        return cls.from_plain(plain, linear.in_features, group_size, bias, compute_dtype)

    @classmethod
    def from_plain(cls, plain: dict[str, torch.Tensor], in_features: int, group_size: Optional[int],
                   bias: Optional[torch.Tensor] = None,
                   compute_dtype: torch.dtype = DEFAULT_COMPUTE_DTYPE) -> "QuantizedLinear":
        """A module from tensors already in the plain layout (a file, a GGUF block map)."""
        out_features = plain[cls.plain_names[0]].shape[0]
        module = cls(in_features, out_features, bias is not None, group_size, compute_dtype)
        module._install({k: v for k, v in plain.items()})
        if bias is not None:
            module.bias = bias.to(torch.float32).clone()
        return module

    @staticmethod
    def quantize_weight(weight: torch.Tensor, group_size: Optional[int],
                        scale_dtype: torch.dtype = DEFAULT_COMPUTE_DTYPE) -> dict[str, torch.Tensor]:
        """(out, in) float -> the plain tensors, scales in ``scale_dtype``."""
        raise NotImplementedError

    @staticmethod
    def dequantize_plain(plain: dict[str, torch.Tensor], group_size: Optional[int]) -> torch.Tensor:
        raise NotImplementedError

    def _install(self, plain: dict[str, torch.Tensor]) -> None:
        raise NotImplementedError

    def plain_state(self) -> dict[str, torch.Tensor]:
        """This module's weight in the plain layout (what a file stores)."""
        raise NotImplementedError

    def dequantized_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """Output rows ``rows`` (T,) of the float matrix, float32 (T, in): what a tied embedding's
        lookup reads (``QuantizedEmbedding.source``). lucidlm's kernel layout gathers and decodes
        those rows only (``blocks_kernel.dequantized_rows``); other layouts go through their
        plain tensors (``plain_state``, which torch's int4 tiles rebuild whole)."""
        operands = self.blocks_operands()
        if operands is not None:
            return blocks_kernel.dequantized_rows(*operands, rows)
        plain = {name: t.index_select(0, rows) for name, t in self.plain_state().items()}
        return self.dequantize_plain(plain, self.group_size).float()

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def blocks_operands(self) -> Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """(blocks, scales, extra), as ``blocks_kernel.blocks_mm`` reads them, where this layer's
        weights are on lucidlm's kernel; else None. ``model/decode_block.py`` hands them to its
        one-call decode step."""
        return None

    def blocks_kernel_fits(self, out_features: int) -> bool:
        """Whether CPU weights of this layer go to lucidlm's kernel (``blocks_kernel.py``)."""
        return self.wants_blocks_kernel and kernel_layout_fits(out_features, self.in_features, self.group_size,
                                                               self.compute_dtype)

    # -- use ---------------------------------------------------------------------------
    def matmul_dtype(self, activations: torch.dtype) -> torch.dtype:
        """The dtype the product runs in. lucidlm's kernel reads float32 and bfloat16 inputs
        alike (it quantizes them to int8 codes either way) and writes its output in the
        input's dtype, so a float32 residual stream goes through without two conversions per
        layer; torch's kernels take ``compute_dtype`` only. Other activations (a model's
        ``.half()`` or ``.double()``) go through lucidlm's kernel in float32: through bfloat16,
        a float16 model's logits were twice as far from the exact product's as a float32 model's
        (the output rounded to 8 bits), and a float64 one's too."""
        if self.uses_blocks_kernel:
            return activations if activations in BLOCKS_KERNEL_DTYPES else torch.float32
        return self.compute_dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.requires_grad and torch.is_grad_enabled():  # a gradient to x wanted (hooks, attribution)
            return FrozenWeightProduct.apply(x, self)  # which comes back here, with grad mode off
        shape = x.shape
        # contiguous: torch's int4/int8 ops refuse a strided view (x[:, -1:] unembedded without a final norm)
        rows = as_dtype(x.reshape(-1, shape[-1]), self.matmul_dtype(x.dtype)).contiguous()  # (M, in)
        y = self._matmul(rows)  # (M, in) -> (M, out)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return as_dtype(y, x.dtype).reshape(*shape[:-1], self.out_features)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The float matrix (out, in) these codes stand for."""
        return self.dequantize_plain(self.plain_state(), self.group_size).to(dtype)

    def describe(self) -> dict[str, Any]:
        return {"scheme": self.scheme, "group_size": self.group_size}

    @property
    def float_parameter_count(self) -> int:
        """The float parameters these codes stand for (weight and bias), for parameter counts."""
        return self.in_features * self.out_features + (self.out_features if self.bias is not None else 0)

    @property
    def weight(self) -> torch.Tensor:
        raise QuantizationError(
            f"this {type(self).__name__} stores {self.scheme} codes, not a float weight; call .dequantize() "
            f"for the float matrix, or {FLOAT_LOAD_HINT}."
        )

    def _apply(self, fn: Any, recurse: bool = True) -> "QuantizedLinear":
        # .to(dtype) must not turn codes into floats or change the scales the kernel needs;
        # a device move re-installs the plain tensors, so each device gets its own kernel layout.
        device = next(self.buffers()).device
        target = fn(torch.zeros((), device=device)).device
        if target != device:
            self._install({k: v.to(target) for k, v in self.plain_state().items()})
            if self.bias is not None:
                self.bias = self.bias.to(target)
        return self

    def train(self, mode: bool = True) -> "QuantizedLinear":
        if mode:
            raise_training_error(self)
        return super().train(False)

    def _save_to_state_dict(self, destination: dict, prefix: str, keep_vars: bool) -> None:
        for name, tensor in self.plain_state().items():
            destination[prefix + name] = tensor
        if self.bias is not None:
            destination[prefix + "bias"] = self.bias

    def _load_from_state_dict(self, state_dict: dict, prefix: str, local_metadata: dict, strict: bool,
                              missing_keys: list, unexpected_keys: list, error_msgs: list) -> None:
        plain = {}
        for name in self.plain_names:
            if prefix + name in state_dict:
                plain[name] = state_dict[prefix + name]
            else:
                missing_keys.append(prefix + name)
        if len(plain) == len(self.plain_names):
            self._install(plain)
        if self.bias is not None:
            if prefix + "bias" in state_dict:
                self.bias = state_dict[prefix + "bias"].to(torch.float32).clone()
            else:
                missing_keys.append(prefix + "bias")

    def extra_repr(self) -> str:
        group = "per channel" if self.group_size is None else f"group {self.group_size}"
        return (f"in_features={self.in_features}, out_features={self.out_features}, {self.scheme} {group}, "
                f"compute {str(self.compute_dtype).replace('torch.', '')}, bias={self.bias is not None}")


class FrozenWeightProduct(torch.autograd.Function):
    """A quantized layer's product with a gradient to its input: the kernels have no autograd
    formula (some custom ops would hand back None, silently), but with the weights frozen the
    gradient is grad_y @ W, W dequantized in the dtype the forward multiplied in (so it is the
    gradient of the same model with float weights). Used only while autograd records: inference
    calls the kernel directly."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, layer: "QuantizedLinear") -> torch.Tensor:
        ctx.layer, ctx.x_dtype = layer, x.dtype
        return layer.forward(x)  # autograd runs this with grad mode off: the kernel path

    @staticmethod
    def backward(ctx: Any, grad_y: torch.Tensor) -> tuple[Optional[torch.Tensor], None]:
        layer = ctx.layer
        dtype = layer.matmul_dtype(ctx.x_dtype)
        weight = layer.dequantize(dtype).to(grad_y.device)  # (out, in)
        grad_x = grad_y.to(dtype) @ weight  # (..., out) -> (..., in)
        return grad_x.to(ctx.x_dtype), None


class QuantizedEmbedding(nn.Module):
    """A token embedding kept in a scheme's plain layout: a lookup gathers the T rows it
    needs and dequantizes only those, so the table never exists in float.

    Tied to a quantized unembedding whose kernel layout is not the plain one (lucidlm's CPU
    kernel), it holds no codes of its own (``reading``): lookups gather rows from the
    unembedding's buffers, so the table is in memory once (SmolLM2's Q8_0 table: 32 MB)."""

    def __init__(self, linear_cls: type[QuantizedLinear], plain: dict[str, torch.Tensor], embedding_dim: int,
                 group_size: Optional[int], dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.linear_cls, self.group_size, self.embedding_dim = linear_cls, group_size, embedding_dim
        self.dtype = dtype  # what lookups return: the model's residual-stream dtype
        # The tied unembedding read instead of own buffers; not a registered submodule (the
        # model owns it as ``unembed``: registering it here would list it twice).
        self.__dict__["source"] = None
        for name, tensor in plain.items():
            self.register_buffer(name, tensor)

    @classmethod
    def tied_to(cls, linear: QuantizedLinear, embedding_dim: int, dtype: torch.dtype) -> "QuantizedEmbedding":
        """The token embedding of a model whose unembedding ``linear`` is the same matrix:
        reading ``linear``'s rows where its kernel layout is not the plain one, else
        sharing its plain tensors (no copy)."""
        if linear.uses_blocks_kernel:
            embedding = cls(type(linear), {}, embedding_dim, linear.group_size, dtype)
            embedding.__dict__["source"] = linear
            return embedding
        return cls(type(linear), linear.plain_state(), embedding_dim, linear.group_size, dtype)

    @property
    def scheme(self) -> str:
        return self.linear_cls.scheme

    @property
    def device(self) -> torch.device:
        if self.source is not None:
            return next(self.source.buffers()).device
        return getattr(self, self.linear_cls.plain_names[0]).device

    @property
    def num_embeddings(self) -> int:
        if self.source is not None:
            return self.source.out_features
        return getattr(self, self.linear_cls.plain_names[0]).shape[0]

    @property
    def float_parameter_count(self) -> int:
        """The float table's size, for parameter counts."""
        return self.num_embeddings * self.embedding_dim

    def plain_state(self) -> dict[str, torch.Tensor]:
        if self.source is not None:
            return self.source.plain_state()
        return {name: getattr(self, name) for name in self.linear_cls.plain_names}

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1).long()  # (B*T,) int64, as the kernel layout's gather takes them (no copy if so)
        if self.source is not None:
            rows = self.source.dequantized_rows(flat)
        else:
            plain = {name: t.index_select(0, flat) for name, t in self.plain_state().items()}
            rows = self.linear_cls.dequantize_plain(plain, self.group_size)
        return rows.to(self.dtype).reshape(*ids.shape, self.embedding_dim)  # (B, T, d)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.linear_cls.dequantize_plain(self.plain_state(), self.group_size).to(dtype)

    def describe(self) -> dict[str, Any]:
        return {"scheme": self.scheme, "group_size": self.group_size}

    @property
    def weight(self) -> torch.Tensor:
        raise QuantizationError(
            f"this QuantizedEmbedding stores {self.scheme} codes, not a float table; call .dequantize() for "
            f"the float matrix, or {FLOAT_LOAD_HINT}."
        )

    def _save_to_state_dict(self, destination: dict, prefix: str, keep_vars: bool) -> None:
        if self.source is None:
            super()._save_to_state_dict(destination, prefix, keep_vars)
            return
        for name, tensor in self.plain_state().items():  # the table is saved under embed., as untied
            destination[prefix + name] = tensor

    def _load_from_state_dict(self, state_dict: dict, prefix: str, local_metadata: dict, strict: bool,
                              missing_keys: list, unexpected_keys: list, error_msgs: list) -> None:
        if self.source is None:
            super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                          unexpected_keys, error_msgs)
            return
        missing = [prefix + n for n in self.linear_cls.plain_names if prefix + n not in state_dict]
        missing_keys.extend(missing)
        if not missing:  # one matrix: loading the table loads the unembedding
            self.source._install({n: state_dict[prefix + n] for n in self.linear_cls.plain_names})

    def _apply(self, fn: Any, recurse: bool = True) -> "QuantizedEmbedding":
        # model.to(dtype) must not turn integer codes into floats; it sets the output dtype.
        probe = fn(torch.zeros((), dtype=self.dtype))
        if probe.is_floating_point():
            self.dtype = probe.dtype
        if self.source is not None:
            return self  # the codes are the unembedding's, which moves itself
        for name in self.linear_cls.plain_names:
            tensor = getattr(self, name)
            moved = fn(tensor)
            setattr(self, name, moved if not tensor.is_floating_point() or moved.dtype == tensor.dtype
                    else tensor.to(moved.device))
        return self

    def train(self, mode: bool = True) -> "QuantizedEmbedding":
        if mode:
            raise_training_error(self)
        return super().train(False)

    def extra_repr(self) -> str:
        group = "per channel" if self.group_size is None else f"group {self.group_size}"
        return f"{self.num_embeddings}, {self.embedding_dim}, {self.scheme} {group}"


def dense_weight(module: nn.Module) -> torch.Tensor:
    """The float matrix (out, in) or table (vocab, d) of a linear layer or embedding, quantized
    or not, for code that reads weights (interpretability): a quantized module's codes
    dequantized to float32, else the module's own weight, detached."""
    if isinstance(module, (QuantizedLinear, QuantizedEmbedding)):
        return module.dequantize(torch.float32)
    return module.weight.detach()


FLOAT_LOAD_HINT = ("load the model as float (lucidlm.load(..., dtype='float32'); the embedded model's default "
                   "keeps its file's quantized layers), or, for a directory saved quantized, which has no float "
                   "weights to load, turn the codes back into float matrices: lucidlm.quantization.dequantize(model)")


def scheme_label(module: nn.Module) -> str:
    """How a quantized module's codes are laid out, for messages: "int8, per channel", "int4, groups of 32"."""
    return module.scheme + (f", groups of {module.group_size}" if module.group_size else ", per channel")


def first_quantized(model: nn.Module) -> Optional[nn.Module]:
    """The first quantized module of ``model`` (a QuantizedLinear or QuantizedEmbedding), or None."""
    return next((m for m in model.modules() if isinstance(m, (QuantizedLinear, QuantizedEmbedding))), None)


def check_float_model(model: nn.Module, action: str) -> None:
    """Refuse ``action`` (adding LoRA, adapters, a prefix: anything that trains) on a model
    with quantized layers, naming the fix, before anything is changed."""
    quantized = first_quantized(model)
    if quantized is not None:
        raise QuantizationError(f"{action} needs a float model, but this one holds quantized weights "
                                f"({quantized.scheme} codes, which have no gradient); {FLOAT_LOAD_HINT}.")


def raise_training_error(module: nn.Module) -> None:
    raise QuantizationError(
        f"{type(module).__name__} holds quantized weights ({getattr(module, 'scheme', '?')}), which cannot be "
        f"trained: they are integer codes with no gradient. Train a float model and quantize afterwards: "
        f"{FLOAT_LOAD_HINT}."
    )
