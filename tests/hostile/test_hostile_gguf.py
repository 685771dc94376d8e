"""Hostile GGUF files: a damaged header or absurd metadata is refused with one line naming the
file (and the key), before anything is allocated; a fuzzer mutates a small valid file (cuts it
short, flips bytes, sets every numeric key to 0 / -1 / its maximum) and every result either
loads or is refused with lucidlm's own error, quickly and without a large allocation.

The tiny file is written by ``gguf.GGUFWriter`` (tests/weights/test_gguf.py); the mutations
patch values in place through ``gguf.GGUFReader`` (the reference reader), so where each
value lives comes from the gguf package, not from the reader under test."""

from __future__ import annotations

import random
import re
import resource
import shutil
import struct
import sys
import time
from pathlib import Path

import gguf
import numpy as np
import pytest
from harness import api_refused, main_refused, refused

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "weights"))
from test_gguf import tiny_weights, to_gguf_layout, write_llama_gguf  # noqa: E402

from lucidlm.errors import ConfigError, GGUFError, LucidLMError, TokenizerError, WeightsError  # noqa: E402
from lucidlm.weights.gguf import load_gguf  # noqa: E402

V = gguf.GGUFValueType
FILE_ERRORS = (GGUFError, ConfigError, TokenizerError, WeightsError)  # each names the file


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    write_llama_gguf(path, {k: to_gguf_layout(k, v) for k, v in tiny_weights(1).items()}, 1)
    load_gguf(path)  # the unmutated file loads
    return path


def mutated(good: Path, tmp_path: Path, name: str = "bad.gguf") -> Path:
    path = tmp_path / name
    shutil.copyfile(good, path)
    return path


def set_field(path: Path, key: str, value, value_type: gguf.GGUFValueType | None = None) -> None:
    """Overwrite a scalar metadata value in place (optionally reinterpreting its type id,
    e.g. u32 -> i32 to store -1 in the same four bytes)."""
    reader = gguf.GGUFReader(str(path), "r+")
    field = reader.fields[key]
    if value_type is not None:
        field.parts[2][0] = value_type  # parts: key length, key, type, value
    part = field.parts[field.data[0]]
    part[...] = np.array(value).astype(part.dtype) if not isinstance(value, bytes) else np.frombuffer(value, np.uint8)
    del reader


def header_value_offset(path: Path, key: str) -> int:
    field = gguf.GGUFReader(str(path)).fields[key]
    return int(field.offset) + sum(int(p.nbytes) for p in field.parts[:-1])


def loads_or_refused(path: Path) -> str:
    """Load ``path``; lucidlm's own file errors are fine (they name the file), anything else is a bug."""
    try:
        load_gguf(path)
    except FILE_ERRORS as exc:
        message = str(exc)
        assert "\n" not in message.strip() and path.name in message, message
        return type(exc).__name__
    return "loaded"


# ------------------------------------------------------------------ specific refusals

def patch_string(path: Path, key: str, bad: bytes) -> None:
    """Replace the first len(bad) bytes of a string value (same length: the layout stays valid)."""
    data = bytearray(path.read_bytes())
    start = header_value_offset(path, key)
    data[start:start + len(bad)] = bad
    path.write_bytes(bytes(data))


def token_offset(path: Path, index: int) -> int:
    field = gguf.GGUFReader(str(path)).fields["tokenizer.ggml.tokens"]
    return int(field.offset) + sum(int(p.nbytes) for p in field.parts[:field.data[index]])


@pytest.mark.parametrize("key", ["general.architecture", "general.name", "tokenizer.ggml.model",
                                 "tokenizer.chat_template"])
def test_non_utf8_string_names_file_and_key(good, tmp_path, key):
    path = mutated(good, tmp_path)
    if key == "general.name":  # GGUFWriter does not write one: add it
        writer_path = tmp_path / "named.gguf"
        reader = gguf.GGUFReader(str(good))
        writer = gguf.GGUFWriter(str(writer_path), "llama")
        for field in reader.fields.values():
            if not field.name.startswith("GGUF.") and field.name != "general.architecture":
                value = field.contents()
                kind = field.types[0]
                if kind == V.ARRAY:
                    writer.add_array(field.name, value)
                else:
                    writer.add_key_value(field.name, value, kind)
        writer.add_name("tinyllama")
        for tensor in reader.tensors:
            writer.add_tensor(tensor.name, np.array(tensor.data), raw_shape=list(reversed(tensor.shape.tolist())),
                              raw_dtype=tensor.tensor_type)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        path = writer_path
        load_gguf(path)
    patch_string(path, key, b"\xff\xfe")
    api_refused(lambda: load_gguf(path), GGUFError, names=[path.name, rf"{key}.* is not UTF-8"])


def test_non_utf8_token_names_the_token(good, tmp_path):
    path = mutated(good, tmp_path)
    data = bytearray(path.read_bytes())
    data[token_offset(path, 200)] = 0xFF  # the first byte of token 200's text
    path.write_bytes(bytes(data))
    api_refused(lambda: load_gguf(path), GGUFError, names=[r"tokenizer\.ggml\.tokens\[200\] is not UTF-8"])


def test_string_past_the_end_names_the_string(good, tmp_path):
    path = mutated(good, tmp_path)
    data = bytearray(path.read_bytes())
    start = token_offset(path, 200) - 8  # token 200's length field
    data[start:start + 8] = struct.pack("<Q", len(data))
    path.write_bytes(bytes(data))
    api_refused(lambda: load_gguf(path), GGUFError,
                names=[rf"string 200 of \d+ at byte {start} runs past the end of the file"])


U32, I32 = V.UINT32, V.INT32
# (key, value, type to store it as, regex the error names)
BAD_VALUES = [
    ("llama.attention.head_count", 0, None, r"llama\.attention\.head_count' is 0; expected a value between 1"),
    ("llama.attention.head_count", -1, I32, r"llama\.attention\.head_count' is -1"),
    ("llama.attention.head_count_kv", 0, None, r"head_count_kv' is 0"),
    ("llama.attention.head_count_kv", 3, None, r"head_count_kv=3 does not divide .*head_count=4"),
    ("llama.attention.head_count_kv", 8, None, r"head_count_kv' is 8; expected a value between 1 and 4"),
    ("llama.block_count", 1_000_000, None, r"block_count' is 1000000; expected a value between 1 and 4096"),
    ("llama.block_count", 2, None, r"block_count=2 but the file has tensors for layers 0\.\.0"),
    ("llama.context_length", 4_000_000_000, None, r"context_length' is 4000000000"),
    ("llama.context_length", 50_000_000, None, r"context_length' is 50000000"),
    ("llama.context_length", 0, None, r"context_length' is 0"),
    ("llama.embedding_length", 0, None, r"embedding_length' is 0"),
    ("llama.embedding_length", 512, None, r"token_embd\.weight' has shape \(261, 256\), but the metadata describes "
                                          r"\(261, 512\)"),
    ("llama.feed_forward_length", 2**32 - 1, None, r"feed_forward_length' is 4294967295"),
    ("llama.feed_forward_length", 1024, None, r"ffn_gate\.weight' has shape .*describes"),
    ("llama.rope.dimension_count", 0, None, r"dimension_count' is 0"),
    ("llama.rope.dimension_count", 63, None, r"key_length|partial rotary|even"),
    ("llama.rope.freq_base", 0.0, None, r"freq_base' is 0\.0; expected a number > 0"),
    ("llama.rope.freq_base", float("nan"), None, r"freq_base' is nan; expected a finite number"),
    ("llama.attention.layer_norm_rms_epsilon", float("inf"), None, r"layer_norm_rms_epsilon' is inf"),
    ("tokenizer.ggml.eos_token_id", 10**9, None, r"eos_token_id=1000000000 is outside the vocabulary"),
]


@pytest.mark.parametrize("key, value, as_type, problem", BAD_VALUES,
                         ids=[f"{k.split('.', 1)[1]}={v}" for k, v, _, _ in BAD_VALUES])
def test_absurd_metadata_is_refused_before_allocating(good, tmp_path, key, value, as_type, problem):
    path = mutated(good, tmp_path)
    set_field(path, key, value, as_type)
    error = api_refused(lambda: load_gguf(path), LucidLMError, names=[path.name, problem])
    assert isinstance(error, FILE_ERRORS), error


def test_more_tokens_than_embedding_rows(tmp_path):
    path = tmp_path / "short_embedding.gguf"
    weights = {k: to_gguf_layout(k, v) for k, v in tiny_weights(1).items()}
    weights["token_embd.weight"] = weights["token_embd.weight"][:200]
    write_llama_gguf(path, weights, 1)
    api_refused(lambda: load_gguf(path), GGUFError, names=[r"261 tokens but token_embd\.weight only 200 rows"])


def test_layout_damage_names_what_runs_past_the_end(good, tmp_path):
    size = good.stat().st_size
    cases = {  # offset -> bytes written there, regex the error names
        "version 1": (4, struct.pack("<I", 1), r"GGUF version 1, which lucidlm cannot read"),
        "version 4": (4, struct.pack("<I", 4), r"GGUF version 4"),
        "big-endian version": (4, struct.pack(">I", 3), r"is a big-endian GGUF file .*gguf-convert-endian"),
        "2**40 tensors": (8, struct.pack("<Q", 1 << 40), r"1099511627776 tensor infos .*needs"),
        "2**63 metadata entries": (16, struct.pack("<Q", 1 << 63), r"9223372036854775808 metadata entries"),
        "first key 2**62 bytes long": (24, struct.pack("<Q", 1 << 62), r"metadata entry #0: a string of "
                                                                       r"4611686018427387904 bytes"),
    }
    _refuse_patched(good, tmp_path, cases)
    assert good.stat().st_size == size


def test_array_and_tensor_counts_beyond_the_file(good, tmp_path):
    reader = gguf.GGUFReader(str(good))
    tokens = reader.fields["tokenizer.ggml.tokens"]
    count_at = int(tokens.offset) + sum(int(p.nbytes) for p in tokens.parts[:4])  # key len, key, type, item type
    first = reader.tensors[0]
    cases = {
        "token count 2**61": (count_at, struct.pack("<Q", 1 << 61), r"an array of 2305843009213693952 strings"),
        "unknown value type": (int(tokens.offset) + sum(int(p.nbytes) for p in tokens.parts[:2]),
                               struct.pack("<I", 77), r"tokenizer\.ggml\.tokens' has unknown value type 77"),
        "tensor with 5 dims": (int(first.field.offset) + sum(int(p.nbytes) for p in first.field.parts[:2]),
                               struct.pack("<I", 5), r"has 5 dimensions; GGUF allows 1 to 4"),
        "tensor dim 2**62": (int(first.field.offset) + sum(int(p.nbytes) for p in first.field.parts[:3]),
                             struct.pack("<Q", 1 << 62), r"spans bytes .*beyond the end of the file"),
    }
    _refuse_patched(good, tmp_path, cases)


@pytest.mark.parametrize("alignment", [0, 3, 1 << 31])
def test_bad_alignment(tmp_path, alignment):
    path = tmp_path / "aligned.gguf"
    write_llama_gguf(path, {k: to_gguf_layout(k, v) for k, v in tiny_weights(1).items()}, 1, alignment=64)
    load_gguf(path)  # 64 is fine
    set_field(path, "general.alignment", alignment)
    api_refused(lambda: load_gguf(path), GGUFError, names=[rf"general\.alignment is {alignment}; expected a power of two"])


def write_with_tokenizer(good: Path, path: Path, **fields) -> Path:
    """The tiny model with tokenizer metadata replaced by ``fields`` (key suffix -> (value, type))."""
    base = gguf.GGUFReader(str(good))
    writer = gguf.GGUFWriter(str(path), "llama")
    for field in base.fields.values():
        name = field.name
        if name.startswith("GGUF.") or name == "general.architecture" or name.split(".")[-1] in fields:
            continue
        if field.types[0] == V.ARRAY:
            writer.add_array(name, field.contents())
        else:
            writer.add_key_value(name, field.contents(), field.types[0])
    for suffix, (value, kind) in fields.items():
        key = f"tokenizer.{suffix}" if suffix == "chat_template" else f"tokenizer.ggml.{suffix}"
        writer.add_array(key, value) if kind == V.ARRAY else writer.add_key_value(key, value, kind)
    for tensor in base.tensors:
        writer.add_tensor(tensor.name, np.array(tensor.data))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


BAD_TOKENIZERS = {
    "merge without a space": ({"merges": (["ab", "c d"], V.ARRAY)}, r"merges\[0\] is 'ab', not two tokens"),
    "merge with an empty side": ({"merges": (["c d", "ef "], V.ARRAY)}, r"merges\[1\] is 'ef ', not two tokens"),
    "merge with two spaces": ({"merges": (["c d", "a  b"], V.ARRAY)}, r"merges\[1\] is 'a  b', not two tokens"),
    "merges of numbers": ({"merges": ([1, 2], V.ARRAY)}, r"'tokenizer\.ggml\.merges' is \[1, 2\]; expected a list of strs"),
    "tokens of numbers": ({"tokens": (list(range(261)), V.ARRAY)}, r"tokenizer\.ggml\.tokens' is \[0, 1"),
    "token types too short": ({"token_type": ([3, 1], V.ARRAY)}, r"token_type has 2 entries for 261 tokens"),
    "duplicated tokens": ({"tokens": (["<|endoftext|>", *(chr(0x100 + i) for i in range(256)), "ab", "ab", "ef", "x"],
                                      V.ARRAY)}, r"do not form a BPE tokenizer"),
    "add_bos_token a string": ({"add_bos_token": ("yes", V.STRING)}, r"add_bos_token' is 'yes'; expected true or false"),
    "chat template a number": ({"chat_template": (5, V.UINT32)}, r"tokenizer\.chat_template is int, not a string"),
    "eos id a string": ({"eos_token_id": ("0", V.STRING)}, r"eos_token_id' is '0'; expected an integer"),
}


@pytest.mark.parametrize("fields, problem", BAD_TOKENIZERS.values(), ids=BAD_TOKENIZERS.keys())
def test_broken_tokenizer_metadata_is_one_line(good, tmp_path, fields, problem):
    path = write_with_tokenizer(good, tmp_path / "tok.gguf", **fields)
    api_refused(lambda: load_gguf(path), TokenizerError, names=[r"tok\.gguf", problem])


# ------------------------------------------------------------------ the fuzzer

class Budget:
    """Every fuzz case must end in seconds and without a large allocation."""

    def __init__(self) -> None:
        self.peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss

    def check(self, label: str, start: float) -> None:
        assert time.monotonic() - start < 10, f"{label}: took {time.monotonic() - start:.1f} s"
        grown_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - self.peak) / 1024
        assert grown_mb < 1500, f"{label}: peak memory grew by {grown_mb:.0f} MB"


def header_end(path: Path) -> int:
    reader = gguf.GGUFReader(str(path))
    return int(reader.data_offset)


def test_fuzz_truncation(good, tmp_path):
    data, budget = good.read_bytes(), Budget()
    end = header_end(good)
    rng = random.Random(13)
    cuts = sorted(set(range(0, 64)) | set(rng.sample(range(64, end), 80)) | set(rng.sample(range(end, len(data)), 8)))
    outcomes = {}
    path = tmp_path / "cut.gguf"
    for cut in cuts:
        path.write_bytes(data[:cut])
        start = time.monotonic()
        outcomes[cut] = loads_or_refused(path)
        budget.check(f"cut at {cut}", start)
    assert all(outcome != "loaded" for outcome in outcomes.values()), outcomes  # no cut leaves a whole model


def test_fuzz_byte_flips(good, tmp_path):
    data, budget = good.read_bytes(), Budget()
    end = header_end(good)
    rng = random.Random(2026)
    path = tmp_path / "flipped.gguf"
    seen = {}
    for case in range(150):
        damaged = bytearray(data)
        for _ in range(rng.choice((1, 1, 2, 4))):
            damaged[rng.randrange(end)] ^= 1 << rng.randrange(8)
        path.write_bytes(bytes(damaged))
        start = time.monotonic()
        outcome = loads_or_refused(path)
        seen[outcome] = seen.get(outcome, 0) + 1
        budget.check(f"flip case {case}", start)
    assert seen.get("GGUFError", 0) >= 10, seen  # the fuzzer does reach the reader's checks


def numeric_fields(path: Path) -> list[tuple[str, gguf.GGUFValueType]]:
    reader = gguf.GGUFReader(str(path))
    return [(f.name, f.types[0]) for f in reader.fields.values()
            if not f.name.startswith("GGUF.") and len(f.types) == 1 and f.types[0] not in (V.STRING, V.ARRAY)]


EXTREMES = {V.UINT8: (0, 255), V.UINT32: (0, 2**32 - 1), V.INT32: (0, -1, -(2**31), 2**31 - 1),
            V.UINT64: (0, 2**64 - 1), V.INT64: (0, -1), V.FLOAT32: (0.0, -1.0, float("inf"), float("nan"), 3e38),
            V.BOOL: (0, 1)}


def test_fuzz_every_numeric_key(good, tmp_path):
    budget = Budget()
    fields = numeric_fields(good)
    assert len(fields) >= 8, fields
    results = {}
    for key, kind in fields:
        values = [(v, None) for v in EXTREMES.get(kind, (0,))]
        if kind == V.UINT32:
            values.append((-1, V.INT32))  # the same bytes read as a signed -1
        for value, as_type in values:
            path = mutated(good, tmp_path)
            set_field(path, key, value, as_type)
            start = time.monotonic()
            results[(key, value)] = loads_or_refused(path)
            budget.check(f"{key}={value}", start)
    for key in ("llama.attention.head_count", "llama.block_count", "llama.embedding_length",
                "llama.context_length", "llama.feed_forward_length"):
        assert results[(key, 0)] != "loaded" and results[(key, 2**32 - 1)] != "loaded", key


# ------------------------------------------------------------------ through the CLI

def test_cli_commands_refuse_head_count_zero(good, tmp_path):
    path = mutated(good, tmp_path, "zero_heads.gguf")
    set_field(path, "llama.attention.head_count", 0)
    names = [r"zero_heads\.gguf", r"llama\.attention\.head_count' is 0"]
    refused("generate", "--model", str(path), "hi", "--max-new-tokens", "2", names=names, watch=[tmp_path])
    refused("inspect", "--model", str(path), "hi", "--out", str(tmp_path / "r.html"), names=names, watch=[tmp_path])
    refused("convert", str(path), str(tmp_path / "out"), "--to", "hf", names=names, watch=[tmp_path])
    assert not (tmp_path / "out").exists() and not (tmp_path / "r.html").exists()


def _refuse_patched(good, tmp_path, cases):
    """Each case: a copy of ``good`` with ``raw`` written at ``offset``, refused naming ``problem``."""
    for name, (offset, raw, problem) in cases.items():
        path = mutated(good, tmp_path, re.sub(r"\W+", "_", name) + ".gguf")
        data = bytearray(path.read_bytes())
        data[offset:offset + len(raw)] = raw
        path.write_bytes(bytes(data))
        api_refused(lambda: load_gguf(path), GGUFError, names=[path.name, problem])


def test_inspect_out_never_replaces_the_gguf_it_reads(good, tmp_path):
    path = tmp_path / "model.gguf"
    shutil.copyfile(good, path)
    main_refused("inspect", "hi", "--model", str(path), "--out", str(path),
                 names=[r"--out .*model\.gguf is where --model .*model\.gguf is read from", "choose another --out"],
                 watch=[tmp_path])
