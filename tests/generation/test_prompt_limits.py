"""A prompt that cannot fit the context whatever its tokens is refused before it is tokenized
(``generation/prompt_limits.py``): a 13 MB prompt took 3.3 GB to encode only to be refused.
Here the tokenizer's ``encode`` refuses to run at all, so a refusal that tokenized first fails."""

from __future__ import annotations

import pytest
from generation_toys import toy_model

import lucidlm
from lucidlm import LanguageModel, cli
from lucidlm.chat import Conversation
from lucidlm.errors import GenerationError
from lucidlm.generation import generate, stream

pytestmark = pytest.mark.usefixtures("one_thread")

CONTEXT = 64
HUGE = "é" * 100_000  # 200,000 bytes: byte tokens, at least 200,000 / 13 (<|endoftext|>'s bytes) ids


@pytest.fixture
def model():
    return toy_model(seed=1, max_seq_len=CONTEXT, model_cls=LanguageModel)


@pytest.fixture
def no_encoding(model, monkeypatch):
    real = model.tokenizer.encode

    def encode(text, **kwargs):
        if len(text) > 10 * CONTEXT:
            raise AssertionError("a prompt past the context was tokenized before it was refused")
        return real(text, **kwargs)

    monkeypatch.setattr(model.tokenizer, "encode", encode)


REFUSED = rf"at least \d+ tokens \(100\d+ characters\), longer than the model's context of {CONTEXT} tokens"


@pytest.mark.parametrize("call", [
    lambda m: generate(m, HUGE, max_new_tokens=1),
    lambda m: generate(m, HUGE, max_new_tokens=1, chat=True),
    lambda m: stream(m, HUGE, max_new_tokens=1),
    lambda m: generate(m, ["hi", HUGE], max_new_tokens=1),
], ids=["generate", "chat", "stream", "batch"])
def test_a_huge_prompt_is_refused_without_tokenizing(model, no_encoding, call):
    with pytest.raises(GenerationError, match=REFUSED):
        call(model)


def test_a_huge_chat_message_is_refused_and_the_conversation_kept(model, no_encoding):
    convo = Conversation()
    convo.add_user(HUGE)
    with pytest.raises(GenerationError, match=REFUSED.replace("at least", "the chat prompt is at least")):
        convo.fit_context(model, reserve=8)
    assert convo.history[-1]["content"] == HUGE  # nothing dropped (the REPL pops the message it refused)


def test_the_cli_chat_prompt_is_refused_without_tokenizing(model, no_encoding, monkeypatch, capsys):
    monkeypatch.setattr(lucidlm, "load", lambda *args, **kwargs: model)
    assert cli.main(["generate", HUGE, "--chat", "-q", "--max-new-tokens", "1"]) != 0
    assert "the chat prompt is at least" in capsys.readouterr().err


def test_prompts_that_fit_or_crop_are_not_refused(model):
    """A prompt of exactly the context fits; with context_overflow="crop" any length is taken
    (only its last max_seq_len tokens are read)."""
    fits = "a" * CONTEXT
    assert generate(model, fits, max_new_tokens=1, temperature=0).prompt_ids == list(fits.encode())
    long = "é" * 1000  # a bound of 2000 / 13 = 154 > 64
    result = generate(model, long, max_new_tokens=1, temperature=0, context_overflow="crop")
    assert len(result.prompt_ids) == 2000 and len(result.token_ids) == 1
