"""A GGUF header parsed once per process (``gguf_header_cache.py``), and never served stale:

- a second load of an unchanged file does not parse the header again, and gives the same
  weights and a tokenizer of its own (changing one model's tokenizer leaves the next load's alone);
- a file patched in place (same size, same modification time) is parsed again: the new
  metadata shows, the new tokenizer too;
- a NaN written into a tensor's data after a cached load is still refused (the cache holds
  the header only; the tensor data is read from the file every time);
- on disk, for the next process: a header read back from ``$LUCIDLM_CACHE/gguf-headers`` is
  value for value and type for type what ``gguf``'s own reader finds in the file (NaN,
  infinities, 64-bit integers, booleans, nested arrays, text outside ASCII); a patched file, a
  damaged or foreign cache file and an unwritable cache all mean parsing, never an error.
"""

from __future__ import annotations

import json
import math
import os

import gguf
import numpy as np
import pytest
import torch
from test_gguf import write_f32_gguf

from lucidlm.errors import WeightsError
from lucidlm.weights import gguf_header_cache
from lucidlm.weights.gguf import load_gguf
from lucidlm.weights.gguf_reader import GGUFFile


@pytest.fixture(autouse=True)
def fresh_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LUCIDLM_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(gguf_header_cache, "DISK_MIN_BYTES", 0)  # the test files' headers are small
    gguf_header_cache.clear()
    yield
    gguf_header_cache.clear()


def new_process() -> None:
    """What a fresh interpreter has: no header parsed in this process (the disk cache stays)."""
    gguf_header_cache.clear()


def disk_files(tmp_path) -> list:
    return sorted((tmp_path / "cache" / gguf_header_cache.DISK_DIR).glob("*.json"))


def count_parses(monkeypatch) -> list[str]:
    parsed: list[str] = []
    original = GGUFFile._parse_header

    def counting(self, buf):
        parsed.append(str(self.path))
        return original(self, buf)

    monkeypatch.setattr(GGUFFile, "_parse_header", counting)
    return parsed


ACROSS = pytest.mark.parametrize("across", ["in one process", "in a new process (from disk)"])


def between_loads(across: str) -> None:
    if across != "in one process":
        new_process()


@ACROSS
def test_second_load_reuses_the_header_and_gives_its_own_tokenizer(tmp_path, monkeypatch, across):
    path, _ = write_f32_gguf(tmp_path / "tiny.gguf")
    parsed = count_parses(monkeypatch)
    first = load_gguf(path)
    first.tokenizer.chat_template = "changed by the user"
    first.tokenizer.special_tokens["<|mine|>"] = 7
    between_loads(across)
    second = load_gguf(path)
    assert parsed == [str(path)]  # the second load hashed the header and reused it
    assert second.config == first.config
    assert second.tokenizer is not first.tokenizer
    assert second.tokenizer.chat_template.startswith("{% for m in messages %}")
    assert "<|mine|>" not in second.tokenizer.special_tokens
    assert second.tokenizer.encode("ab abx<|endoftext|>") == [257, 260, 1 + ord("x"), 0]
    for (name, a), (_, b) in zip(first.state_dict().items(), second.state_dict().items()):
        assert torch.equal(a, b), name


@ACROSS
def test_a_file_patched_in_place_is_parsed_again(tmp_path, monkeypatch, across):
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
    between_loads(across)
    assert load_gguf(path).tokenizer.chat_template.startswith("{% for x in messages %}")
    assert parsed == [str(path), str(path)]
    new_process()  # the new header replaced the old one on disk
    assert load_gguf(path).tokenizer.chat_template.startswith("{% for x in messages %}")
    assert parsed == [str(path), str(path)] and len(disk_files(tmp_path)) == 1


def test_a_nan_written_after_a_cached_load_is_refused(tmp_path):
    path, _ = write_f32_gguf(tmp_path / "tiny.gguf")
    load_gguf(path)
    tensor = next(t for t in GGUFFile(path).tensors if t.name == "blk.0.ffn_up.weight")
    with open(path, "r+b") as f:
        f.seek(tensor.data_offset + 4 * 5)
        f.write(np.array([np.nan], dtype=np.float32).tobytes())
    with pytest.raises(WeightsError, match="blk.0.ffn_up.weight"):
        load_gguf(path)


# ----------------------------------------------------------------------------- on disk


def same_value(a, b) -> bool:
    """Equal in value and in type, NaN equal to NaN, lists element by element."""
    if isinstance(a, list) or isinstance(b, list):
        return type(a) is type(b) and len(a) == len(b) and all(same_value(x, y) for x, y in zip(a, b))
    if type(a) is not type(b):
        return False
    return (math.isnan(a) and math.isnan(b)) if isinstance(a, float) and a != a else a == b


def gguf_reader_value(field) -> object:
    """``gguf.GGUFReader``'s value of a field as a plain Python value (the oracle)."""
    def scalar(part, kind):
        if kind == gguf.GGUFValueType.STRING:
            return bytes(part).decode("utf-8")
        value = part.tolist()[0]
        return bool(value) if kind == gguf.GGUFValueType.BOOL else value

    kinds = field.types
    if kinds[0] != gguf.GGUFValueType.ARRAY:
        return scalar(field.parts[field.data[0]], kinds[0])
    if len(kinds) > 2:
        return None  # nested arrays: GGUFReader does not decode them; checked against the writer instead
    return [scalar(field.parts[i], kinds[1]) for i in field.data]


def write_tricky_gguf(path) -> dict:
    typed = [  # (writer method, key, value)
        ("add_float32", "t.f32_nan", float("nan")), ("add_float32", "t.f32_inf", float("-inf")),
        ("add_float32", "t.f32_third", 1 / 3), ("add_float64", "t.f64_tiny", 5e-324),
        ("add_uint64", "t.u64_max", 2**64 - 1), ("add_int64", "t.i64_min", -2**63), ("add_bool", "t.bool", True),
        ("add_string", "t.text", "Zürich 東京 \u2603 \"quoted\" \\ tab\t"), ("add_string", "t.empty", ""),
        ("add_array", "t.bools", [True, False, True]), ("add_array", "t.f32s", [0.1, float("inf"), -0.0]),
        ("add_array", "t.strings", ["a", "é", ""]), ("add_array", "t.nested", [[1, 2], [3]]),
    ]
    writer = gguf.GGUFWriter(str(path), "llama")
    for method, key, value in typed:
        getattr(writer, method)(key, value)
    writer.add_tensor("w", np.arange(64, dtype=np.float32).reshape(2, 32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return {key: value for _, key, value in typed}


def test_a_header_on_disk_is_exactly_what_the_file_holds(tmp_path, monkeypatch):
    path = tmp_path / "tricky.gguf"
    written = write_tricky_gguf(path)
    parsed = count_parses(monkeypatch)
    GGUFFile(path)
    assert parsed == [str(path)] and len(disk_files(tmp_path)) == 1
    new_process()
    reread = GGUFFile(path)
    assert parsed == [str(path)]  # read from disk, not parsed
    oracle = gguf.GGUFReader(str(path))
    for key, field in oracle.fields.items():
        if key.startswith("GGUF."):
            continue  # the reader's own pseudo-fields (version, counts)
        expected = gguf_reader_value(field)
        if expected is None:
            expected = written[key]
        assert same_value(reread.metadata[key], expected), (key, reread.metadata[key], expected)
    assert set(reread.metadata) == {k for k in oracle.fields if not k.startswith("GGUF.")}
    assert same_value(reread.metadata["t.f32_third"], float(np.float32(1 / 3)))  # float32's value, not 1/3
    tensor = reread.tensors[0]
    assert (tensor.name, tensor.shape.tolist()) == ("w", [32, 2])
    np.testing.assert_array_equal(tensor.data, np.arange(64, dtype=np.float32).reshape(2, 32))


@pytest.mark.parametrize("damage", ["truncated", "not json", "a list", "wrong types", "another path",
                                    "wrong digest", "wrong format"])
def test_a_damaged_cache_file_means_parsing(tmp_path, monkeypatch, damage):
    path, _ = write_f32_gguf(tmp_path / "tiny.gguf")
    GGUFFile(path)
    (cache_file,) = disk_files(tmp_path)
    text = cache_file.read_text()
    record = json.loads(text)
    if damage == "truncated":
        text = text[:len(text) // 2]
    elif damage == "not json":
        text = "\x00garbage"
    elif damage == "a list":
        text = "[1, 2, 3]"
    else:
        if damage == "wrong types":
            record["infos"] = [[1, "x", None, 0]]
        elif damage == "another path":
            record["path"] = "/elsewhere/model.gguf"
        elif damage == "wrong digest":
            record["digest"] = "00" * 32
        else:
            record["format"] = 99
        record["metadata"]["general.name"] = "from the damaged cache"
        text = json.dumps(record)
    cache_file.write_text(text)
    new_process()
    parsed = count_parses(monkeypatch)
    reread = GGUFFile(path)
    assert parsed == [str(path)]
    assert reread.metadata.get("general.name") != "from the damaged cache"
    assert json.loads(cache_file.read_text())["digest"] == record["digest"] or damage == "wrong digest"
    new_process()
    GGUFFile(path)
    assert parsed == [str(path)]  # rewritten whole: the next process reads it


@pytest.mark.parametrize("why", ["not a directory", "no home directory"])
def test_an_unusable_cache_is_skipped(tmp_path, monkeypatch, why):
    if why == "not a directory":
        blocker = tmp_path / "a-file"
        blocker.write_text("not a directory")
        monkeypatch.setenv("LUCIDLM_CACHE", str(blocker / "cache"))  # cannot be created, even by root
    else:
        def no_home():
            raise RuntimeError("Could not determine home directory.")  # what Path.home() raises

        monkeypatch.setattr(gguf_header_cache, "cache_root", no_home)
    path, _ = write_f32_gguf(tmp_path / "tiny.gguf")
    parsed = count_parses(monkeypatch)
    assert load_gguf(path).config.n_layers == 2
    new_process()
    assert load_gguf(path).config.n_layers == 2
    assert parsed == [str(path), str(path)]


def test_small_headers_stay_off_disk_and_old_entries_go(tmp_path, monkeypatch):
    monkeypatch.setattr(gguf_header_cache, "DISK_MIN_BYTES", 1 << 20)
    path, _ = write_f32_gguf(tmp_path / "tiny.gguf")
    GGUFFile(path)
    assert disk_files(tmp_path) == []
    monkeypatch.setattr(gguf_header_cache, "DISK_MIN_BYTES", 0)
    monkeypatch.setattr(gguf_header_cache, "DISK_MAX_FILES", 3)
    paths = []
    for i in range(5):
        paths.append(write_f32_gguf(tmp_path / f"m{i}.gguf", n_layers=1)[0])
        GGUFFile(paths[-1])
    kept = {json.loads(f.read_text())["path"] for f in disk_files(tmp_path)}
    assert kept == {os.path.realpath(p) for p in paths[2:]}  # the three newest
