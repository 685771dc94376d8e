"""Perplexity of a text under a model, by Hugging Face's sliding-window recipe ("Perplexity of
fixed-length models"): windows of ``max_length`` tokens starting every ``stride`` tokens, each
scoring only the tokens no earlier window scored. With ``stride < max_length`` every token after
the first is scored exactly once, with at least ``max_length - stride`` tokens of context (but
the first window's).

BOS: the text is tokenized once, as a whole, by the model's tokenizer, as the recipe does; so
it starts with BOS exactly when that tokenizer's ``encode`` puts one first (``add_bos``: Gemma,
Llama 3; not SmolLM2 or GPT-2), and no window after the first gets one. The first token, having
no context, is never scored; with ``stride == max_length`` (no overlap) neither is the first
token of each window. Pass ids to choose the tokens yourself (a BOS of your own, say).

``lucidlm perplexity`` (commands/perplexity.py) and ``LanguageModel.perplexity`` are doors into
``perplexity`` here; tests/quantization/ holds quantized models to float32 with ``nll_sums``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any, Optional, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from lucidlm.errors import InputError
from lucidlm.inspect.tokens import _id_rows
from lucidlm.suggest import keywords_checked
from lucidlm.validation import check_int

# Default window when the model's context is longer: a window's logits are max_length x vocab
# floats (SmolLM2's 8192 x 49152 would be 1.6 GB), and HF's recipe runs GPT-2's 1024.
DEFAULT_MAX_LENGTH = 1024


@dataclass(frozen=True)
class WindowScore:
    """One window: tokens ``begin:end`` of the text ran through the model; ``tokens`` of them
    (the last ones) were scored, with ``nll`` the sum of their -log p (nats)."""

    begin: int
    end: int
    tokens: int
    nll: float

    @property
    def ppl(self) -> float:
        return exp_nll(self.nll / self.tokens)


@dataclass(frozen=True)
class PerplexityResult:
    """``ppl`` = exp(``nll``), ``nll`` the mean -log p (nats) of the ``tokens`` scored tokens of a
    text of ``text_tokens`` tokens, read in ``windows`` of ``max_length`` every ``stride``."""

    ppl: float
    nll: float
    tokens: int
    text_tokens: int
    max_length: int
    stride: int
    windows: list[WindowScore] = field(repr=False)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready values (``lucidlm perplexity --json``)."""
        return asdict(self)


def exp_nll(nll: float) -> float:
    """exp(nll), inf past float64's range as torch.exp (the recipe's) gives it: a diverged model
    averaging over ~709 nats a token is a score to report, not an OverflowError."""
    try:
        return math.exp(nll)
    except OverflowError:
        return math.inf


def window_settings(context: int, max_length: Optional[int], stride: Optional[int],
                    names: tuple[str, str] = ("max_length", "stride")) -> tuple[int, int]:
    """(max_length, stride) checked against a model ``context`` tokens long, defaults filled in
    (``perplexity``'s docstring); errors name them as ``names`` (the CLI's flags, say)."""
    length_name, stride_name = names
    max_length = min(context, DEFAULT_MAX_LENGTH) if max_length is None else \
        check_int(max_length, length_name, InputError, low=2, high=context,
                  fix=f"a window must fit the model's context of {context} tokens")
    stride = max(1, max_length // 2) if stride is None else \
        check_int(stride, stride_name, InputError, low=1, high=max_length,
                  fix=f"a stride longer than the window ({length_name} {max_length}) would leave tokens unread; "
                      f"lower it")
    return max_length, stride


def window_spans(n_tokens: int, max_length: int, stride: int) -> list[tuple[int, int, int]]:
    """(begin, end, first scored position) of each window over ``n_tokens`` tokens, as HF's
    recipe loops: a window starts every ``stride`` tokens and scores the positions past the
    previous window's end (never its own first token, which has no context); it stops at the
    window that reaches the end. A window that would score nothing (a text one token past a
    multiple of the stride, with no overlap) is left out: the recipe's loss there is 0/0."""
    spans, previous_end = [], 0
    for begin in range(0, n_tokens, stride):
        end = min(begin + max_length, n_tokens)
        first = max(previous_end, begin + 1)
        if first < end:
            spans.append((begin, end, first))
        previous_end = end
        if end == n_tokens:
            break
    return spans


def nll_sums(model: torch.nn.Module, rows: torch.Tensor, first: int | Sequence[int] = 1) -> list[float]:
    """Sum of -log p(token | the tokens before it in its row) over positions ``first:`` of each
    row of ``rows`` (B, T), one forward pass; ``first`` one position for all rows or one per row.
    Computed in float32 (a bf16 log-softmax over a large vocabulary loses digits), summed in float64."""
    firsts = [first] * rows.shape[0] if isinstance(first, int) else list(first)
    with torch.no_grad():
        logits = model(rows.to(model.device))  # (B, T, V)
    targets = rows.to(logits.device)
    return [F.cross_entropy(logits[r, start - 1:-1].float(), targets[r, start:], reduction="sum").double().item()
            for r, start in enumerate(firsts)]


@keywords_checked(InputError)
def perplexity(model: torch.nn.Module, text_or_ids: str | Sequence[int] | torch.Tensor, *,
               max_length: Optional[int] = None, stride: Optional[int] = None, batch_size: int = 1,
               progress: bool = False) -> PerplexityResult:
    """Perplexity of ``text_or_ids`` under ``model`` (a ``Transformer``; text needs its tokenizer).

    max_length: tokens per window (default: the model's context, at most ``DEFAULT_MAX_LENGTH``).
    stride: tokens between window starts, 1..max_length (default: ``max_length // 2``, so every
        token but the first window's has at least half a window of context; ``max_length``: no
        overlap, fastest).
    batch_size: windows per forward pass (the same figure for any value; more is faster and
        holds batch_size x max_length x vocab float logits at once).
    progress: a tqdm bar over the windows on stderr.

    Text is tokenized once as a whole (module docstring: BOS); ids (a list, or a (T,) or (1, T)
    tensor or numpy array) are scored as given. A diverged model's perplexity past float64 is inf.
    """
    max_length, stride = window_settings(model.config.max_seq_len, max_length, stride)
    batch_size = check_int(batch_size, "batch_size", InputError, low=1)
    ids = _token_ids(model, text_or_ids)
    spans = window_spans(len(ids), max_length, stride)
    windows: list[WindowScore] = []
    from tqdm.auto import tqdm  # local: only evaluation draws a bar

    modes = [(module, module.training) for module in model.modules()]
    model.eval()  # dropout off: a score, not a training step
    try:
        with tqdm(total=len(spans), desc="perplexity", unit="window", disable=not progress, leave=False) as bar:
            for group in _batches(spans, batch_size):
                rows = torch.tensor([ids[begin:end] for begin, end, _ in group])  # (b, T): one length per batch
                sums = nll_sums(model, rows, [first - begin for begin, _, first in group])
                windows += [WindowScore(begin, end, end - first, nll) for (begin, end, first), nll in zip(group, sums)]
                bar.update(len(group))
    finally:  # each module back in its own mode (not model.train(), which a quantized layer refuses)
        for module, was in modes:
            module.training = was
    tokens = sum(w.tokens for w in windows)
    nll = sum(w.nll for w in windows) / tokens
    return PerplexityResult(ppl=exp_nll(nll), nll=nll, tokens=tokens, text_tokens=len(ids), max_length=max_length,
                            stride=stride, windows=windows)


def _token_ids(model: torch.nn.Module, text_or_ids: str | Sequence[int] | torch.Tensor) -> list[int]:
    """The ids to score: text through the model's tokenizer (special-token text such as
    ``<|endoftext|>`` read as plain text, as a training corpus is), or ids as given."""
    if isinstance(text_or_ids, str):
        tokenizer = getattr(model, "tokenizer", None)
        if tokenizer is None:
            raise InputError("this model has no tokenizer, so it cannot read text; pass token ids instead.")
        if not text_or_ids:
            raise InputError("the text is empty; give the text to score.")
        ids = tokenizer.encode(text_or_ids, allowed_special=False)
    else:  # a tensor, numpy array or list, (T,) or (1, T): a (1, T) read as a list is one row, not one token
        if isinstance(text_or_ids, Iterable) and not isinstance(text_or_ids, (torch.Tensor, np.ndarray, list, tuple)):
            text_or_ids = list(text_or_ids)  # a range, an array.array, a generator of ids
        ids = _id_rows(text_or_ids, "perplexity")
        if ids and isinstance(ids[0], list):
            if len(ids) != 1:
                raise InputError(f"{len(ids)} rows of ids: give one sequence, (T,) or (1, T).")
            ids = ids[0]
    if len(ids) < 2:
        raise InputError(f"the text is {len(ids)} token{'' if len(ids) == 1 else 's'} long; perplexity scores "
                         f"each token after the first, so it needs at least 2.")
    return ids


def _batches(spans: list[tuple[int, int, int]], size: int) -> list[list[tuple[int, int, int]]]:
    """``spans`` in order, at most ``size`` to a batch and one window length per batch (only
    the last window is shorter than the rest)."""
    batches: list[list[tuple[int, int, int]]] = []
    for span in spans:
        last = batches[-1] if batches else None
        if last and len(last) < size and last[0][1] - last[0][0] == span[1] - span[0]:
            last.append(span)
        else:
            batches.append([span])
    return batches


__all__ = ["DEFAULT_MAX_LENGTH", "PerplexityResult", "WindowScore", "nll_sums", "perplexity", "window_settings",
           "window_spans"]
