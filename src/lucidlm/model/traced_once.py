"""Decoder blocks that ``torch.compile`` traces once, not once per layer.

dynamo traces a forward pass op by op, so a model's graph costs as much to trace as it has
blocks, although every block runs the same code on weights of the same shapes: ~11 s per
graph for SmolLM2's 30 blocks on the AMD EPYC host, most of a warm ``--compile`` start.
Inside ``blocks_traced_once()``, ``run_block`` is a nested compile region
(``torch.compiler.nested_compile_region``): dynamo traces the first block, then re-checks
that trace's guards against each later block and stamps the same graph out where they hold.
A block that differs (Gemma's sliding-window layers, say) fails a guard and is traced on its
own; correctness never rests on the blocks being alike. dynamo then inlines the regions back
into one flat graph (``inline_invoke_subgraph``), so inductor sees and fuses exactly the
graph it saw before, and its C++ wrapper, which cannot call a subgraph, still works.

Outside the context (eager runs, hooks, training's compile), ``run_block`` is a plain call.
Needs torch >= 2.13 (the inlining switch); with an older torch the blocks are traced one by one.
The switch is process-wide, as dynamo's config is: compiled generations in several threads stay
correct (a region outside a trace is a plain call; a step traced either way is guarded on
``_active``) but may trace a step twice.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
from torch import nn

# Each distinct block kind keeps one traced entry; torch raises past this many. Far above any
# real model's count of block kinds, so a model of all-different blocks is traced block by
# block (as without the region), never refused.
MAX_BLOCK_KINDS = 4096

_active = False  # read by run_block; dynamo guards on it, so a compiled step sees a constant
_block_region = None  # made at the first compiled call: torch._dynamo is not imported before


def supported() -> bool:
    """Whether this torch can inline nested compile regions (2.13 and later)."""
    return hasattr(torch._dynamo.config, "inline_invoke_subgraph")


def _block_call(block: nn.Module, *args: Any) -> torch.Tensor:
    return block(*args)


def run_block(block: nn.Module, *args: Any) -> torch.Tensor:
    """``block(*args)``; traced once per kind of block inside ``blocks_traced_once()``."""
    return _block_region(block, *args) if _active else block(*args)


@contextlib.contextmanager
def blocks_traced_once() -> Iterator[None]:
    """Around a call of a compiled step: mark the blocks as one region and have dynamo inline
    it back. Re-entrant (each level restores what it found)."""
    global _active, _block_region
    if not supported():
        yield
        return
    if _block_region is None:
        _block_region = torch.compiler.nested_compile_region(_block_call, max_reuse_entries=MAX_BLOCK_KINDS)
    config = torch._dynamo.config
    before = (_active, config.inline_invoke_subgraph)
    _active, config.inline_invoke_subgraph = True, True
    try:
        yield
    finally:
        _active, config.inline_invoke_subgraph = before
