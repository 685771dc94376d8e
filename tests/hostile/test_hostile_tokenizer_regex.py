"""A tokenizer.json whose pre-tokenizer regex backtracks catastrophically: refused when it is
read (nested unbounded repeats, ``(a+)+$``) or, for the patterns no static check sees
(overlapping alternation, ``(a|aa)+$``), one TokenizerError when the Rust backend gives up,
never a PanicException traceback."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from harness import api_refused, refused

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "weights"))
from test_gguf import tiny_weights, to_gguf_layout, write_llama_gguf  # noqa: E402

from lucidlm.errors import TokenizerError  # noqa: E402
from lucidlm.tokenizers.pretrained import PRE_TOKENIZER_SPLITS, HFTokenizer  # noqa: E402
from lucidlm.tokenizers.regex_safety import nested_quantifier  # noqa: E402

GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"


def write_tokenizer(directory: Path, pattern: str, where: str = "pre_tokenizer") -> Path:
    from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers

    directory.mkdir(parents=True, exist_ok=True)
    backend = Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1, "b": 2}, unk_token="[UNK]"))
    if where == "pre_tokenizer":
        backend.pre_tokenizer = pre_tokenizers.Split(Regex(pattern), behavior="isolated")
    else:
        backend.normalizer = normalizers.Replace(Regex(pattern), "x")
    backend.save(str(directory / "tokenizer.json"))
    return directory / "tokenizer.json"


@pytest.mark.parametrize("pattern", ["(a+)+$", "(a*)*b", "((a+))+", r"(\w+\s?)*$", "(a{2,})+", "(?:[a-z]+,?)+x"])
@pytest.mark.parametrize("where", ["pre_tokenizer", "normalizer"])
def test_nested_repeats_are_refused_when_read(tmp_path, pattern, where):
    path = write_tokenizer(tmp_path, pattern, where)
    api_refused(lambda: HFTokenizer.from_file(path), TokenizerError,
                names=[r"tokenizer\.json", where.replace("_", "-") + " regex", "backtracks exponentially"])


@pytest.mark.parametrize("pattern", [GPT2_SPLIT, *sorted(set(PRE_TOKENIZER_SPLITS.values())), "(ab)+", "(a+)?b",
                                     r"\(a+\)+", "[(a+)+]", "(a|b)+", r"\p{N}{1,3}"])
def test_real_and_harmless_patterns_pass(pattern):
    assert nested_quantifier(pattern) is None


def test_a_panic_of_the_backend_is_one_line(tmp_path):
    path = write_tokenizer(tmp_path, "(a|aa)+$")  # exponential, but no nested repeat to see
    tokenizer = HFTokenizer.from_file(path)
    assert tokenizer.encode("ba") == [2, 1]  # short text is fine: "a" at the end is split off
    api_refused(lambda: tokenizer.encode("a" * 40 + "b"), TokenizerError,
                names=[r"tokenizer\.json: the tokenizer's regexes failed", "retry-limit"])


def test_cli_refuses_a_backtracking_tokenizer_without_traceback(tmp_path):
    from lucidlm.weights.gguf import load_gguf
    from lucidlm.weights.hf import save_hf

    weights = {k: to_gguf_layout(k, v) for k, v in tiny_weights(1).items()}
    directory = Path(save_hf(load_gguf(write_llama_gguf(tmp_path / "tiny.gguf", weights, 1)), tmp_path / "hf"))
    spec = json.loads((directory / "tokenizer.json").read_text())
    spec["pre_tokenizer"] = {"type": "Split", "pattern": {"Regex": "(\\S+\\s*)+$"}, "behavior": "Isolated",
                             "invert": False}
    (directory / "tokenizer.json").write_text(json.dumps(spec))
    refused("generate", "--model", str(directory), "hi", "--max-new-tokens", "2",
            names=[r"hf/tokenizer\.json", r"backtracks exponentially"], watch=[tmp_path])
