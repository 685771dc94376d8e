"""Streaming text: whole UTF-8 characters only, stop strings held back, pieces == text."""

from __future__ import annotations

import pytest
from generation_toys import ScriptedModel, byte_tokenizer, toy_model, one_torch_thread  # noqa: F401 (autouse fixture)

from lucidlm.generation import generate, stream
from lucidlm.generation.streaming import TextAssembler

TEXT = "Café 👋🏽 naïve — ok! 日本語 END after"


def scripted(text: str, tail: tuple[int, ...] = ()) -> tuple[ScriptedModel, str]:
    """A model that 'generates' the UTF-8 bytes of text, one byte per token (so every
    non-ASCII character is split over 2-4 tokens), then the ``tail`` ids."""
    tok = byte_tokenizer()
    prompt = "go"
    return ScriptedModel(tok, list(text.encode()) + list(tail), prompt_len=len(prompt)), prompt


def test_pieces_join_to_text_and_never_split_a_character():
    model, prompt = scripted(TEXT, tail=(256,))  # ends with EOS
    pieces = list(stream(model, prompt, max_new_tokens=200, temperature=0))
    result = generate(model, prompt, max_new_tokens=200, temperature=0)
    assert "".join(pieces) == result.text == TEXT
    assert all("\ufffd" not in p for p in pieces)
    assert len(pieces) > 10  # it really streamed
    assert result.finish_reason == "eos"
    assert result.token_ids == list(TEXT.encode()) + [256]


def test_stop_string_across_tokens_is_cut_and_held_back():
    model, prompt = scripted(TEXT)
    pieces = list(stream(model, prompt, max_new_tokens=200, stop=["END"], temperature=0))
    result = generate(model, prompt, max_new_tokens=200, stop=["END"], temperature=0)
    expected = TEXT[:TEXT.index("END")]
    assert "".join(pieces) == result.text == expected
    assert result.finish_reason == "stop"
    # generation stopped at the token that completed "END"
    assert result.token_ids == list((expected + "END").encode())
    assert not any("E" in p for p in pieces)


def test_earliest_of_several_stop_strings_wins_and_false_starts_are_released():
    model, prompt = scripted("ab EX EN 日本 stop here")
    result = generate(model, prompt, max_new_tokens=100, stop=["END", "本 s", "here"], temperature=0)
    assert result.text == "ab EX EN 日"
    pieces = list(stream(model, prompt, max_new_tokens=100, stop=["END", "本 s", "here"], temperature=0))
    assert "".join(pieces) == result.text


def test_length_limit_mid_character_flushes_a_replacement_char():
    model, prompt = scripted("a👋")
    result = generate(model, prompt, max_new_tokens=3, temperature=0)  # "a" + 2 of the emoji's 4 bytes
    assert result.text == "a\ufffd"
    assert "".join(stream(model, prompt, max_new_tokens=3, temperature=0)) == result.text
    assert result.finish_reason == "length"


def test_sampled_random_bytes_stream_equals_generate():
    model = toy_model(seed=3)  # random bytes: plenty of invalid UTF-8
    kwargs = dict(max_new_tokens=60, temperature=1.5, seed=5, stop_on_eos=False)
    pieces = list(stream(model, "Hello", **kwargs))
    result = generate(model, "Hello", **kwargs)
    assert "".join(pieces) == result.text
    assert result.text == model.tokenizer.decode(result.token_ids)


def test_stream_frees_the_cache_when_abandoned():
    model, prompt = scripted(TEXT)
    pieces = stream(model, prompt, max_new_tokens=50, temperature=0)
    next(pieces)
    assert model.cache_live
    pieces.close()
    assert not model.cache_live


@pytest.mark.parametrize("chunks, stop, expected", [
    (["he", "ll", "o wor", "ld"], ["wor"], "hello "),
    (["ab", "c"], ["bcd"], "abc"),  # a false start is released at the end
    (["x", "y", "z"], [], "xyz"),
])
def test_text_assembler(chunks, stop, expected):
    tok = byte_tokenizer()
    asm = TextAssembler(tok, stop)
    out = ""
    for chunk in chunks:
        for b in chunk.encode():
            out += asm.add(b)
    out += asm.finish()
    assert out == asm.text == expected
