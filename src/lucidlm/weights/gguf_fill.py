"""Filling a model skeleton with a GGUF file's planned tensors, several tensors at a time.

Converting one tensor (Q4_1 blocks to bfloat16 rows, or to int4 tiles) is a chain of small
torch ops. Run on torch's own threads, every op is a parallel region that waits for all of
them, and a loaded machine deschedules one of them in almost every region: measured for
SmolLM2 on 2 cores at load average 3, a warm load took 2.2-5.4 s on 2 threads, 0.4-0.6 s
on one. So each op runs on one thread, and ``workers`` Python threads convert whole
tensors side by side instead (torch releases the GIL inside its ops): on a quiet machine
they keep the cores busy, and on a loaded one a descheduled worker holds up only its own
tensor. A file whose matrices all go into their layout as they are (GGUF Q4/Q8_0 kept
quantized: one C pass each) needs no workers and converts on the calling thread.

A worker queues each tensor's finiteness check (``weights/finite.py``) and lets the file's
pages go; the calling thread puts the converted tensors in place, in the file's order, and
hands freed memory back (``host_memory.py``). The workers never change the model.
"""

from __future__ import annotations

import collections
import contextlib
import math
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterator, Optional

import torch
from torch import nn

from lucidlm.model.transformer import Transformer
from lucidlm.weights.finite import FiniteCheck
from lucidlm.weights.gguf_quants import EXACT
from lucidlm.weights.gguf_stream import (Planned, dequantize_tensor, float_weight, int4_from_blocks, int8_from_blocks,
                                         quantized_plain)
from lucidlm.host_memory import Scratch, TrimEvery, trim

MAX_WORKERS = 8  # beyond this, a load is bound by memory bandwidth, not by cores


def stream_into(model: Transformer, planned: list[Planned], source: str, dtype: torch.dtype,
                device: str | torch.device, release: Callable[[Any], None] = lambda tensor: None,
                progress: Optional[Callable[[Any], Any]] = None) -> Transformer:
    """Fill ``model`` (a ``Transformer.skeleton``) with the planned tensors; ``release(tensor)``
    is called once a tensor is converted (the reader drops its pages). Where some tensor is
    converted through its float values, as many tensors as torch has threads (at most
    ``MAX_WORKERS``) are converted at once; else one at a time here. Every tensor's values
    (or block scales) are checked finite; the model is returned only if all are."""
    threads = torch.get_num_threads()
    # A file whose every matrix goes straight into its layout (one C pass or a copy: the
    # embedded model's default) converts on this thread: workers would only add their
    # hand-offs (warm load of SmolLM2, 2 threads: ~0.40 s with them, ~0.31 s without).
    workers = max(1, min(threads, MAX_WORKERS)) if any(map(_converts_through_floats, planned)) else 0
    check = FiniteCheck(source)
    trims = TrimEvery()
    local = threading.local()  # each worker's Scratch: the float32 rows / int32 codes of its tensor
    outputs = _fused_outputs(model, planned, device)

    def convert(item: Planned) -> list[tuple[str, Any]]:
        with torch.no_grad():  # grad mode is per thread
            if not hasattr(local, "scratch"):
                local.scratch = Scratch()
            finite, placements = _convert(model, item, source, dtype, device, local.scratch, outputs.get(item.module))
            check.add(item.tensor.name, *finite)  # before the release: the scales are read from the map
            release(item.tensor)
            return placements

    pool = ThreadPoolExecutor(workers, thread_name_prefix="lucidlm-load") if workers else None
    try:
        with torch.no_grad(), _one_thread_per_op(threads):
            results = _in_order(pool, convert, planned, ahead=workers) if pool else map(convert, planned)
            for item, placements in zip(planned if progress is None else progress(planned), results):
                for name, value in placements:
                    _place(model, name, value)
                trims.step(_float32_bytes(item.tensor))
    finally:  # on an error (or Ctrl-C), tensors not started yet are not converted for nothing
        if pool:
            pool.shutdown(wait=True, cancel_futures=True)
    check.verify()
    trim()
    return model.materialize(device)  # the position tables; every weight is in place


def _converts_through_floats(item: Planned) -> bool:
    """Whether a tensor's conversion is a chain of torch ops over its values (dequantizing,
    quantizing again, a float matrix changing dtype), not a copy of its blocks as they are."""
    exact = item.target is not None and EXACT.get(item.tensor.tensor_type.name) == item.target
    return not exact and len(item.tensor.shape) > 1


def _in_order(pool: ThreadPoolExecutor, fn: Callable[[Any], Any], items: list[Any], ahead: int) -> Iterator[Any]:
    """``fn(item)`` for each item, in order, with at most ``ahead`` conversions in flight:
    workers running far ahead of the placing would hold many converted tensors'
    temporaries at once."""
    pending: collections.deque = collections.deque()
    for item in items:
        pending.append(pool.submit(fn, item))
        if len(pending) > ahead:
            yield pending.popleft().result()
    while pending:
        yield pending.popleft().result()


@contextlib.contextmanager
def _one_thread_per_op(threads: int) -> Iterator[None]:
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _fused_outputs(model: Transformer, planned: list[Planned],
                   device: str | torch.device) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """{module name: (codes, scales, zeros)} to convert a Q4 matrix into, for the matrices that
    ``fuse_projections`` will join (``model/fused.py``: q/k/v, gate/up) where all of a fused
    layer's parts go to lucidlm's kernel layout: one buffer per fused layer, sliced per part in
    its order, so each part is written where the fused layer reads it and fusing copies
    nothing (``blocks_kernel.joined_rows``; a copy of ~45 MB for SmolLM2)."""
    from lucidlm.model.fused import FUSED
    from lucidlm.quantization import DEFAULT_COMPUTE_DTYPE, blocks_kernel
    from lucidlm.quantization.base import kernel_layout_fits
    from lucidlm.weights.gguf_quants import stored_blocks

    if torch.device(device).type != "cpu" or not blocks_kernel.preferred():
        return {}
    by_module = {item.module: item for item in planned}

    def layout(item: Optional[Planned]) -> Optional[tuple[int, int]]:  # (rows, groups) of an exact Q4 matrix
        if item is None or item.target != ("int4", 32) or EXACT.get(item.tensor.tensor_type.name) != item.target:
            return None
        N, G, _ = stored_blocks(item.tensor).shape
        return (N, G) if kernel_layout_fits(N, G * 32, 32, DEFAULT_COMPUTE_DTYPE) else None

    outputs = {}
    for name, module in model.named_modules():
        for attr, names in FUSED:
            if not hasattr(module, attr):
                continue
            items = [by_module.get(f"{name}.{part}" if name else part) for part in names]
            shapes = [layout(item) for item in items]
            if any(shape is None for shape in shapes) or len({G for _, G in shapes}) != 1:
                continue
            blocks, G = sum(N for N, _ in shapes) // blocks_kernel.ROW_BLOCK, shapes[0][1]
            codes = torch.empty((blocks, G, 256), dtype=torch.uint8)
            scales, zeros = (torch.empty((blocks, G, 16), dtype=DEFAULT_COMPUTE_DTYPE) for _ in range(2))
            start = 0
            for item, (N, _) in zip(items, shapes):
                stop = start + N // blocks_kernel.ROW_BLOCK
                outputs[item.module] = (codes[start:stop], scales[start:stop], zeros[start:stop])
                start = stop
    return outputs


def _convert(model: Transformer, item: Planned, source: str, dtype: torch.dtype, device: str | torch.device,
             scratch: Scratch, out: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None
             ) -> tuple[tuple[Any, str], list[tuple[str, Any]]]:
    """((values to check finite, what they are), [(parameter or module name, its new value)])
    for one planned tensor; reads the model's skeleton, changes nothing. ``out``: where an
    exact Q4 matrix's kernel layout goes (``_fused_outputs``)."""
    from lucidlm.quantization import DEFAULT_COMPUTE_DTYPE, QuantizedEmbedding
    from lucidlm.quantization.swap import scheme_class
    from lucidlm.weights.gguf_quants import finite_parts

    raw = finite_parts(item.tensor)  # from the file's bytes: float values or f16 block scales
    if item.target is None:
        weight = float_weight(item, source, dtype, scratch)
        return (raw or (weight, "values")), [(item.ours, weight.to(device))]
    finite = raw or (torch.zeros(0), "values")  # empty: nothing to queue
    if raw is None:  # a type whose blocks we cannot read: check its floats now, before quantizing them
        FiniteCheck(source).add_all({item.tensor.name: dequantize_tensor(item.tensor, source)}).verify()
    scheme, group_size = item.target
    old = model.get_submodule(item.module)
    lookup_only = isinstance(old, nn.Embedding) and not model.config.tie_embeddings
    if EXACT.get(item.tensor.tensor_type.name) == item.target and not lookup_only:  # no float detour
        linear, checked = int4_from_blocks(item, device, out) if scheme == "int4" else int8_from_blocks(item, device)
        if checked:  # its C pass read every block scale and found them finite: no second pass
            finite = (torch.zeros(0), "values")
    else:
        plain = {k: v.to(device) for k, v in quantized_plain(item, source, DEFAULT_COMPUTE_DTYPE, scratch).items()}
        if lookup_only:  # an untied token table is only ever gathered from: the plain layout
            return finite, [(item.module, QuantizedEmbedding(scheme_class(scheme), plain, old.embedding_dim,
                                                             group_size, dtype))]
        linear = scheme_class(scheme).from_plain(plain, int(item.tensor.shape[0]), group_size)  # GGUF: [in, out]
    if isinstance(old, nn.Embedding):  # tied: one matrix, the embedding's lookups read the unembedding's codes
        return finite, [(item.module, QuantizedEmbedding.tied_to(linear, old.embedding_dim, dtype)), ("unembed", linear)]
    return finite, [(item.module, linear)]


def _place(model: nn.Module, name: str, value: Any) -> None:
    """A module replaces the skeleton's module ``name``; a tensor becomes parameter (or
    buffer) ``name``."""
    from lucidlm.quantization.swap import set_module

    if isinstance(value, nn.Module):
        # A bias placed before its weight (Qwen 2's attn_q.bias sorts before attn_q.weight in
        # llama.cpp's files) is on the float layer this quantized one replaces: keep it.
        bias = getattr(model.get_submodule(name), "bias", None)
        if isinstance(bias, torch.Tensor) and not bias.is_meta and getattr(value, "bias", False) is None:
            value.bias = bias.detach().to(torch.float32)
        set_module(model, name, value)
        return
    module_name, _, leaf = name.rpartition(".")
    parent = model.get_submodule(module_name) if module_name else model
    if leaf in parent._parameters:
        parent._parameters[leaf] = nn.Parameter(value, requires_grad=parent._parameters[leaf].requires_grad)
    else:
        parent._buffers[leaf] = value


def _float32_bytes(tensor: Any) -> int:
    return 4 * math.prod(tensor.shape.tolist())  # about what converting it allocated and freed
