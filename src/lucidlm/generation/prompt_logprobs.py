"""The log-probability of each token of a prompt given the tokens before it: what OpenAI's legacy
completions return for ``echo`` with ``logprobs`` (and vLLM's ``prompt_logprobs``), and what
evaluation harnesses score multiple-choice answers with (lm-evaluation-harness's
``local-completions`` sends ``echo: true, logprobs: 1, max_tokens: 0`` and sums the answer's part).

One forward pass over the prompt, no KV cache: the logits at position t-1 give token t's
log-prob, from the model's own distribution (``log_softmax(logits)`` in float32, as
``generate``'s greedy log-probs; no temperature or filter applies to text that was given, not
sampled). The first token has no context, so no log-prob (None, as OpenAI's null). The pass holds
T x vocabulary float logits at once (SmolLM2, 2,000 tokens: 390 MB).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from lucidlm.errors import GenerationError
from lucidlm.generation.request import fit_to_context, prompt_ids


@dataclass(frozen=True)
class PromptLogprobs:
    """``token_ids`` the prompt as the model read it; ``logprobs[t]`` log p(token t | tokens < t)
    (None at t = 0); ``top_logprobs[t]`` the ``top`` likeliest tokens there as (id, log-prob),
    likeliest first (None at t = 0; an empty list per token when ``top`` is 0)."""

    token_ids: list[int]
    logprobs: list[Optional[float]]
    top_logprobs: list[Optional[list[tuple[int, float]]]]


def prompt_logprobs(model: Any, prompt: Any, top: int = 0, chat: bool = False) -> PromptLogprobs:
    """Each prompt token's log-prob under ``model`` (module docstring). ``prompt``: a text (read by
    the model's tokenizer, BOS included where it adds one, as ``generate`` reads it) or token ids;
    ``chat``: the text as one user message in the model's chat template. ``top``: how many of the
    likeliest tokens to list at each position (0: none)."""
    if not isinstance(top, int) or isinstance(top, bool) or top < 0:
        raise GenerationError(f"top={top!r} is invalid: use a whole number >= 0 (the likeliest tokens listed per "
                              f"position; 0 lists none).")
    ids = prompt_ids(model, prompt, chat)  # checked against the vocabulary
    fit_to_context(model, [ids], 0)  # ... and the context, with generate's words
    rows = torch.tensor([ids], device=model.device)  # (1, T)
    with torch.no_grad():
        log_probs = model(rows)[0, :-1].float().log_softmax(dim=-1)  # (T-1, V): position t-1 predicts token t
        chosen = log_probs.gather(1, rows[0, 1:, None])[:, 0].tolist()  # (T-1,)
        if top:
            values, indices = log_probs.topk(min(top, log_probs.shape[-1]), dim=-1)  # (T-1, top)
            tops = [list(zip(i, v)) for i, v in zip(indices.tolist(), values.tolist())]
        else:
            tops = [[] for _ in chosen]
    return PromptLogprobs(list(ids), [None, *chosen], [None, *tops])
