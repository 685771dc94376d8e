"""What a generation gives back: ``GenerationResult`` (the ids, the text, why it ended, the
timings and log-probs), shared by ``generate``, ``stream``, ``generate_batch`` and the batch
runner (``batch_run.py``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from lucidlm.generation.speculative import SpeculationStats


@dataclass
class GenerationResult:
    """What one generation produced, and how long it took.

    Fields:

    - ``token_ids``: the generated ids only (not the prompt's). With ``finish_reason="eos"``
      the EOS id is the last of them.
    - ``text``: their text, what the output adds to the prompt: no EOS, and cut just before a
      stop string (see ``api.py``'s module docstring).
    - ``prompt_ids``: the prompt's ids as the model saw them (after the chat template and a
      BOS token, if any).
    - ``finish_reason``: why it ended: ``"eos"`` (the model chose an EOS token), ``"stop"``
      (a stop string appeared in the text) or ``"length"`` (``max_new_tokens`` reached, or the
      context window full).
    - ``prompt_seconds``: seconds from the start of generation to the first new token (the
      prompt's forward pass plus the first sample: llama.cpp's "prompt eval" plus one token).
      ``None`` when no token was generated, for beam search (its first token is known only at
      the end) and for a result built by hand.
    - ``cached_tokens``: how many of the prompt's first tokens were not run again, their keys
      and values taken from the last generation's cache (``reuse_cache=True``); 0 otherwise.
    - ``seconds``: seconds for the whole generation, prompt pass included (tokenizing the
      prompt and loading the model are not). For ``stream``, the time the caller spends between
      pieces is left out. In a batch (``generate_batch``) each row's time runs to the step that
      finished that row, with the rows sharing every forward pass. ``None`` for a result built
      by hand.
    - ``logprobs``: with ``generate(..., logprobs=True or N)``, one float per id of
      ``token_ids``: its log-probability under the distribution it was sampled from (the logits
      after temperature, top-k, top-p and the other processors, log-softmaxed: transformers'
      ``compute_transition_scores(..., normalize_logits=True)``; with greedy decoding the model's
      own ``log_softmax(logits)``; beam search: the scores its beams summed, transformers'
      transition scores; see ``generation/logprobs.py``). ``None`` when not asked for.
    - ``speculation``: with ``generate(..., draft=...)``, how the drafts did (rounds, drafted,
      accepted, ``acceptance_rate``, ``accepted_per_round``; ``speculative.py``). ``None`` otherwise.
    - ``top_logprobs``: with ``logprobs=N`` (N >= 1), per generated token the N most likely
      tokens of that same distribution, most likely first, as ``(token_id, logprob)`` pairs (a
      token a filter removed has -inf). ``None`` otherwise.

    Rates (properties): ``tokens_per_second`` is new tokens / ``seconds``, the whole
    generation's rate, prompt pass included (the number ``lucidlm generate --json`` reports);
    ``decode_tokens_per_second`` is the rate after the first token, (new tokens - 1) /
    (``seconds`` - ``prompt_seconds``), the "eval rate" ollama and llama.cpp report apart from
    the prompt's.

    In Jupyter a result displays as the prompt (muted), the generated text (highlighted), the
    finish reason and the numbers.
    """

    token_ids: list[int]
    text: str
    prompt_ids: list[int] = field(default_factory=list)
    finish_reason: str = "length"  # "eos" | "stop" | "length"
    prompt_seconds: Optional[float] = None
    seconds: Optional[float] = None
    logprobs: Optional[list[float]] = None
    top_logprobs: Optional[list[list[tuple[int, float]]]] = None
    cached_tokens: int = 0
    speculation: Optional[SpeculationStats] = None

    @property
    def tokens_per_second(self) -> Optional[float]:
        """New tokens / ``seconds`` (prompt pass included); ``None`` when ``seconds`` is unknown or 0."""
        if not self.seconds:
            return None
        return len(self.token_ids) / self.seconds

    @property
    def decode_tokens_per_second(self) -> Optional[float]:
        """Tokens after the first / the time after the first: (n - 1) / (``seconds`` -
        ``prompt_seconds``); ``None`` when either time is unknown or fewer than 2 tokens came."""
        if self.prompt_seconds is None or self.seconds is None or len(self.token_ids) < 2:
            return None
        decode = self.seconds - self.prompt_seconds
        return (len(self.token_ids) - 1) / decode if decode > 0 else None

    def _repr_html_(self) -> str:
        import html

        from lucidlm.display import element_id, scoped_style
        view_id = element_id("result")
        prompt = ""
        if self.prompt_ids:
            prompt_text = self._prompt_text()
            prompt = f'<span class="prompt">{html.escape(prompt_text)}</span>'
        numbers = [f"finish reason: <b>{html.escape(str(self.finish_reason))}</b>",
                   f"{len(self.token_ids)} new tokens", f"{len(self.prompt_ids)} prompt tokens"]
        if self.prompt_seconds is not None:
            numbers.append(f"first token {self.prompt_seconds:.3f} s")
        if self.seconds is not None:
            numbers.append(f"{self.seconds:.3f} s")
        if self.tokens_per_second is not None:
            numbers.append(f"{self.tokens_per_second:.1f} tok/s")
        if self.decode_tokens_per_second is not None:
            numbers.append(f"decode {self.decode_tokens_per_second:.1f} tok/s")
        style = scoped_style(view_id, {
            "": "font-family: sans-serif; font-size: 13px; border: 1px solid #d0d7de; padding: 6px; "
                "border-radius: 4px",
            ".text": "font-family: monospace; white-space: pre-wrap; margin: 0 0 4px 0",
            ".prompt": "color: #6e7781",
            ".output": "background: #fff3bf; color: #1f2328",
            ".meta": "color: #57606a; font-size: 12px",
        })
        return (f'<div id="{view_id}" class="lucidlm-result">{style}'
                f'<div class="text">{prompt}<span class="output">{html.escape(self.text)}</span></div>'
                f'<div class="meta">{" &middot; ".join(numbers)}</div></div>')

    def _prompt_text(self) -> str:
        """The prompt's ids as text, for display only; the ids themselves without a tokenizer."""
        return " ".join(str(i) for i in self.prompt_ids) if self._tokenizer is None else \
            self._tokenizer.decode(list(self.prompt_ids))

    # set where results are built, for display only: not a field (asdict, ==, repr leave it out)
    _tokenizer = None


def attach_tokenizer(result: GenerationResult, tokenizer: Any) -> GenerationResult:
    """``result`` with the tokenizer its display decodes the prompt with."""
    result._tokenizer = tokenizer
    return result
