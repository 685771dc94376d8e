"""A ``tokenizer.json`` that carries a truncation or padding setting (saved from a classifier
with ``max_length=512``) must not cut a prompt short or pad it: transformers' fast tokenizer
encodes such a file in full unless asked to truncate, and lucidlm's context checks
(``fit_to_context``, ``fewest_tokens``) count on every token being there."""

from __future__ import annotations

import pytest

tokenizers = pytest.importorskip("tokenizers")
transformers = pytest.importorskip("transformers")


def _tokenizer_file(tmp_path):
    backend = tokenizers.Tokenizer(tokenizers.models.BPE())
    backend.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = tokenizers.decoders.ByteLevel()
    backend.train_from_iterator(["hello world " * 10], tokenizers.trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(), special_tokens=["<pad>"]))
    backend.enable_truncation(4)
    backend.enable_padding(length=50, pad_token="<pad>", pad_id=backend.token_to_id("<pad>"))
    path = tmp_path / "tokenizer.json"
    backend.save(str(path))
    return path


def test_a_saved_truncation_or_padding_setting_is_not_applied(tmp_path):
    from lucidlm.tokenizers import HFTokenizer

    path = _tokenizer_file(tmp_path)
    ours = HFTokenizer.from_file(path)
    theirs = transformers.PreTrainedTokenizerFast(tokenizer_file=str(path))
    for text in ["hello world " * 20, "hello"]:
        expected = theirs(text, add_special_tokens=False)["input_ids"]
        assert ours.encode(text) == expected
        assert ours.encode_batch([text]) == [expected]
        assert ours.decode(ours.encode(text)) == text
        assert ours.fewest_tokens(text) <= len(expected)
