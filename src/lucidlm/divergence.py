"""How far a model's next-token distributions lie from a base model's on a text: the figures
llama.cpp's ``llama-perplexity --kl-divergence`` reports, for choosing a quantization (or
checking a fine-tune, a pruned model, a new kernel) by more than its perplexity.

>>> kl_divergence(lucidlm.load(), lucidlm.load(dtype="float32"), text)   # the 4-bit default vs float32

Both models read the same token windows as ``evaluation.perplexity`` (Hugging Face's sliding
windows), and at every scored token:

- KL(P_base || P_model) = sum over the vocabulary of p_base (log p_base - log p_model), in
  nats: what the model loses, on average, of the base model's distribution. 0 for the same
  distributions. Perplexity can hide it: errors that make some tokens likelier and others
  less so cancel in the mean log-probability, not in the KL divergence;
- whether the two models' most likely tokens are the same (llama.cpp's "same top p"): what
  greedy decoding feels;
- dp = p_model(t) - p_base(t), the change in the probability of the text's actual token t.

Why a base model rather than a file of its logits (llama.cpp's ``--kl-divergence-base``
writes one): a text of 100k tokens times a 49k vocabulary is ~20 GB of floats, while the base
model is a few hundred MB and recomputes them window by window.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Optional, Sequence

import numpy as np
import torch

from lucidlm.errors import InputError
from lucidlm.evaluation import _batches, _token_ids, exp_nll, window_settings, window_spans
from lucidlm.suggest import keywords_checked
from lucidlm.validation import check_int

QUANTILES = (("max", 1.0), ("99.9%", 0.999), ("99%", 0.99), ("90%", 0.9), ("median", 0.5), ("10%", 0.1),
             ("min", 0.0))  # llama.cpp's list, less its 95 % and 1 %


@dataclass(frozen=True)
class DivergenceResult:
    """Over ``tokens`` scored tokens (``evaluation.PerplexityResult``'s windows): each model's
    perplexity, ``ln_ppl_ratio`` = ln(ppl / base_ppl) (the mean log-probability lost); the KL
    divergence from the base, its mean (nats) with the mean's standard error and its
    ``kld_quantiles`` over tokens; ``same_top`` the fraction of tokens where both models' most
    likely next token agree (with its standard error); ``delta_p_mean`` / ``delta_p_rms`` the
    mean and root mean square of p_model - p_base of the text's tokens."""

    tokens: int
    ppl: float
    base_ppl: float
    ln_ppl_ratio: float
    kld_mean: float
    kld_stderr: float
    kld_quantiles: dict[str, float]
    same_top: float
    same_top_stderr: float
    delta_p_mean: float
    delta_p_rms: float
    text_tokens: int
    max_length: int
    stride: int

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready values (``lucidlm perplexity --kl-base ... --json``)."""
        return asdict(self)


# Positions token_divergences takes at once: a few (chunk, V) float64 temporaries at a time, not
# (T, V) ones. Gemma 3 (262,144 tokens), one window of 1024: the float32 pass over the whole
# window at once peaked at 9.5 GB (the two models' logits 2 GB of it), and took 51 s on 2 cores.
CHUNK_ELEMENTS = 1 << 22


def token_divergences(logits: torch.Tensor, base_logits: torch.Tensor, targets: torch.Tensor,
                      ) -> tuple[torch.Tensor, ...]:
    """For T positions: logits, base_logits (T, V) and the text's next tokens targets (T,) ->
    (KL(base || model), the two argmaxes agree, p_model(target), p_base(target), -log p_model(target),
    -log p_base(target)), each (T,). In float64, a few positions at a time: a float32 log-softmax
    is off by ~1e-6 nats (a rounding of log-sum-exp, ~20 nats), as large as the KL divergence of
    a good quantization at its tenth percentile (~1.5e-5: 4 % off, the 4-bit default against
    float32)."""
    step = max(1, CHUNK_ELEMENTS // max(1, logits.shape[-1]))
    parts = [_divergences(logits[i:i + step], base_logits[i:i + step], targets[i:i + step])
             for i in range(0, len(targets), step)]
    return tuple(torch.cat(values) for values in zip(*parts)) if parts else \
        _divergences(logits, base_logits, targets)


def _divergences(logits: torch.Tensor, base_logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, ...]:
    log_p = torch.log_softmax(logits.double(), dim=-1)  # (t, V)
    log_q = torch.log_softmax(base_logits.double(), dim=-1)
    # p_base (log p_base - log p_model): a token the base gives probability 0 adds 0, not NaN
    kld = torch.where(log_q > -math.inf, log_q.exp() * (log_q - log_p), 0.0).sum(-1)  # (t,)
    same = logits.argmax(-1) == base_logits.argmax(-1)
    chosen, base_chosen = log_p.gather(1, targets[:, None])[:, 0], log_q.gather(1, targets[:, None])[:, 0]
    return kld, same, chosen.exp(), base_chosen.exp(), -chosen, -base_chosen


@keywords_checked(InputError)
def kl_divergence(model: torch.nn.Module, base: torch.nn.Module, text_or_ids: str | Sequence[int] | torch.Tensor,
                  *, max_length: Optional[int] = None, stride: Optional[int] = None, batch_size: int = 1,
                  progress: bool = False) -> DivergenceResult:
    """``model``'s distance from ``base`` on ``text_or_ids`` (module docstring). The windows,
    ``max_length``, ``stride``, ``batch_size`` and ``progress`` are ``evaluation.perplexity``'s,
    the window bounded by both models' contexts. Text is read by ``model``'s tokenizer; the two
    models must share a vocabulary (and where both have a tokenizer, read the text alike)."""
    vocab, base_vocab = model.config.vocab_size, base.config.vocab_size
    if vocab != base_vocab:
        raise InputError(f"the base model's vocabulary has {base_vocab} tokens and the model's {vocab}: the KL "
                         f"divergence compares distributions over one vocabulary; give a base of the same tokenizer.")
    max_length, stride = window_settings(min(model.config.max_seq_len, base.config.max_seq_len), max_length, stride)
    batch_size = check_int(batch_size, "batch_size", InputError, low=1)
    ids = _token_ids(model, text_or_ids)
    base_tokenizer = getattr(base, "tokenizer", None)
    if isinstance(text_or_ids, str) and base_tokenizer is not None and \
            base_tokenizer.encode(text_or_ids, allowed_special=False) != ids:
        raise InputError("the base model's tokenizer reads the text into other tokens than the model's: the two "
                         "would score different texts; give a base of the same tokenizer (or pass token ids).")
    spans = window_spans(len(ids), max_length, stride)
    parts: list[list[np.ndarray]] = [[] for _ in range(6)]  # token_divergences' six, window by window
    from tqdm.auto import tqdm  # local: only evaluation draws a bar

    modes = [(module, module.training) for net in (model, base) for module in net.modules()]
    model.eval(), base.eval()  # dropout off: a score, not a training step
    try:
        with torch.no_grad(), tqdm(total=len(spans), desc="KL divergence", unit="window", disable=not progress,
                                   leave=False) as bar:
            for group in _batches(spans, batch_size):
                rows = torch.tensor([ids[begin:end] for begin, end, _ in group])  # (b, T): one length per batch
                logits, base_logits = model(rows.to(model.device)), base(rows.to(base.device))  # (b, T, V) each
                for r, (begin, end, first) in enumerate(group):
                    scored = slice(first - begin - 1, end - begin - 1)  # the positions that predict tokens first..end-1
                    targets = rows[r, first - begin:].to(logits.device)
                    values = token_divergences(logits[r, scored], base_logits[r, scored].to(logits.device), targets)
                    for part, value in zip(parts, values):
                        part.append(value.cpu().double().numpy())
                bar.update(len(group))
    finally:  # each module back in its own mode (not model.train(), which a quantized layer refuses)
        for module, was in modes:
            module.training = was
    kld, same, p, base_p, nll, base_nll = (np.concatenate(part) for part in parts)
    n = len(kld)
    mean_nll, base_mean_nll = float(nll.mean()), float(base_nll.mean())
    same_top = float(same.mean())
    delta_p = p - base_p
    return DivergenceResult(
        tokens=n, ppl=exp_nll(mean_nll), base_ppl=exp_nll(base_mean_nll), ln_ppl_ratio=mean_nll - base_mean_nll,
        kld_mean=float(kld.mean()), kld_stderr=float(kld.std(ddof=1) / math.sqrt(n)) if n > 1 else math.nan,
        kld_quantiles={name: float(np.quantile(kld, q)) for name, q in QUANTILES},
        same_top=same_top, same_top_stderr=math.sqrt(same_top * (1 - same_top) / n),
        delta_p_mean=float(delta_p.mean()), delta_p_rms=float(np.sqrt((delta_p ** 2).mean())),
        text_tokens=len(ids), max_length=max_length, stride=stride)
