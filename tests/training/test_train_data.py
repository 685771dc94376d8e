"""The data pipeline: tokenize once into memory-mapped splits, random windows, padding, errors."""

import numpy as np
import pytest
import torch

from lucidlm.errors import DataError
from lucidlm.tokenizers import CharTokenizer
from lucidlm.training.batches import get_batch, pad_batch
from lucidlm.training.data import check_enough_data, count_batches, prepare_data


def test_char_split_matches_nanogpt_prepare(corpus, tmp_path):
    # nanoGPT's shakespeare_char/prepare.py: chars = sorted(set(data)); first 90% train, last 10% val.
    text = corpus.read_text()
    stoi = {c: i for i, c in enumerate(sorted(set(text)))}
    expected = np.array([stoi[c] for c in text], dtype=np.uint16)
    n = len(expected)
    data = prepare_data(corpus, tmp_path, "char")
    assert isinstance(data.train, np.memmap) and data.train.dtype == np.uint16
    np.testing.assert_array_equal(np.asarray(data.train), expected[: int(n * 0.9)])
    np.testing.assert_array_equal(np.asarray(data.val), expected[int(n * 0.9):])
    assert (tmp_path / "data" / "train.bin").stat().st_size == 2 * int(n * 0.9)


def test_prepared_data_is_reused_not_retokenized(corpus, tmp_path):
    prepare_data(corpus, tmp_path, "char")
    bin_path = tmp_path / "data" / "train.bin"
    before = bin_path.stat().st_mtime_ns
    again = prepare_data(corpus, tmp_path, "char")
    assert bin_path.stat().st_mtime_ns == before
    assert again.tokenizer.encode("First") == CharTokenizer.train(corpus.read_text()).encode("First")


def test_out_of_vocabulary_ids_in_token_files(corpus, tmp_path):
    """An id the vocabulary does not have (a damaged train.bin of the right size) is refused on a
    resume with one line naming the file, the id and the vocabulary; a new run tokenizes again."""
    data = prepare_data(corpus, tmp_path, "char")
    expected, vocab = np.array(data.train), data.tokenizer.vocab_size
    del data
    for name in ("train.bin", "val.bin"):
        path = tmp_path / "data" / name
        original = path.read_bytes()
        tokens = np.fromfile(path, dtype=np.uint16)
        tokens[len(tokens) // 2] = vocab  # one past the last id
        tokens.tofile(path)
        with pytest.raises(DataError) as err:
            prepare_data(corpus, tmp_path, "char", resume=True)
        message = str(err.value)
        assert "\n" not in message
        assert f"{path} holds token id {vocab}, but the vocabulary has {vocab} ids" in message
        assert f"the data is damaged; delete the folder {tmp_path / 'data'}" in message
        rebuilt = prepare_data(corpus, tmp_path, "char")  # not a resume: the corpus is tokenized again
        np.testing.assert_array_equal(np.asarray(rebuilt.train), expected)
        assert path.read_bytes() == original
        del rebuilt


def test_word_tokens_and_folder_of_files(tmp_path):
    folder = tmp_path / "docs"
    folder.mkdir()
    (folder / "a.txt").write_text("to be or not to be " * 30)
    (folder / "b.txt").write_text("that is the question " * 30)
    (folder / "skip.md").write_text("not a txt file")
    data = prepare_data(folder, tmp_path / "out", "word")
    tokens = np.concatenate([data.train, data.val]).tolist()
    words = ("to be or not to be " * 30).split() + ["<|endoftext|>"] + ("that is the question " * 30).split()
    assert data.tokenizer.decode(tokens).split() == words


def test_uint32_when_vocab_exceeds_uint16(tmp_path):
    words = " ".join(f"w{i}" for i in range(70000))
    path = tmp_path / "many.txt"
    path.write_text(words)
    data = prepare_data(path, tmp_path / "out", "word")
    assert data.tokenizer.vocab_size > 65536 and data.train.dtype == np.uint32
    assert data.tokenizer.decode([int(data.train[-1])]) == f"w{int(70000 * 0.9) - 1}"


def test_get_batch_windows_are_shifted_and_reproducible():
    tokens = np.arange(1000, dtype=np.uint16)
    g1, g2 = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
    x, y = get_batch(tokens, 8, 16, g1)
    x2, y2 = get_batch(tokens, 8, 16, g2)
    assert x.shape == (8, 16) and x.dtype == torch.int64
    assert torch.equal(x, x2) and torch.equal(y, y2)
    starts = x[:, 0]
    assert torch.equal(x, starts[:, None] + torch.arange(16))  # contiguous windows of the corpus
    assert torch.equal(y, x + 1)  # targets are the next tokens
    assert int(starts.max()) <= 1000 - 17
    x3, _ = get_batch(tokens, 8, 16, g1)  # the generator moved on
    assert not torch.equal(x, x3)


def test_pad_batch_masks_padding_targets():
    batch = pad_batch([[5, 6, 7], [8]], pad_id=0)
    assert batch.ids.tolist() == [[5, 6, 7], [8, 0, 0]]
    assert batch.attention_mask.tolist() == [[1, 1, 1], [1, 0, 0]]
    assert batch.targets.tolist() == [[6, 7, -100], [-100, -100, -100]]
    assert pad_batch([[1, 2]], pad_id=3, ignore_index=0).targets.tolist() == [[2, 0]]


def test_missing_and_empty_corpus(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        prepare_data(tmp_path / "nope.txt", tmp_path / "out")
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    with pytest.raises(DataError, match="empty"):
        prepare_data(empty, tmp_path / "out")
    (tmp_path / "folder").mkdir()
    with pytest.raises(DataError, match="no .txt files"):
        prepare_data(tmp_path / "folder", tmp_path / "out")


def test_non_utf8_names_the_byte_offset(tmp_path):
    path = tmp_path / "latin1.txt"
    path.write_bytes("café au lait".encode("utf-8") + b" na\xefve")
    with pytest.raises(DataError) as err:
        prepare_data(path, tmp_path / "out")
    offset = len("café au lait".encode("utf-8")) + 3
    assert f"offset {offset}" in str(err.value) and "0xef" in str(err.value) and "latin1.txt" in str(err.value)


def test_too_small_corpus_says_how_many_batches(corpus, tmp_path):
    data = prepare_data(corpus, tmp_path, "char")
    n_train = int(len(corpus.read_text()) * 0.9)
    batch, block = 12, 256
    expected = (n_train // (block + 1)) // batch  # seed 004's count
    assert count_batches(len(data.train), batch, block) == expected < 10
    with pytest.raises(DataError) as err:
        check_enough_data(data, batch, block)
    message = str(err.value)
    assert f"only {expected} distinct batches" in message and "--block-size" in message and "--batch-size" in message
    check_enough_data(data, 4, 32)  # a smaller batch and context fit


def test_interleaved_split_holds_out_every_tenth_chunk():
    from lucidlm.training.data import SPLIT_CHUNK, split_tokens

    tokens = np.arange(SPLIT_CHUNK * 25 + 7, dtype=np.uint32)
    train, val = split_tokens(tokens, 0.1, "interleaved")
    assert len(train) + len(val) == len(tokens)
    val_chunks = sorted(set((val // SPLIT_CHUNK).tolist()))
    assert val_chunks == [9, 19]  # chunks 9 and 19 of 0..25: a tenth, evenly spread
    assert np.array_equal(np.sort(np.concatenate([train, val])), tokens)  # nothing lost or repeated
    tail_train, tail_val = split_tokens(tokens, 0.1, "tail")
    assert len(tail_val) == len(tokens) - int(len(tokens) * 0.9) and tail_val[0] == tail_train[-1] + 1
