"""The logit lens: what would the model predict if it stopped after block L?

Each layer's residual stream (the embeddings, then the output of every block) is passed
through the final norm and the unembedding, as if it were the last layer. Early layers
usually predict something close to the input token; the answer forms in the middle
layers and sharpens towards the end. The last row is exactly the model's own prediction.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn

from lucidlm.errors import InputError
from lucidlm.inspect.cache import ActivationCache, run_with_cache
from lucidlm.inspect.tokens import TextOrIds, check_cache_fits, one_sequence
from lucidlm.suggest import keywords_checked
from lucidlm.validation import check_int


@dataclass
class LogitLens:
    """What ``logit_lens`` returns: the top-k guesses of every layer at every position of one
    sequence. ``table()`` gives (token, probability) rows, ``format()`` a text table, and in a
    notebook it displays as an HTML grid (one row per layer, one column per position)."""

    layer_labels: list[str]  # "embed", "0", "1", ...: the row's residual stream is after that block
    input_tokens: list[str]  # the tokens at each position (columns)
    top_ids: torch.Tensor  # (n_layers + 1, T, k)
    top_probs: torch.Tensor  # (n_layers + 1, T, k)
    top_tokens: list[list[list[str]]]  # [layer][position][rank]

    def table(self, rank: int = 0) -> list[list[tuple[str, float]]]:
        """(layers x positions) of (token, probability) for the rank-th guess."""
        return [[(self.top_tokens[l][t][rank], float(self.top_probs[l, t, rank]))
                 for t in range(self.top_ids.shape[1])] for l in range(self.top_ids.shape[0])]

    def format(self, width: int = 10) -> str:
        """The table as text: one row per layer, one column per position."""
        def cell(text: str) -> str:
            text = text.replace("\n", "\\n")
            return (text[: width - 1] + "…" if len(text) > width else text).ljust(width)
        lines = [" " * 6 + "".join(cell(t) for t in self.input_tokens)]
        for label, row in zip(self.layer_labels, self.table()):
            lines.append(label.rjust(5) + " " + "".join(cell(f"{tok}") for tok, _ in row))
        return "\n".join(lines)


def lens_logits(model: nn.Module, cache: ActivationCache) -> torch.Tensor:
    """(n_layers + 1, T, V) logits read off every layer's residual stream (batch row 0)."""
    stack = cache.accumulated_resid(apply_ln=True)  # (L+1, B, T, d) or (L+1, T, d)
    if cache.has_batch_dim:
        stack = stack[:, 0]
    unembed = model.unembed
    with torch.no_grad():  # in the residual stream's dtype: a quantized unembedding has no float weight
        logits = unembed(stack.to(model.dtype))  # (L+1, T, V)
    cap = model.config.final_logit_softcap  # the model caps its own logits (Gemma 2): so must every row
    return logits if cap is None else torch.tanh(logits / cap) * cap


@keywords_checked(InputError)
def logit_lens(model: nn.Module, ids: TextOrIds, top_k: int = 1, cache: Optional[ActivationCache] = None) -> LogitLens:
    """Top ``top_k`` tokens of every layer at every position, for one sequence: ``ids`` is a
    text or ids (T,); of a (B, T) batch row 0 is read, of a list of texts the first (taken
    alone, unpadded). ``cache``: one ``run_with_cache`` made of that same sequence (row 0 of a
    batch cache); a cache of another length is refused, as its columns would sit under the
    wrong tokens."""
    check_int(top_k, "top_k", InputError, low=1, high=model.config.vocab_size)
    ids = one_sequence(ids)
    if cache is None:  # the run checks the ids (type, vocabulary, length) before they are labelled below
        names = ["blocks.0.hook_resid_pre"] + [f"blocks.{i}.hook_resid_post" for i in range(model.config.n_layers)]
        with torch.no_grad():
            _, cache = run_with_cache(model, ids, names_filter=names)
    logits = lens_logits(model, cache)  # (L+1, T, V)
    tokenizer = getattr(model, "tokenizer", None)
    if tokenizer is not None:
        from lucidlm.inspect.steps import to_str_tokens
        input_tokens = to_str_tokens(model, ids if isinstance(ids, str) else _first_row(ids))
    else:
        input_tokens = [str(i) for i in _first_row(ids)]
    check_cache_fits(logits.shape[1], len(input_tokens), "logit_lens")
    probs = torch.softmax(logits.float(), dim=-1)  # (L+1, T, V)
    top_probs, top_ids = probs.topk(top_k, dim=-1)
    name = tokenizer.id_to_token if tokenizer is not None else str
    top_tokens = [[[name(int(i)) for i in pos] for pos in layer] for layer in top_ids.tolist()]
    labels = ["embed"] + [str(i) for i in range(model.config.n_layers)]
    return LogitLens(labels, input_tokens, top_ids, top_probs, top_tokens)


def _first_row(ids: Any) -> list[int]:
    ids = torch.as_tensor(ids)
    return (ids[0] if ids.ndim == 2 else ids).tolist()


def _lens_html(lens: LogitLens) -> str:
    """A self-contained table: one row per layer, one column per position, shaded by probability."""
    import html

    from lucidlm.display import element_id
    view_id = element_id("lens")
    head = "".join(f"<th>{html.escape(t)}</th>" for t in lens.input_tokens)
    rows = []
    for label, row in zip(lens.layer_labels, lens.table()):
        cells = "".join(f'<td style="background: rgba(33,102,172,{p:.3f})" title="p={p:.3f}">{html.escape(tok)}</td>'
                        for tok, p in row)
        rows.append(f"<tr><th>{html.escape(label)}</th>{cells}</tr>")
    style = (f"<style>#{view_id} td, #{view_id} th {{font-family: monospace; white-space: pre; padding: 2px 4px;"
             f" border: 1px solid #eee}}</style>")
    return f'<div id="{view_id}">{style}<table><tr><th></th>{head}</tr>{"".join(rows)}</table></div>'


LogitLens._repr_html_ = _lens_html  # Jupyter displays a LogitLens as this table
