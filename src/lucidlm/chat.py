"""Conversation state: a chat in progress, streamed turn by turn.

The templates that turn a conversation into the model's text live in
``lucidlm.generation.chat_template`` (generation needs them for ``chat=True``); they are
re-exported here so ``from lucidlm.chat import render_chat`` keeps working.
"""

from __future__ import annotations

from typing import Any, Iterator, Optional

from lucidlm.errors import GenerationError, SequenceTooLongError
from lucidlm.generation import stream
from lucidlm.model.transformer import Transformer
from lucidlm.suggest import keywords_checked
from lucidlm.generation.chat_template import (CHATML_TEMPLATE, Message, chat_template_of, encode_chat, render_chat,
                                              render_chat_for)

__all__ = ["Conversation", "CHATML_TEMPLATE", "Message", "chat_template_of", "encode_chat", "render_chat",
           "render_chat_for"]


@keywords_checked(GenerationError)
class Conversation:
    """A chat in progress: an optional system prompt and the turns so far.

    >>> convo = Conversation(system="You are terse.")
    >>> convo.add_user("What is the capital of France?")
    >>> answer = "".join(convo.reply(model, temperature=0))   # streams; history updated at the end
    """

    def __init__(self, system: Optional[str] = None) -> None:
        self.system = system  # None: the template's default (SmolLM2 adds its own system prompt)
        self.history: list[Message] = []
        self.last_result: Any = None  # the GenerationResult of the latest reply (ids, finish reason)

    @property
    def messages(self) -> list[Message]:
        system = [{"role": "system", "content": self.system}] if self.system else []
        return system + self.history

    def add_user(self, text: str) -> None:
        """Add the user's next message (text). A message no tokenizer can encode (a lone
        surrogate) is refused here, at its position in the message, and not added."""
        from lucidlm.tokenizers.encode_input import check_text

        if not isinstance(text, str):
            raise GenerationError(f"a chat message is text (str), not {type(text).__name__}.")
        check_text(text)
        self.history.append({"role": "user", "content": text})

    def reply(self, model: Transformer, **gen_kwargs: Any) -> Iterator[str]:
        """Stream the assistant's answer to the conversation so far. The options (``**gen_kwargs``:
        ``lucidlm.generation.stream``'s, e.g. ``temperature=0``) are checked
        here, before anything streams (a refused one leaves the conversation as it was); the
        answer joins the history when the stream ends, also when the caller stops it early
        (Ctrl-C).

        ``reuse_cache`` is on unless given: the next turn's prompt is this one plus the answer
        and a new message, so it runs only what is new (``generate``'s ``reuse_cache``)."""
        gen_kwargs.setdefault("reuse_cache", True)
        if not self.history or self.history[-1]["role"] != "user":
            raise GenerationError("reply() needs a user message last: call add_user(text) first.")
        ids = encode_chat(model.tokenizer, self.messages)
        self.last_result = None
        return self._answer(stream(model, ids, **gen_kwargs))

    def _answer(self, text_stream: Any) -> Iterator[str]:
        pieces: list[str] = []
        try:
            for piece in text_stream:
                pieces.append(piece)
                yield piece
            self.last_result = text_stream.result
        finally:
            self.history.append({"role": "assistant", "content": "".join(pieces)})

    def fit_context(self, model: Transformer, reserve: int) -> int:
        """Drop the oldest turns (never the system prompt, never the last user message) until
        the conversation plus ``reserve`` tokens for the answer fits ``model``'s context.
        Returns how many messages were dropped. A last message longer than the context on its
        own (with the system prompt) is refused with both numbers before anything is dropped:
        no history could make room for it."""
        limit = model.config.max_seq_len
        system = [{"role": "system", "content": self.system}] if self.system else []
        if self.history:
            alone = len(encode_chat(model.tokenizer, system + self.history[-1:], context=limit))  # a huge one: not encoded
            if alone > limit:
                with_system = " with the system prompt" if system else ""
                raise SequenceTooLongError(
                    f"this message is {alone} tokens in the chat template{with_system}, more than the model's "
                    f"context of {limit} tokens, so it cannot be answered; shorten it (the conversation is kept).")

        def fits(start: int) -> bool:
            return len(encode_chat(model.tokenizer, system + self.history[start:])) + reserve <= limit

        # Where the history may start: after 0, 1, 2, ... dropped turns. Fewer messages render
        # fewer tokens, so the first start that fits is found by bisection: a long /load-ed chat
        # costs log2(turns) encodings, not one per dropped turn.
        starts = _turn_starts(self.history)
        if len(starts) == 1 or fits(starts[0]):
            return 0
        lo, hi = 0, len(starts) - 1  # starts[lo] does not fit; starts[hi], the last message alone, is the floor
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if fits(starts[mid]) else (mid, hi)
        del self.history[:starts[hi]]
        return starts[hi]

    def reset(self, system: Optional[str] = None, keep_system: bool = True) -> None:
        """Forget the turns; keep the system prompt unless a new one is given or keep_system=False."""
        self.history.clear()
        if system is not None or not keep_system:
            self.system = system


def _turn_starts(history: list[Message]) -> list[int]:
    """The indices ``history`` may be cut at, oldest first: 0, then after each oldest user turn
    with its answer (everything up to the first answer), down to the last message alone."""
    starts = [0]
    while len(history) - starts[-1] > 1:
        rest = history[starts[-1]:-1]
        first_answer = next((i for i, m in enumerate(rest) if m["role"] == "assistant"), 0)
        starts.append(starts[-1] + min(first_answer + 1, len(rest)))
    return starts
