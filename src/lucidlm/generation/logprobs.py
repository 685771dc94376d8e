"""Per-token log-probabilities of generated tokens (``generate(..., logprobs=...)``).

What they are taken from: the distribution the token was drawn from, the logits after every
processor the request asked for (repetition penalty, ``min_new_tokens``' EOS ban, temperature,
top-k, top-p, min-p, typical-p, the cutoffs), renormalised with a log-softmax. That is
transformers' ``compute_transition_scores(sequences, scores, normalize_logits=True)`` with
``output_scores=True``. A token a filter removed has log-prob -inf. With greedy decoding (and no
repetition penalty) no processor runs, so they are the model's own log-probs,
``log_softmax(logits)`` (transformers' ``output_logits``). For the model's raw distribution
while sampling, run the model on the ids (``log_softmax(model(ids))``).

The values stay on the device while tokens are generated (a gather and a top-k per step, queued
behind the sample; nothing is read back) and come to the host once, at the end.
"""

from __future__ import annotations

import numbers
from typing import Any, Optional

import torch

from lucidlm.errors import GenerationError


def logprobs_count(value: Any) -> Optional[int]:
    """``generate``'s ``logprobs`` option as the number of alternatives to keep per token: None
    (off) for None or False, 0 for True (the chosen token's log-prob only), N for a whole number
    N >= 0 (the chosen token's and the N most likely tokens')."""
    if value is None or value is False:
        return None
    if value is True:
        return 0
    if isinstance(value, numbers.Integral) and value >= 0:
        return int(value)
    raise GenerationError(f"logprobs={value!r} is invalid: use True (each generated token's log-prob), a whole "
                          f"number N >= 0 (also the N most likely tokens at each step, as OpenAI's and "
                          f"llama.cpp's logprobs), or False / None (off).")


class LogprobRecorder:
    """Collects, step by step, each row's log-prob of its sampled token and its top ``top_n``
    alternatives, as device tensors; ``rows`` reads them back once."""

    def __init__(self, top_n: int) -> None:
        self.top_n = top_n
        self.chosen: list[torch.Tensor] = []  # per step (B,)
        self.top_values: list[torch.Tensor] = []  # per step (B, N)
        self.top_ids: list[torch.Tensor] = []  # per step (B, N)

    def record(self, processed_logits: torch.Tensor, ids: torch.Tensor) -> None:
        """processed_logits (B, V): what ``ids`` (B,) were sampled from (or the argmax of)."""
        log_probs = processed_logits.float().log_softmax(dim=-1)  # (B, V)
        self.record_log_probs(log_probs, ids)

    def record_log_probs(self, log_probs: torch.Tensor, ids: torch.Tensor) -> None:
        """Like ``record``, for scores that are already the log-probs to report (B, V)."""
        self.chosen.append(log_probs.gather(1, ids.view(-1, 1))[:, 0])
        if self.top_n:
            values, indices = log_probs.topk(min(self.top_n, log_probs.shape[-1]), dim=-1)  # (B, N)
            self.top_values.append(values)
            self.top_ids.append(indices)

    def record_path(self, chosen: torch.Tensor, top_values: torch.Tensor, top_ids: torch.Tensor) -> None:
        """One row's whole path at once (beam search's best hypothesis): chosen (t,), top (t, N)."""
        self.chosen = list(chosen.view(-1, 1).unbind(0))  # per step (1,)
        if self.top_n:
            self.top_values = list(top_values.unsqueeze(1).unbind(0))  # per step (1, N)
            self.top_ids = list(top_ids.unsqueeze(1).unbind(0))

    def rows(self, lengths: list[int]) -> list[tuple[list[float], Optional[list[list[tuple[int, float]]]]]]:
        """Per row, its first ``lengths[i]`` steps: (log-probs, top alternatives or None)."""
        if not self.chosen:
            return [([], [] if self.top_n else None) for _ in lengths]
        chosen = torch.stack(self.chosen, dim=1).tolist()  # (B, steps)
        tops = None
        if self.top_n:
            values = torch.stack(self.top_values, dim=1).tolist()  # (B, steps, N)
            ids = torch.stack(self.top_ids, dim=1).tolist()
            tops = [[list(zip(step_ids, step_values)) for step_ids, step_values in zip(row_ids, row_values)]
                    for row_ids, row_values in zip(ids, values)]
        return [(chosen[i][:n], tops[i][:n] if tops is not None else None) for i, n in enumerate(lengths)]
