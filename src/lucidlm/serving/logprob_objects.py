"""Generate's log-probs (``GenerationResult.logprobs`` and ``top_logprobs``) in OpenAI's two
shapes: /v1/completions' ``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}`` and
the chat's ``{"content": [{"token", "logprob", "bytes", "top_logprobs"}]}``.

Which tokens: those that put text in the answer. Each token's text is the bytes it adds after
the token before it (``streaming.continuation_bytes``, what the answer's text is built from),
so the tokens join to the text: an EOS (no text) is left out, and with a stop string only the
tokens that begin before it. The values are generate's: the log-probs of the distribution each
token was drawn from (``generation/logprobs.py``).
"""

from __future__ import annotations

import codecs
import math
from dataclasses import dataclass
from typing import Any, Optional

from lucidlm.generation.streaming import continuation_bytes

# What OpenAI sends for a log-prob of -inf (a token a sampling filter removed), which JSON cannot hold.
FLOOR = -9999.0


@dataclass
class ScoredToken:
    data: bytes  # what the token adds to the text
    offset: int  # where its text begins in the answer (characters)
    logprob: Optional[float]  # None: a prompt's first token, which has no context
    top: Optional[list[tuple[bytes, float]]]  # the likeliest tokens at its step, each with the bytes it would add


def scored_tokens(tokenizer: Any, result: Any) -> list[ScoredToken]:
    ids = result.token_ids[:-1] if result.finish_reason == "eos" else result.token_ids
    tops = result.top_logprobs or [[] for _ in ids]
    previous: Optional[int] = result.prompt_ids[-1] if result.prompt_ids else None
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")  # as the answer's text is decoded
    characters = 0
    scored = []
    for token, logprob, top in zip(ids, result.logprobs, tops):
        if result.finish_reason == "stop" and characters >= len(result.text):
            break  # the rest is the stop string, which the text leaves out
        data = continuation_bytes(tokenizer, previous, token)
        scored.append(ScoredToken(data, characters, logprob,
                                  [(continuation_bytes(tokenizer, previous, alt), value) for alt, value in top]))
        characters += len(decoder.decode(data))
        previous = token
    return scored


def scored_prompt(tokenizer: Any, scores: Any, added_bos: bool = False) -> list[ScoredToken]:
    """A prompt's tokens with ``generation.prompt_logprobs``' values (echo with logprobs): the
    first token's log-prob and alternatives are None, as it has no context. ``added_bos``: the
    first token is the BOS the tokenizer put before a text prompt, which is not in the echoed
    text: it adds nothing to it (so the tokens join to the text and the offsets count in it)."""
    previous: Optional[int] = None
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    characters = 0
    scored = []
    for i, (token, logprob, top) in enumerate(zip(scores.token_ids, scores.logprobs, scores.top_logprobs)):
        if i == 0 and added_bos:
            scored.append(ScoredToken(b"", 0, logprob, top))  # None, None: the first token's
            continue  # and the next token's text is a text's first, as the echoed prompt has it
        data = continuation_bytes(tokenizer, previous, token)
        alternatives = None if top is None else [(continuation_bytes(tokenizer, previous, alt), value)
                                                 for alt, value in top]
        scored.append(ScoredToken(data, characters, logprob, alternatives))
        characters += len(decoder.decode(data))
        previous = token
    return scored


def shifted(tokens: list[ScoredToken], characters: int) -> list[ScoredToken]:
    """``tokens`` with their offsets moved on by ``characters`` (the answer after an echoed prompt)."""
    return [ScoredToken(t.data, t.offset + characters, t.logprob, t.top) for t in tokens]


def completion_logprobs(tokens: list[ScoredToken], with_top: bool) -> dict[str, Any]:
    """/v1/completions' logprobs; ``top_logprobs`` maps each alternative's text to its log-prob
    (two tokens of the same text: the likelier one's); null when none were asked for. A prompt's
    first token (echo) has null for both, as OpenAI's and vLLM's."""
    tops = None
    if with_top:
        tops = []
        for token in tokens:
            if token.top is None:
                tops.append(None)
                continue
            alternatives: dict[str, float] = {}
            for data, value in token.top:
                alternatives.setdefault(token_text(data), finite(value))
            tops.append(alternatives)
    return {"tokens": [token_text(t.data) for t in tokens],
            "token_logprobs": [None if t.logprob is None else finite(t.logprob) for t in tokens],
            "top_logprobs": tops, "text_offset": [t.offset for t in tokens]}


def chat_logprobs(tokens: list[ScoredToken]) -> dict[str, Any]:
    """The chat's logprobs: each token with its UTF-8 bytes, which a token holding part of a
    character needs to be put back together."""
    def entry(data: bytes, value: float) -> dict[str, Any]:
        return {"token": token_text(data), "logprob": finite(value), "bytes": list(data)}

    return {"content": [dict(entry(t.data, t.logprob), top_logprobs=[entry(d, v) for d, v in t.top])
                        for t in tokens], "refusal": None}


def token_text(data: bytes) -> str:
    """A token's text; a token that is part of a UTF-8 character is ``bytes:\\xe2\\x80`` (OpenAI's way)."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{byte:02x}" for byte in data)


def finite(value: float) -> float:
    return value if math.isfinite(value) else FLOOR
