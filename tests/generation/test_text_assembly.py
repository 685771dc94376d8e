"""Generated text never loses a character: for every kind of tokenizer, the streamed pieces
joined == ``generate().text`` == ``tokenizer.decode(prompt + output)`` minus the prompt's text.

The outputs are random ids (hypothesis), fed through the real generation loop by a scripted
model: words (joined by spaces), byte-level BPE ids that split UTF-8 characters, and
sentencepiece byte-fallback tokens (``<0xE2>``), valid or not.
"""

from __future__ import annotations

import pytest
from generation_toys import ScriptedModel, byte_tokenizer, one_torch_thread  # noqa: F401 (autouse fixture)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lucidlm.generation import generate, generate_batch, stream
from lucidlm.tokenizers import BPETokenizer, CharTokenizer, HFTokenizer, WordTokenizer

CORPUS = "Love is not love which alters when it alteration finds. Café — naïve 日本 👋🏽!\n"


def sentencepiece_tokenizer() -> HFTokenizer:
    """A LLaMA-2-style sentencepiece BPE: prefix space, byte fallback, and a decoder that drops
    the leading space it added (the ``Strip`` step)."""
    from tokenizers import Tokenizer, decoders, normalizers
    from tokenizers.models import BPE

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"<0x{b:02X}>": 3 + b for b in range(256)})
    for piece in ["\u2581", "a", "b", "l", "o", "v", "e", "\u2581l", "ov", "\u2581lov", "\u2581love", "é", "日"]:
        vocab.setdefault(piece, len(vocab))
    merges = [("\u2581", "l"), ("o", "v"), ("\u2581l", "ov"), ("\u2581lov", "e")]
    backend = Tokenizer(BPE(vocab=vocab, merges=merges, byte_fallback=True, unk_token="<unk>", fuse_unk=True))
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    backend.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
    backend.add_special_tokens(["<s>", "</s>"])
    return HFTokenizer(backend, add_bos=True, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def byte_level_hf_tokenizer() -> HFTokenizer:
    """A byte-level BPE run by the ``tokenizers`` library (SmolLM2's kind), trained here."""
    from tokenizers import Tokenizer, decoders, pre_tokenizers, trainers
    from tokenizers.models import BPE

    backend = Tokenizer(BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator([CORPUS] * 20, trainer)
    return HFTokenizer(backend, eos_token="<|endoftext|>")


TOKENIZERS = {
    "char": lambda: CharTokenizer.train(CORPUS),
    "word": lambda: WordTokenizer.train(CORPUS),
    "bpe": lambda: BPETokenizer.train(CORPUS * 5, vocab_size=300),
    "bytes": lambda: byte_tokenizer(),  # one byte per id: every non-ASCII character splits
    "hf-byte-level": byte_level_hf_tokenizer,
    "hf-sentencepiece": sentencepiece_tokenizer,
}
_built: dict = {}


def tokenizer_of(kind: str):
    if kind not in _built:
        _built[kind] = TOKENIZERS[kind]()
    return _built[kind]


def expected_text(tok, prompt_ids: list[int], output_ids: list[int]) -> str:
    whole, prompt = tok.decode(prompt_ids + output_ids), tok.decode(prompt_ids)
    assert whole.startswith(prompt)  # the prompts below are whole characters
    return whole[len(prompt):]


@pytest.mark.parametrize("kind", sorted(TOKENIZERS))
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_streamed_pieces_equal_text_equal_decode(kind, data):
    tok = tokenizer_of(kind)
    specials = set(tok.special_tokens.values())
    prompt_text = data.draw(st.sampled_from(["Love", "love é", " alters", "日本"]))
    prompt_ids = tok.encode(prompt_text)
    ordinary = st.integers(0, tok.vocab_size - 1).filter(lambda i: i not in specials)
    output = data.draw(st.lists(ordinary, min_size=1, max_size=24))
    model = ScriptedModel(tok, output, prompt_len=len(prompt_ids))
    result = generate(model, prompt_ids, max_new_tokens=len(output), temperature=0)
    pieces = list(stream(model, prompt_ids, max_new_tokens=len(output), temperature=0))
    assert result.token_ids == output
    assert "".join(pieces) == result.text == expected_text(tok, prompt_ids, output)
    batch = generate_batch(model, [prompt_ids], max_new_tokens=len(output), temperature=0)
    assert batch[0].text == result.text


def test_word_level_generation_keeps_its_spaces():
    """Seed 004's word model printed "thethethe": words were decoded one at a time."""
    tok = tokenizer_of("word")
    words = ["is", "love", "which", "alters"]
    script = [tok.encode(w)[0] for w in words]
    prompt = tok.encode("Love")
    model = ScriptedModel(tok, script, prompt_len=len(prompt))
    result = generate(model, "Love", max_new_tokens=4, temperature=0)
    assert result.text == " is love which alters"
    assert "Love" + result.text == tok.decode(prompt + script)
    assert "".join(stream(model, "Love", max_new_tokens=4, temperature=0)) == result.text


def test_a_character_split_between_prompt_and_output_belongs_to_the_output():
    tok = byte_tokenizer()
    euro = list("€".encode())  # 3 bytes
    prompt = [ord("x")] + euro[:2]  # the prompt ends inside the character
    model = ScriptedModel(tok, euro[2:] + [ord("!")], prompt_len=len(prompt))
    result = generate(model, prompt, max_new_tokens=2, temperature=0)
    assert result.text == "€!"
    assert tok.decode(prompt + result.token_ids) == "x" + result.text


def test_sentencepiece_byte_fallback_decodes_like_the_backend_on_valid_text():
    tok = sentencepiece_tokenizer()
    for text in ["love", "é 日 love", "  two spaces", "ünïcödé 👋"]:
        ids = tok.encode(text)
        assert tok.decode(ids) == tok.backend.decode(ids, skip_special_tokens=False)
        assert tok.decode(ids[1:]) == text  # without BOS, the prefix space is dropped again
