"""The log-probability of each token of a prompt given the tokens before it: what OpenAI's legacy
completions return for ``echo`` with ``logprobs`` (and vLLM's ``prompt_logprobs``), and what
evaluation harnesses score multiple-choice answers with (lm-evaluation-harness's
``local-completions`` sends ``echo: true, logprobs: 1, max_tokens: 0`` and sums the answer's part).

One forward pass over the prompt, no KV cache: the logits at position t-1 give token t's
log-prob, from the model's own distribution (``log_softmax(logits)`` in float32, as
``generate``'s greedy log-probs; no temperature or filter applies to text that was given, not
sampled). The first token has no context, so no log-prob (None, as OpenAI's null). The pass holds
T x vocabulary logits at once (SmolLM2, 2,000 tokens: 390 MB in float32); the log-softmax goes a
few positions at a time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Union

import torch

from lucidlm.errors import GenerationError
from lucidlm.generation.request import fit_to_context, prompt_ids
from lucidlm.model.transformer import Transformer


# Positions whose float32 log-softmax is taken at once: ~16 MB, not a second copy of the (T, V)
# logits (Gemma 3's 262,144 tokens: 1 GB per 1,000 prompt tokens).
CHUNK_ELEMENTS = 1 << 22


@dataclass(frozen=True)
class PromptLogprobs:
    """``token_ids`` the prompt as the model read it; ``logprobs[t]`` log p(token t | tokens < t)
    (None at t = 0); ``top_logprobs[t]`` the ``top`` likeliest tokens there as (id, log-prob),
    likeliest first (None at t = 0; an empty list per token when ``top`` is 0)."""

    token_ids: list[int]
    logprobs: list[Optional[float]]
    top_logprobs: list[Optional[list[tuple[int, float]]]]


def prompt_logprobs(model: Transformer, prompt: Union[str, Sequence[int], torch.Tensor], top: int = 0,
                    chat: bool = False) -> PromptLogprobs:
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
    chosen: list[float] = []
    tops: list[list[tuple[int, float]]] = []
    with torch.no_grad():
        logits = model(rows)[0, :-1]  # (T-1, V): position t-1 predicts token t
        targets = rows[0, 1:]
        step = max(1, CHUNK_ELEMENTS // logits.shape[-1])
        for start in range(0, len(targets), step):  # a float32 log-softmax of a few positions at a time
            log_probs = logits[start:start + step].float().log_softmax(dim=-1)  # (t, V)
            chosen += log_probs.gather(1, targets[start:start + step, None])[:, 0].tolist()
            if top:
                values, indices = log_probs.topk(min(top, log_probs.shape[-1]), dim=-1)  # (t, top)
                tops += [list(zip(i, v)) for i, v in zip(indices.tolist(), values.tolist())]
            else:
                tops += [[] for _ in range(len(log_probs))]
    return PromptLogprobs(list(ids), [None, *chosen], [None, *tops])
