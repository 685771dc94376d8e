"""Time loading the embedded SmolLM2-135M-Instruct: lucidlm (cold: GGUF -> dequantize -> cache;
warm: from the safetensors cache) vs transformers reading the same GGUF file.

Each measurement runs in a fresh Python process (imports included, as a user sees it), with
the cache in a temporary LUCIDLM_CACHE so the cold run is really cold. Prints a table and
writes benchmarks/results/load.json.

    python benchmarks/bench_load.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "load.json"

LUCIDLM = """
import time; t = time.perf_counter()
import lucidlm
model = lucidlm.load("smollm2-135m")
assert model.tokenizer.encode("Hi") and model.config.n_layers == 30
print(time.perf_counter() - t)
"""
TRANSFORMERS = """
import time, warnings; t = time.perf_counter()
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from lucidlm.pretrained import find_gguf
path = find_gguf("smollm2-135m")
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
print(time.perf_counter() - t)
"""


def timed(script: str, env: dict[str, str]) -> float:
    out = subprocess.run([sys.executable, "-c", script], env=env, check=True, capture_output=True, text=True)
    return float(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    rows = {"lucidlm cold (convert + cache)": [], "lucidlm warm (cache)": [], "transformers (GGUF)": []}
    for _ in range(args.repeats):
        with tempfile.TemporaryDirectory() as cache:
            env = {**os.environ, "LUCIDLM_CACHE": cache, "HF_HUB_OFFLINE": "1", "TQDM_DISABLE": "1"}
            rows["lucidlm cold (convert + cache)"].append(timed(LUCIDLM, env))
            rows["lucidlm warm (cache)"].append(timed(LUCIDLM, env))
        rows["transformers (GGUF)"].append(timed(TRANSFORMERS, env))
    print(f"{'loader':34s} {'median s':>9s} {'min s':>7s}")
    for name, times in rows.items():
        print(f"{name:34s} {statistics.median(times):9.2f} {min(times):7.2f}")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({
        "benchmark": "load smollm2-135m (fresh process, imports included)",
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                    "load_average": os.getloadavg()},
        "seconds": rows,
    }, indent=2) + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
