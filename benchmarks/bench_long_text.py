"""A long text through the embedded SmolLM2's tokenizer: lucidlm's pieces (``tokenizers/long_text.py``)
against one call of the Hugging Face ``tokenizers`` backend over the whole text, what
``HFTokenizer.encode`` did before and what ``lucidlm perplexity`` and a training corpus go through.

Each run is a fresh process that builds the tokenizer from the GGUF file's metadata (no model),
reads the text (tinyshakespeare repeated to ``--mb`` megabytes) and encodes it once; it reports
the encode's seconds and the process's peak RSS, less its RSS just before the encode. The two
sides take turns, the order reversed every other round; both must give the same ids.

    python benchmarks/bench_long_text.py --mb 10 50 --rounds 2

Writes benchmarks/results/long_text.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from timing import machine, run_record

RESULTS = Path(__file__).resolve().parent / "results" / "long_text.json"
SIDES = {"tokenizers, one call": "whole", "lucidlm, in pieces": "pieces"}
CHILD = r"""
import hashlib, json, resource, sys, time
from lucidlm.pretrained import find_gguf
from lucidlm.tokenizers import long_text
from lucidlm.weights.gguf import open_gguf, read_metadata, tokenizer_from_metadata

mode, path = sys.argv[1], sys.argv[2]
tokenizer = tokenizer_from_metadata(read_metadata(open_gguf(find_gguf("smollm2-135m"))), "smollm2")
if mode == "whole":
    long_text.LONG_TEXT_CHARS = float("inf")
text = open(path, encoding="utf-8").read()
rss = lambda: int(open("/proc/self/status").read().split("VmRSS:")[1].split()[0]) / 1024
before = rss()
start = time.perf_counter()
ids = tokenizer.encode(text, allowed_special=False)
seconds = time.perf_counter() - start
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print(json.dumps({"seconds": seconds, "peak_mb": peak, "above_start_mb": peak - before, "tokens": len(ids),
                  "ids_sha256": hashlib.sha256(json.dumps(ids).encode()).hexdigest()}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=float, nargs="+", default=[10.0, 50.0], help="text sizes, megabytes")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    shakespeare = (Path(__file__).resolve().parents[2] / "shared" / "data" / "tinyshakespeare.txt").read_text("utf-8")
    results: dict[str, dict[str, dict[str, float]]] = {}
    runs: dict[str, dict[str, list[dict]]] = {}
    with tempfile.TemporaryDirectory() as work:
        for mb in args.mb:
            size = f"{mb:g} MB"
            text = (shakespeare * int(mb * 1e6 / len(shakespeare) + 1))[:int(mb * 1e6)]
            path = Path(work) / f"text_{mb:g}.txt"
            path.write_text(text, encoding="utf-8")
            runs[size] = {side: [] for side in SIDES}
            for round_ in range(args.rounds):
                order = list(SIDES) if round_ % 2 == 0 else list(SIDES)[::-1]
                for side in order:
                    out = subprocess.run([sys.executable, "-c", CHILD, SIDES[side], str(path)], check=True,
                                         capture_output=True, text=True)
                    runs[size][side].append(json.loads(out.stdout.strip().splitlines()[-1]))
                    print(f"{size:>7} round {round_ + 1} {side:22} {runs[size][side][-1]['seconds']:6.2f} s "
                          f"peak {runs[size][side][-1]['peak_mb']:7.0f} MB", flush=True)
            hashes = {r["ids_sha256"] for side in SIDES for r in runs[size][side]}
            assert len(hashes) == 1, f"{size}: the sides' ids differ"
            results[size] = {side: {key: statistics.median(r[key] for r in runs[size][side])
                                    for key in ("seconds", "peak_mb", "above_start_mb", "tokens")} for side in SIDES}
    record = {"benchmark": "encode a long text with the embedded SmolLM2's tokenizer (allowed_special=False)",
              "run": run_record(), "machine": machine(), "rounds": args.rounds, "medians": results, "runs": runs}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
    print(f"\n{'text':>7} | {'side':22} | seconds | peak RSS MB | above start MB")
    for size, sides in results.items():
        for side, r in sides.items():
            print(f"{size:>7} | {side:22} | {r['seconds']:7.2f} | {r['peak_mb']:11.0f} | {r['above_start_mb']:14.0f}")


if __name__ == "__main__":
    main()
