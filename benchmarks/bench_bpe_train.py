"""Time BPE training on tinyshakespeare: lucidlm's trainer vs Hugging Face `tokenizers`.

Both learn a byte-level BPE of 4096 tokens (256 bytes + merges + <|endoftext|>) with
GPT-2's pre-split, on the same 1.1 MB text. The peer is the Rust BpeTrainer behind a
ByteLevel pre-tokenizer. Prints a table and writes benchmarks/results/bpe_train.json.

    python benchmarks/bench_bpe_train.py [--vocab-size 4096] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
try:
    from lucidlm.tokenizers import BPETokenizer
except ImportError:  # running from a checkout without `pip install -e .`
    sys.path.insert(0, str(ROOT / "src"))
    from lucidlm.tokenizers import BPETokenizer

CORPUS = ROOT.parent / "shared" / "data" / "tinyshakespeare.txt"
RESULTS = ROOT / "benchmarks" / "results" / "bpe_train.json"
ENDOFTEXT = "<|endoftext|>"


def train_lucidlm(text: str, vocab_size: int) -> tuple[float, int]:
    """Seconds to train, and number of tokens the result encodes the corpus to."""
    start = time.perf_counter()
    tok = BPETokenizer.train(text, vocab_size, special_tokens=(ENDOFTEXT,), progress=False)
    seconds = time.perf_counter() - start
    assert tok.vocab_size == vocab_size
    return seconds, len(tok.encode(text))


def train_hf(text: str, vocab_size: int) -> tuple[float, int]:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)  # GPT-2 regex
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,  # like ours: counts the 256 bytes and the special token
        special_tokens=[ENDOFTEXT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # Blocks of 1000 lines (newlines kept) let the Rust side count words in parallel.
    lines = text.splitlines(keepends=True)
    blocks = ["".join(lines[i : i + 1000]) for i in range(0, len(lines), 1000)]
    start = time.perf_counter()
    tok.train_from_iterator(blocks, trainer=trainer)
    seconds = time.perf_counter() - start
    assert tok.get_vocab_size() == vocab_size, tok.get_vocab_size()
    return seconds, len(tok.encode(text).ids)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    if not CORPUS.is_file():
        sys.exit(f"{CORPUS} not found: the shared assets live in ../shared beside the repo")
    text = CORPUS.read_text(encoding="utf-8")

    import tokenizers

    runs: dict[str, list[float]] = {"lucidlm": [], "hf_tokenizers": []}
    n_tokens: dict[str, int] = {}
    for _ in range(args.repeats):
        for name, fn in (("lucidlm", train_lucidlm), ("hf_tokenizers", train_hf)):
            seconds, n_tokens[name] = fn(text, args.vocab_size)
            runs[name].append(seconds)

    best = {name: min(times) for name, times in runs.items()}
    result = {
        "corpus": CORPUS.name,
        "corpus_bytes": len(text.encode("utf-8")),
        "vocab_size": args.vocab_size,
        "repeats": args.repeats,
        "lucidlm_s": round(best["lucidlm"], 3),
        "hf_tokenizers_s": round(best["hf_tokenizers"], 3),
        "ratio_lucidlm_over_hf": round(best["lucidlm"] / best["hf_tokenizers"], 2),
        "median_s": {k: round(statistics.median(v), 3) for k, v in runs.items()},
        "corpus_tokens": n_tokens,  # how well each vocabulary compresses the corpus
        "tokenizers_version": tokenizers.__version__,
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "machine": platform.machine(),
    }

    print(f"BPE training, {result['corpus']} ({result['corpus_bytes']:,} bytes) "
          f"-> vocab {args.vocab_size}, best of {args.repeats}, {os.cpu_count()} CPUs")
    print(f"{'trainer':<26}{'seconds':>10}{'corpus tokens':>16}")
    print(f"{'lucidlm (Python)':<26}{best['lucidlm']:>10.2f}{n_tokens['lucidlm']:>16,}")
    print(f"{'HF tokenizers (Rust)':<26}{best['hf_tokenizers']:>10.2f}"
          f"{n_tokens['hf_tokenizers']:>16,}")
    print(f"ratio lucidlm / HF: {result['ratio_lucidlm_over_hf']:.2f}x")

    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    print(f"wrote {RESULTS.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
