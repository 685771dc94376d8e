"""Beam search with Hugging Face's semantics (``generate(num_beams=n, do_sample=False)``).

Keep the n best partial sequences ("beams") by total log-probability. Each step every
beam proposes every token; the best 2n candidates (n beams x vocab) are ranked:

- a candidate that ends (EOS, a stop string, or the length limit) becomes a finished hypothesis with
  score = sum of log-probs / (generated length) ** length_penalty, if it ranks in the
  top n; the best n finished hypotheses are kept;
- the best n candidates that did not end become the next beams. 2n candidates guarantee
  n of them are still running even if n ended.

A stop string ends a candidate as EOS does (HF's ``stop_strings`` are stopping criteria of
the beam loop too), so the hypotheses that stop compete on score with the others; cutting
the winner at its first stop string afterwards would pick a different one. As in greedy
decoding, only the output's text is searched, not the prompt's.

Stopping (``early_stopping``, HF's default False): stop once no running beam can beat the
worst kept hypothesis (estimated at the current length); True stops as soon as n
hypotheses are finished; "never" keeps going while any improvement is possible.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

from lucidlm.errors import GenerationError
from lucidlm.generation.decode import DecodeSession
from lucidlm.generation.logprobs import LogprobRecorder
from lucidlm.generation.request import fit_to_context
from lucidlm.generation.sampling import SamplingSettings, apply_processors
from lucidlm.generation.streaming import TextAssembler
from lucidlm.model.transformer import Transformer
from lucidlm.suggest import keywords_checked

NEG_INF = -1.0e9  # HF's "impossible" score; a finite value keeps the arithmetic NaN-free


@keywords_checked(GenerationError)
@torch.inference_mode()
def beam_search(model: Transformer, prompt_ids: Sequence[int], *, num_beams: int, max_new_tokens: int,
                eos_ids: Sequence[int] = (), length_penalty: float = 1.0,
                early_stopping: bool | str = False, repetition_penalty: Optional[float] = None,
                stop: Sequence[str] = (), min_new_tokens: int = 0,
                recorder: Optional[LogprobRecorder] = None,
                settings: Optional[SamplingSettings] = None) -> tuple[list[int], float]:
    """The best hypothesis' generated ids (EOS included if it ended with one, and the token
    completing a stop string if it ended with one) and its score. ``stop`` needs
    ``model.tokenizer``, to decode the beams' text. ``min_new_tokens``: no beam may end with EOS
    before that many new tokens (a stop string still ends one, as in transformers).
    ``recorder`` (a ``LogprobRecorder``) is given the best hypothesis' per-token scores: the
    processed log-probs the beam scores sum, transformers' ``compute_transition_scores(sequences,
    scores, beam_indices)``, and the top alternatives of the same rows. ``settings``: the
    processors of these sampling settings that come before temperature (``apply_processors``:
    repetition penalty, no-repeat n-grams, ...) apply to the beams' log-probs, as transformers
    applies its processors there; given, it replaces ``repetition_penalty``."""
    # As generate(): prompt + output fit the context (the prompt alone must).
    if stop and getattr(model, "tokenizer", None) is None:
        raise GenerationError("stop strings need a tokenizer to decode the beams' text, but model.tokenizer is None.")
    max_new_tokens = fit_to_context(model, [prompt_ids], max_new_tokens)
    if max_new_tokens <= 0:
        return [], 0.0
    n, L = num_beams, len(prompt_ids)
    if settings is None:
        settings = SamplingSettings(temperature=0.0, repetition_penalty=repetition_penalty)
    device = model.device
    eos = torch.tensor(list(eos_ids), dtype=torch.long, device=device)
    keep = max(2, 1 + len(eos_ids)) * n  # candidates ranked per step

    running = torch.tensor([list(prompt_ids)] * n, dtype=torch.long, device=device)  # (n, L + t)
    # Only beam 0 is live at first: n identical beams would propose the same tokens n times.
    running_scores = torch.full((n,), NEG_INF, device=device)
    running_scores[0] = 0.0
    finished: list[tuple[float, list[int], Any]] = []  # (score, generated ids, path), best first, at most n
    # Each running beam's text so far, when stop strings can end it (EOS adds no text).
    texts = [TextAssembler(model.tokenizer, stop, eos_ids, prompt_ids)] * n if stop else None
    improvement_possible = True

    # steady: no caller code runs between the steps (the reorder only copies cache rows in place),
    # so the decode step may keep the operands it looks up (Transformer.steady_decode)
    with DecodeSession(model, [list(prompt_ids)] * n, capacity=L + max_new_tokens, steady=True,
                       same_rows=True) as session:  # the prompt runs once, for every beam
        logits = session.prefill()  # (n, V)
        # Per running beam, the log-probs of its tokens (n, t) and with them the top alternatives
        # (n, t, N) of each step's row, for ``recorder``; on the device, reordered with the beams.
        # N is at most the vocabulary (logprobs=N larger asks for every token, as sampling gives).
        top_n = min(recorder.top_n, logits.shape[-1]) if recorder is not None else 0
        paths = (torch.empty((n, 0), device=device), torch.empty((n, 0, top_n), device=device),
                 torch.empty((n, 0, top_n), dtype=torch.long, device=device))
        for t in range(max_new_tokens):
            log_probs = torch.log_softmax(logits, dim=-1)  # (n, V)
            # HF applies its processors to the log-probs
            log_probs = apply_processors(log_probs, settings, running, prompt_len=L)
            if t < min_new_tokens and len(eos):  # HF's MinNewTokensLengthLogitsProcessor: no EOS yet, the
                log_probs = log_probs.index_fill(1, eos, float("-inf"))  # other log-probs left as they are
            vocab = log_probs.shape[-1]
            total = (log_probs + running_scores[:, None]).view(-1)  # (n * V,)
            cand_scores, cand_index = torch.topk(total, keep)  # (keep,)
            cand_beam, cand_token = cand_index // vocab, cand_index % vocab
            cand_paths = _extended_paths(paths, log_probs, cand_index, cand_beam, top_n) if recorder is not None \
                else None
            generated_len = t + 1
            ends = torch.isin(cand_token, eos) | (generated_len == max_new_tokens)  # (keep,)
            if texts is not None:
                cand_texts = [_extended(texts[b], tok) for b, tok in zip(cand_beam.tolist(), cand_token.tolist())]
                ends |= torch.tensor([text.stopped for text in cand_texts], device=device)

            # Finished hypotheses: only candidates ranked in the top n may enter.
            if improvement_possible and not (early_stopping is True and len(finished) == n):
                for rank in range(n):
                    if not bool(ends[rank]):
                        continue
                    score = float(cand_scores[rank]) / generated_len ** length_penalty
                    ids = running[cand_beam[rank], L:].tolist() + [int(cand_token[rank])]
                    path = tuple(part[rank] for part in cand_paths) if cand_paths is not None else None
                    _add_hypothesis(finished, score, ids, n, path)

            # Next beams: the best candidates that did not end.
            next_rank = torch.topk(cand_scores + ends.float() * NEG_INF, n).indices  # (n,)
            beam_idx, next_tokens = cand_beam[next_rank], cand_token[next_rank]
            running = torch.cat([running[beam_idx], next_tokens[:, None]], dim=1)
            running_scores = cand_scores[next_rank] + ends[next_rank].float() * NEG_INF
            if cand_paths is not None:
                paths = tuple(part[next_rank] for part in cand_paths)
            if texts is not None:
                texts = [cand_texts[r] for r in next_rank.tolist()]

            improvement_possible = improvement_possible and _can_improve(
                running_scores, finished, n, generated_len, max_new_tokens, length_penalty, early_stopping)
            if (not improvement_possible or bool(ends.all())
                    or (early_stopping is True and len(finished) == n)):
                break
            session.reorder(beam_idx)
            logits = session.step(next_tokens)

    best_score, best_ids, best_path = finished[0]
    if recorder is not None:
        chosen, top_values, top_ids = best_path  # (t,), (t, N), (t, N)
        recorder.record_path(chosen, top_values, top_ids)
    return best_ids, best_score


def _extended_paths(paths: tuple[torch.Tensor, ...], log_probs: torch.Tensor, cand_index: torch.Tensor,
                    cand_beam: torch.Tensor, top_n: int) -> tuple[torch.Tensor, ...]:
    """Each candidate's path: its beam's log-probs (n, t) and alternatives (n, t, N) with this
    step's appended, for the candidates (keep,): (keep, t + 1), (keep, t + 1, N) twice."""
    chosen, top_values, top_ids = paths
    step_values, step_ids = log_probs.topk(min(top_n, log_probs.shape[-1]), dim=-1)  # (n, N)
    return (torch.cat([chosen[cand_beam], log_probs.view(-1)[cand_index][:, None]], dim=1),
            torch.cat([top_values[cand_beam], step_values[cand_beam][:, None]], dim=1),
            torch.cat([top_ids[cand_beam], step_ids[cand_beam][:, None]], dim=1))


def _extended(text: TextAssembler, token: int) -> TextAssembler:
    """A copy of a beam's text with ``token`` added (the beam itself may go on with another)."""
    text = text.fork()
    text.add(token)
    return text


def _add_hypothesis(finished: list[tuple[float, list[int], Any]], score: float, ids: list[int], n: int,
                    path: Any = None) -> None:
    """Insert keeping the list sorted best first (earlier entries win ties, as HF's topk)."""
    position = next((i for i, (s, *_) in enumerate(finished) if score > s), len(finished))
    finished.insert(position, (score, ids, path))
    del finished[n:]


def _can_improve(running_scores: torch.Tensor, finished: list[tuple[float, list[int], Any]], n: int,
                 generated_len: int, max_new_tokens: int, length_penalty: float,
                 early_stopping: bool | str) -> bool:
    """HF's heuristic: could the best running beam still beat the worst kept hypothesis?"""
    if len(finished) < n:
        return True
    if early_stopping == "never" and length_penalty > 0.0:
        best_length = max_new_tokens  # a longer sequence scores higher: assume the longest
    else:
        best_length = generated_len
    best_possible = float(running_scores[0]) / best_length ** length_penalty
    return best_possible > finished[-1][0]
