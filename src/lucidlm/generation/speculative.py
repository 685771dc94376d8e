"""Speculative decoding: a cheap guesser drafts K tokens, the model checks them in one pass.

>>> generate(model, "Repeat this: ...", temperature=0, draft="prompt")      # prompt lookup
>>> generate(fp32_model, prompt, draft=int4_model, draft_tokens=5)          # a draft model

Each round the model runs the last token and the K drafts together (``DecodeSession.feed``):
position i's logits give the model's own choice after draft i, so the drafts it agrees with
are kept, and its choice where it first disagrees (or after the last draft) comes free. A
rejected draft's keys stay in the cache past the kept slots, hidden by the causal mask and
overwritten by the next round (``DecodeSession.rewind``).

Exact, not approximate:

- greedy: a draft is kept only if it is the argmax the model gives there, so the tokens are
  plain greedy decoding's: to the bit where the check runs in the one-call decode step of
  lucidlm's CPU kernels (model/decode_block.py) and the unembedding is quantized too (the
  embedded default's int8). A float32 unembedding (quantize_embeddings=False) multiplies the
  T rows at once, ~3e-5 off the one-row product on SmolLM2, and elsewhere the check is the
  ordinary multi-token forward pass: equal up to float rounding (a near tie may fall the
  other way);
- sampling: the rule of Leviathan et al. 2023 / Chen et al. 2023 (gpt-fast's): draft x drawn
  from q is kept with probability min(1, p(x) / q(x)), else the token is drawn from
  normalize(max(p - q, 0)); p and q are the *processed* distributions (repetition penalty,
  temperature, top-k, top-p... as ``sample_next`` draws from), so every token has exactly the
  distribution plain sampling gives it. Prompt lookup drafts deterministically: q is one-hot.

Every processor sees what plain decoding would: position i's repetition penalty counts the
drafts before it, ``min_new_tokens`` bans EOS by the token's index. Tokens are handed out one
at a time, so EOS, stop strings and ``max_new_tokens`` end exactly where plain decoding ends.

Guessers: ``PromptLookup`` (n-gram lookup, no second model: the continuation of the latest
earlier occurrence of the last 3, else 2 tokens; transformers' prompt_lookup_num_tokens takes
the first occurrence and goes down to 1 token, llama.cpp's lookup decoding an n-gram cache) and ``DraftModel``
(any lucidlm model with the same vocabulary, e.g. an int4 copy: its own KV cache, rolled back
with the target's).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator, Optional, Sequence

import torch

from lucidlm.errors import GenerationError
from lucidlm.generation.decode import DecodeSession, suppress
from lucidlm.generation.prompt_cache import CacheReuse
from lucidlm.generation.sampling import argmax_rows, process_logits

DEFAULT_DRAFT_TOKENS = 5  # gpt-fast's speculate_k; see benchmarks/results/speculative.json
MAX_NGRAM = 3  # transformers' max_matching_ngram_size default (2) is a little shorter
# transformers drafts after a match of the last token alone; that one-token match is mostly
# chance ("the" ... the word after some earlier "the"): SmolLM2, 96 greedy tokens, requiring 2
# kept 52 of 72 drafts in 15 passes where 1 kept 45 of 103 in 21 (fix the typos in a paragraph),
# and 54 of 60 in 12 passes against 55 of 70 in 14 (repeat it)
MIN_NGRAM = 2


@dataclass
class SpeculationStats:
    """How the guesser did (``GenerationResult.speculation``): ``rounds`` model passes that
    checked drafts, ``drafted`` tokens proposed in them, ``accepted`` of those kept and handed out
    (not the ones an EOS or a stop string before them left out of the result)."""

    rounds: int = 0
    drafted: int = 0
    accepted: int = 0

    @property
    def acceptance_rate(self) -> Optional[float]:
        return self.accepted / self.drafted if self.drafted else None

    @property
    def accepted_per_round(self) -> Optional[float]:
        return self.accepted / self.rounds if self.rounds else None


def check_draft(model: Any, draft: Any) -> None:
    """Refuse a draft the target cannot check: a different vocabulary, or the target itself."""
    if draft is None or draft == "prompt":
        return
    config = getattr(draft, "config", None)
    if config is None or not hasattr(draft, "step"):
        raise GenerationError(f"draft={draft!r} is invalid: use draft='prompt' (prompt lookup) or a lucidlm model "
                              f"with the same vocabulary (e.g. lucidlm.load(..., quantize='int4')).")
    if draft is model:
        raise GenerationError("draft is the model itself: a model has one KV cache; load a second, cheaper copy "
                              "(e.g. quantize='int4') or use draft='prompt'.")
    if getattr(draft, "device", None) != getattr(model, "device", None):
        raise GenerationError(f"the draft model is on {draft.device} and the model on {model.device}: their "
                              f"distributions are compared token by token, so put both on one device "
                              f"(draft.to({str(model.device)!r})).")
    ours, theirs = model.config.vocab_size, config.vocab_size
    if ours != theirs or not _same_tokens(model.tokenizer, draft.tokenizer, ours):
        raise GenerationError(f"the draft model's vocabulary differs from the model's ({theirs} tokens against "
                              f"{ours}, or other token texts): its ids would mean other tokens. Use a draft of the "
                              f"same family and tokenizer, or draft='prompt'.")


def _same_tokens(ours: Any, theirs: Any, vocab_size: int) -> bool:
    """The two tokenizers give 64 spread-out ids the same text (None: nothing to compare)."""
    if ours is None or theirs is None or ours is theirs:
        return True
    sizes = getattr(ours, "vocab_size", vocab_size), getattr(theirs, "vocab_size", vocab_size)
    if sizes[0] != sizes[1]:
        return False
    # only the ids the tokenizers have: a model's embedding may be padded past them (nanoGPT's
    # 50304 rows for GPT-2's 50257 tokens), and decoding a padding id is an error in both
    n = min(vocab_size, sizes[0])
    ids = sorted({i * (n - 1) // 63 for i in range(64)})
    try:
        return all(ours.decode([i]) == theirs.decode([i]) for i in ids)
    except Exception:  # noqa: BLE001 - a tokenizer that cannot decode one of them: not the same one
        return False


class PromptLookup:
    """Drafts the tokens that followed the latest earlier occurrence of the text's last n
    tokens (n = 3, else 2; ``MIN_NGRAM``): nothing to run, and long runs kept when the answer copies
    the prompt (edits, quotes, code). An index of n-grams -> where their latest occurrence
    ended, updated as tokens come: O(1) per token."""

    def __init__(self, prompt: Sequence[int]) -> None:
        self.tokens: list[int] = []
        self.ends: dict[tuple[int, ...], int] = {}  # n-gram -> the end of its latest occurrence with a successor
        self._add(prompt)

    def _add(self, new: Sequence[int]) -> None:
        for token in new:
            m = len(self.tokens)  # the n-grams ending at m now have a successor (this token)
            for n in range(1, MAX_NGRAM + 1):
                if m >= n:
                    self.ends[tuple(self.tokens[m - n:m])] = m
            self.tokens.append(token)

    def propose(self, tokens: Sequence[int], k: int) -> tuple[list[int], None]:
        self._add(tokens[len(self.tokens):])
        for n in range(MAX_NGRAM, MIN_NGRAM - 1, -1):
            end = self.ends.get(tuple(self.tokens[-n:])) if len(self.tokens) > n else None
            if end is not None:
                return self.tokens[end:end + k], None
        return [], None

    def close(self) -> None:
        pass


class DraftModel:
    """Drafts with a second, cheaper model of the same vocabulary, greedy or sampled from its
    processed distribution q (returned with the drafts, for the acceptance rule). Its KV cache
    keeps what it has run that the text still begins with; the rest is rewound."""

    def __init__(self, draft: Any, prompt: Sequence[int], capacity: int, settings: Any, generator: Any,
                 min_new_tokens: int, eos_ids: Sequence[int], pad_id: int, steady: bool) -> None:
        self.settings, self.generator = settings, generator
        self.min_new_tokens, self.eos_ids = min_new_tokens, list(eos_ids)
        self.prompt_len = len(prompt)
        context = draft.config.max_seq_len
        if capacity > context:
            raise GenerationError(f"the draft model's context ({context} tokens, max_seq_len) is shorter than this "
                                  f"generation needs ({capacity}); lower max_new_tokens or use a draft with a "
                                  f"longer context.")
        self.session = DecodeSession(draft, [prompt], capacity=capacity, pad_id=pad_id, steady=steady)
        self.session.__enter__()
        try:
            self.session.prefill()
        except BaseException:
            self.close()
            raise
        self.fed = list(prompt)  # the ids in the draft's cache slots

    def propose(self, tokens: Sequence[int], k: int) -> tuple[list[int], Optional[torch.Tensor]]:
        """k drafted ids after ``tokens`` and, when sampling, their distributions q (k, V)."""
        session = self.session
        kept = next((i for i, (a, b) in enumerate(zip(self.fed, tokens)) if a != b), min(len(self.fed), len(tokens)))
        kept = min(kept, len(tokens) - 1)  # the last token's logits are needed: run it again if it is there
        session.rewind(kept)
        device = session.input_pos.device
        logits = session.feed(torch.tensor([list(tokens[kept:])], device=device))[:, -1]  # (1, V)
        seen = torch.tensor([list(tokens) + [tokens[0]] * k], device=device)  # (1, n + k), drafts written in
        n = len(tokens)
        dists = []
        for i in range(k):
            if n - self.prompt_len + i < self.min_new_tokens:
                logits = suppress(logits, self.eos_ids)
            processed = process_logits(logits, self.settings, seen[:, :n + i], prompt_len=self.prompt_len)
            if self.settings.greedy:
                ids = argmax_rows(processed)  # (1,)
            else:
                q = processed.softmax(dim=-1)  # (1, V)
                ids = torch.multinomial(q, 1, generator=self.generator)[:, 0]
                dists.append(q)
            seen[:, n + i] = ids
            if i + 1 < k:
                logits = session.step(ids)
        proposed = seen[0, n:].tolist()  # read back once a round
        self.fed = list(tokens) + proposed[:-1]  # the last draft is never run
        return proposed, torch.cat(dists) if dists else None

    def close(self) -> None:
        self.session.__exit__(None, None, None)


def speculative_rows(model: Any, prompt: Sequence[int], max_new_tokens: int, settings: Any,
                     generator: Optional[torch.Generator], finished: torch.Tensor, pad_id: int = 0,
                     min_new_tokens: int = 0, eos_ids: Sequence[int] = (), draft: Any = "prompt",
                     draft_tokens: int = DEFAULT_DRAFT_TOKENS, steady: bool = False, recorder: Any = None,
                     reuse: Optional[CacheReuse] = None,
                     stats: Optional[SpeculationStats] = None) -> Iterator[torch.Tensor]:
    """``sample_rows`` for one row, speculatively: yields each new token (1,) in turn, the same
    contract (``finished``, closing, ``reuse``, ``recorder``), with rounds of one model pass
    that may give several tokens. ``stats`` is filled as it goes."""
    if max_new_tokens <= 0:
        return
    stats = stats if stats is not None else SpeculationStats()
    tokens = list(prompt)
    L = len(tokens)
    capacity = L + max_new_tokens - 1  # the last token is never run
    backoff = Backoff()
    with DecodeSession(model, [tokens], capacity=capacity, pad_id=pad_id, steady=steady, reuse=reuse) as session:
        guesser = PromptLookup(tokens) if draft == "prompt" else \
            DraftModel(draft, tokens, capacity, settings, generator, min_new_tokens, eos_ids, pad_id, steady)
        try:
            logits = session.prefill()  # (1, V): the next token's
            drafts: list[int] = []
            q: Optional[torch.Tensor] = None
            while True:
                chosen = _check_drafts(logits.view(-1, logits.shape[-1]), drafts, q, tokens, len(tokens) - L,
                                       settings, generator, min_new_tokens, eos_ids, recorder)
                if drafts:
                    stats.rounds, stats.drafted = stats.rounds + 1, stats.drafted + len(drafts)
                    backoff.after_round(kept_any=len(chosen) > 1)
                for i, token in enumerate(chosen):
                    tokens.append(token)
                    # a kept draft counts as it is handed out: after an EOS or a stop string the
                    # round's later drafts are in no result (accepted_tokens > new_tokens was seen)
                    stats.accepted += i < len(chosen) - 1
                    try:
                        yield torch.tensor([token])
                    except GeneratorExit:
                        if reuse is not None and bool(finished.all()):  # the caller ended the row: a normal end
                            session.keep(torch.tensor(_run_with_their_history(tokens, session)))
                        raise
                    if len(tokens) - L == max_new_tokens or bool(finished.all()):
                        if reuse is not None:
                            session.keep(torch.tensor(_run_with_their_history(tokens, session)))
                        return
                session.rewind(len(tokens) - 1)  # the slot of the last token, not run yet
                k = min(draft_tokens, max_new_tokens - (len(tokens) - L) - 1)  # never past max_new_tokens
                drafts, q = guesser.propose(tokens, k) if k > 0 and backoff.ready() else ([], None)
                if drafts:
                    logits = session.feed(torch.tensor([[tokens[-1], *drafts]], device=session.input_pos.device))[0]
                else:  # nothing to check: a plain decode step
                    logits = session.step(torch.tensor([tokens[-1]], device=session.input_pos.device))
        finally:
            guesser.close()


def _run_with_their_history(tokens: list[int], session: DecodeSession) -> list[int]:
    """The first of ``tokens`` whose keys and values the cache's first slots hold, for
    ``DecodeSession.keep``. Not ``next_slot``'s worth: after a round that rejected a draft the
    slot where the model's own token goes still holds that draft (the token is run next round)."""
    return tokens[:min(session.next_slot, len(tokens) - 1)]


class Backoff:
    """When to draft. A round whose drafts were all rejected cost a pass of K + 1 tokens for one
    token, where a plain step is cheaper (SmolLM2 on this CPU, K = 5: 1.4-2x a float32 step,
    1.4x the 4-bit model's; benchmarks/results/speculative*.json). So
    after such a round the next 1, then 2, 4, 8, at most 16 tokens are plain steps, and a round
    that keeps a draft starts over: ordinary text (prompt lookup finds some earlier "the" all the
    time) pays for few wasted passes, and a copy starts paying again within 16 tokens. It decides
    by the counts alone, never by a clock: a seed gives the same tokens on any machine."""

    LONGEST = 16

    def __init__(self) -> None:
        self.wait = 0  # plain steps after the last failed round
        self.left = 0  # of those, still to come

    def ready(self) -> bool:
        if self.left:
            self.left -= 1
            return False
        return True

    def after_round(self, kept_any: bool) -> None:
        self.wait = 0 if kept_any else min(max(2 * self.wait, 1), self.LONGEST)
        self.left = self.wait


def _check_drafts(logits: torch.Tensor, drafts: list[int], q: Optional[torch.Tensor], tokens: list[int],
                  generated: int, settings: Any, generator: Optional[torch.Generator], min_new_tokens: int,
                  eos_ids: Sequence[int], recorder: Any) -> list[int]:
    """The tokens one round gives: the drafts the model keeps, then one of its own.

    logits (T, V), T = len(drafts) + 1: row i is the model's next-token logits after the
    text and drafts[:i]; q (T - 1, V) the draft's distributions (None: drafts were chosen
    deterministically); ``generated``: how many of ``tokens`` are new. Every row is processed as
    plain decoding would process it there, on exactly the text it follows: processors such as
    the n-gram ban and the sequence biases read a row's last tokens, and the presence and
    frequency penalties count the generated ones. The decisions are read back once."""
    T = logits.shape[0]
    device = logits.device
    seen = torch.tensor([tokens + drafts], device=device)  # (1, n + T - 1): row i has seen its first n + i
    prompt_len = len(tokens) - generated
    banned = [i for i in range(T) if generated + i < min_new_tokens]  # row i draws new token number generated + i
    if banned and eos_ids:
        logits = logits.clone()
        logits[torch.tensor(banned)[:, None], torch.tensor(list(eos_ids))[None, :]] = float("-inf")
    processed = torch.cat([process_logits(logits[i:i + 1], settings, seen[:, :len(tokens) + i], prompt_len=prompt_len)
                           for i in range(T)])  # (T, V); T is draft_tokens + 1 at most: a few small calls
    d = torch.tensor(drafts, device=device, dtype=torch.long)  # (T - 1,)
    if settings.greedy:
        best = argmax_rows(processed).tolist()  # (T,)
        kept = next((i for i in range(T - 1) if best[i] != drafts[i]), T - 1)
        chosen = drafts[:kept] + [best[kept]]
    else:
        p = processed.softmax(dim=-1)  # (T, V)
        kept = T - 1
        if T > 1:
            p_draft = p[:-1].gather(1, d[:, None])[:, 0]  # (T - 1,)
            q_draft = q.gather(1, d[:, None])[:, 0] if q is not None else torch.ones_like(p_draft)
            u = torch.rand(T - 1, generator=generator, device=device)
            keeps = (u * q_draft < p_draft).tolist()  # u < p / q, without dividing by a q of 0
            kept = next((i for i in range(T - 1) if not keeps[i]), T - 1)
        if kept < T - 1:  # rejected
            q_kept = q[kept] if q is not None else torch.nn.functional.one_hot(d[kept], p.shape[-1]).to(p.dtype)
            last = torch.multinomial(_rejection_distribution(p[kept], q_kept), 1, generator=generator)
        else:
            last = torch.multinomial(p[kept], 1, generator=generator)
        chosen = drafts[:kept] + last.tolist()
    if recorder is not None:
        for i, token in enumerate(chosen):
            recorder.record(processed[i:i + 1], torch.tensor([token], device=device))
    return chosen


def _rejection_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """What to draw from after a draft drawn from q (V,) was rejected: max(p - q, 0), where p
    has more mass than q; with the rejections' own probability that restores p exactly."""
    residual = (p - q).clamp(min=0)  # (V,)
    # all zero only if p == q up to rounding, when a rejection has ~0 probability: p itself
    return residual if bool(residual.sum() > 0) else p
