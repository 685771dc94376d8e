"""A GGUF header parsed once per process (``gguf_header_cache.py``), and never served stale:

- a second load of an unchanged file does not parse the header again, and gives the same
  weights and a tokenizer of its own (changing one model's tokenizer leaves the next load's alone);
- a file patched in place (same size, same modification time) is parsed again: the new
  metadata shows, the new tokenizer too;
- a NaN written into a tensor's data after a cached load is still refused (the cache holds
  the header only; the tensor data is read from the file every time).
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from test_gguf import write_f32_gguf

from lucidlm.errors import WeightsError
from lucidlm.weights import gguf_header_cache
from lucidlm.weights.gguf import load_gguf
from lucidlm.weights.gguf_reader import GGUFFile


@pytest.fixture(autouse=True)
def fresh_cache():
    gguf_header_cache.clear()
    yield
    gguf_header_cache.clear()


def count_parses(monkeypatch) -> list[str]:
    parsed: list[str] = []
    original = GGUFFile._parse_header

    def counting(self, buf):
        parsed.append(str(self.path))
        return original(self, buf)

    monkeypatch.setattr(GGUFFile, "_parse_header", counting)
    return parsed


def test_second_load_reuses_the_header_and_gives_its_own_tokenizer(tmp_path, monkeypatch):
    path, _ = write_f32_gguf(tmp_path / "tiny.gguf")
    parsed = count_parses(monkeypatch)
    first = load_gguf(path)
    first.tokenizer.chat_template = "changed by the user"
    first.tokenizer.special_tokens["<|mine|>"] = 7
    second = load_gguf(path)
    assert parsed == [str(path)]  # the second load hashed the header and reused it
    assert second.tokenizer is not first.tokenizer
    assert second.tokenizer.chat_template.startswith("{% for m in messages %}")
    assert "<|mine|>" not in second.tokenizer.special_tokens
    assert second.tokenizer.encode("ab abx<|endoftext|>") == [257, 260, 1 + ord("x"), 0]
    for (name, a), (_, b) in zip(first.state_dict().items(), second.state_dict().items()):
        assert torch.equal(a, b), name


def test_a_file_patched_in_place_is_parsed_again(tmp_path, monkeypatch):
    path, _ = write_f32_gguf(tmp_path / "tiny.gguf")
    stat = path.stat()
    parsed = count_parses(monkeypatch)
    assert load_gguf(path).tokenizer.chat_template.startswith("{% for m in messages %}")
    raw = bytearray(path.read_bytes())
    at = raw.index(b"{% for m in messages %}")
    raw[at:at + 23] = b"{% for x in messages %}"  # same length: same size
    path.write_bytes(bytes(raw))
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # and the same modification time
    assert path.stat().st_size == stat.st_size and path.stat().st_mtime_ns == stat.st_mtime_ns
    assert load_gguf(path).tokenizer.chat_template.startswith("{% for x in messages %}")
    assert parsed == [str(path), str(path)]


def test_a_nan_written_after_a_cached_load_is_refused(tmp_path):
    path, _ = write_f32_gguf(tmp_path / "tiny.gguf")
    load_gguf(path)
    tensor = next(t for t in GGUFFile(path).tensors if t.name == "blk.0.ffn_up.weight")
    with open(path, "r+b") as f:
        f.seek(tensor.data_offset + 4 * 5)
        f.write(np.array([np.nan], dtype=np.float32).tobytes())
    with pytest.raises(WeightsError, match="blk.0.ffn_up.weight"):
        load_gguf(path)
