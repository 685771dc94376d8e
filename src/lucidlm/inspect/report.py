"""A one-file HTML report of one forward pass: tokens, top-k predictions, attention maps, logit lens.

The page needs no network and no server: the numbers are embedded as JSON and drawn by a
few lines of inline JavaScript into SVG, so the attention map re-draws when another layer
or head is picked. Stable ids for tests and styling: ``#tokens`` (``.token`` spans),
``#topk``, ``#layer-select``, ``#layer-slider``, ``#head-select``, ``#attention-heatmap``,
``#logit-lens``, and the data itself in ``#report-data``. ``report.html#layer=3&head=1`` opens
that attention map.

This file gathers the numbers (``report_data``) and fills the page; the page itself (HTML,
CSS and the drawing JavaScript) is the template in ``report_page.py``.
"""

from __future__ import annotations

import html
from pathlib import Path
from typing import Any, Optional, Union

import torch
from torch import nn

from lucidlm.errors import InputError
from lucidlm.outputs import check_output_file
from lucidlm.staging import atomic_write_text
from lucidlm.suggest import keywords_checked
from lucidlm.inspect.cache import run_with_cache, token_columns
from lucidlm.inspect.logit_lens import logit_lens
from lucidlm.inspect.report_page import PAGE
from lucidlm.inspect.steps import to_str_tokens, to_tokens
from lucidlm.display import iframe_html, script_json

# Every attention map is embedded (n_layers * n_heads * T^2 numbers): keep pages loadable.
MAX_REPORT_TOKENS = 256


@torch.no_grad()
def report_data(model: nn.Module, text: str, top_k: int = 5) -> dict[str, Any]:
    """Everything the page shows, as plain JSON-ready data."""
    if not isinstance(text, str):
        raise InputError(f"the report takes one text (a str), got a {type(text).__name__}; for several texts, "
                         f"build one report per text.")
    if not text:
        raise InputError("the text to inspect is empty; pass the text to run through the model, e.g. 'Hello world'.")
    if not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 1:
        raise InputError(f"top_k={top_k!r} must be a whole number >= 1.")
    ids = to_tokens(model, text)  # (1, T); raises on text that tokenizes to nothing
    T = ids.shape[1]
    if T > MAX_REPORT_TOKENS:
        raise InputError(
            f"the text is {T} tokens long; the report embeds every attention map, so it takes at most "
            f"{MAX_REPORT_TOKENS} tokens. Pass a shorter text."
        )
    cfg = model.config
    names = (["blocks.0.hook_resid_pre"] + [f"blocks.{i}.hook_resid_post" for i in range(cfg.n_layers)]
             + [f"blocks.{i}.attn.hook_pattern" for i in range(cfg.n_layers)])
    logits, cache = run_with_cache(model, ids, names_filter=names)
    probs = torch.softmax(logits[0].float(), dim=-1)  # (T, V)
    top_probs, top_ids = probs.topk(min(top_k, probs.shape[-1]), dim=-1)
    token_text = model.tokenizer.id_to_token
    lens = logit_lens(model, ids, top_k=1, cache=cache)
    attention = torch.stack([token_columns(cache["pattern", i][0]) for i in range(cfg.n_layers)])  # (L, nh, T, T)
    return {
        "model": getattr(cfg, "name", "model"),
        "config": {"n_layers": cfg.n_layers, "n_heads": cfg.n_heads, "n_kv_heads": cfg.n_kv_heads,
                   "d_model": cfg.d_model, "vocab_size": cfg.vocab_size, "positions": cfg.positions},
        "text": text,
        "ids": ids[0].tolist(),
        "tokens": to_str_tokens(model, ids[0]),
        "topk": [[{"id": int(i), "token": token_text(int(i)), "prob": round(float(p), 5)}
                  for i, p in zip(row_ids, row_probs)]
                 for row_ids, row_probs in zip(top_ids.tolist(), top_probs.tolist())],
        # Row q of a causal pattern has q + 1 entries that can be non-zero: store only those.
        "attention": [[[row[: q + 1] for q, row in enumerate(head)] for head in layer]
                      for layer in attention.double().round(decimals=3).tolist()],
        "lens": {"labels": lens.layer_labels,
                 "tokens": [[pos[0] for pos in layer] for layer in lens.top_tokens],
                 "probs": lens.top_probs[:, :, 0].double().round(decimals=4).tolist()},
    }


class Report(str):
    """The report page: a ``str`` (write it, search it) that Jupyter also shows inline. The page
    addresses its parts by fixed ids, so inline it lives in its own iframe (``iframe_html``)."""

    def _repr_html_(self) -> str:
        return iframe_html(str(self), "report")


@keywords_checked(InputError)
def build_report(model: nn.Module, text: str, top_k: int = 5, title: Optional[str] = None) -> Report:
    """The report as one self-contained HTML string (pure ASCII: non-ASCII text is escaped);
    the last line of a notebook cell, it displays inline."""
    data = report_data(model, text, top_k)
    payload = script_json(data, separators=(",", ":"))
    title = title or f"lucidlm inspect: {data['model']}"
    title = html.escape(title).encode("ascii", "xmlcharrefreplace").decode()
    before, after = PAGE.split("__DATA__")  # split first: neither insert can be re-substituted
    return Report(before.replace("__TITLE__", title) + payload + after.replace("__TITLE__", title))


@keywords_checked(InputError)
def write_report(model: nn.Module, text: str, out: Union[str, Path], top_k: int = 5,
                 title: Optional[str] = None) -> Path:
    """Write the report to ``out`` (through a staging file: a failure leaves the old report
    whole and no half page). ``title``: the page's, e.g. "lucidlm inspect: smollm2-135m"."""
    out = check_output_file(out, "out")  # a directory or a path under a file: refused before any work
    atomic_write_text(out, build_report(model, text, top_k, title=title))
    return out
