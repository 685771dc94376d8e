"""What the weight-integrity checks cost when loading the embedded SmolLM2-135M-Instruct, as a
share of the same run's whole load (in-process, best of --repeats, after one warm-up load):

- the NaN/inf check of every tensor (f16 block scales of the Q4_1/Q8_0 matrices, f32 norms);
- the SHA-256 of the 98 MB GGUF against pip's RECORD: paid on the first load (no stamp yet)
  and whenever the file's stat changed;
- the stamp lookup that replaces the hash on every later load.

Prints a table and writes benchmarks/results/integrity.json.

    python benchmarks/bench_integrity.py [--repeats 7]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import tempfile
from pathlib import Path

from timing import best_time

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "integrity.json"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    os.environ["LUCIDLM_CACHE"] = tempfile.mkdtemp(prefix="lucidlm-bench-")  # a stamp of our own

    import lucidlm
    from lucidlm.pretrained import find_gguf, installed_gguf
    from lucidlm.weights.finite import FiniteCheck
    from lucidlm.weights.gguf import open_gguf
    from lucidlm.weights.gguf_quants import finite_parts
    from lucidlm.weights.integrity import sha256_file

    path, _ = installed_gguf("smollm2-135m")
    reader = open_gguf(path)

    def finite_check() -> None:
        check = FiniteCheck(path)
        for tensor in reader.tensors:
            check.add(tensor.name, *finite_parts(tensor))
        check.verify()

    find_gguf("smollm2-135m")  # the stamp (the GGUF is older than the 2 s racy window)
    lucidlm.load("smollm2-135m")  # warm-up: imports, page cache
    load = best_time(lambda: lucidlm.load("smollm2-135m"), max(3, args.repeats // 2))
    rows = {
        "whole load, default bf16 (checks included)": load,
        "NaN/inf check, all tensors": best_time(finite_check, args.repeats),
        "SHA-256 of the GGUF (first load)": best_time(lambda: sha256_file(path), args.repeats),
        "stamp lookup (every later load)": best_time(lambda: find_gguf("smollm2-135m"), args.repeats),
    }
    print(f"{'step':44s} {'ms':>9s} {'% of load':>10s}")
    for name, seconds in rows.items():
        print(f"{name:44s} {seconds * 1000:9.2f} {100 * seconds / load:9.1f}%")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({
        "benchmark": "integrity checks while loading smollm2-135m (in-process, best of N)",
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "load_average": os.getloadavg()},
        "seconds": rows, "share_of_load": {k: v / load for k, v in rows.items()},
    }, indent=2) + "\n")
    print(f"wrote {RESULTS}")
    shutil.rmtree(os.environ["LUCIDLM_CACHE"], ignore_errors=True)


if __name__ == "__main__":
    main()
