"""How fast ``lucidlm --help`` / ``--version`` answer, beside what torch alone costs to import.

Each command runs in a fresh Python process (as a user types it); the table shows the
median wall time of each, and each one's ratio to ``python -c "import torch"`` (what the
CLI paid before it stopped importing torch for help). Writes benchmarks/results/cli_start.json.

    python benchmarks/bench_cli_start.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "cli_start.json"
CASES = {
    "python -c pass": [sys.executable, "-c", "pass"],
    "python -c 'import torch'": [sys.executable, "-c", "import torch"],
    "lucidlm --help": [sys.executable, "-m", "lucidlm", "--help"],
    "lucidlm --version": [sys.executable, "-m", "lucidlm", "--version"],
    "lucidlm generate --help": [sys.executable, "-m", "lucidlm", "generate", "--help"],
}


def wall_time(command: list[str], env: dict[str, str]) -> float:
    start = time.perf_counter()
    subprocess.run(command, check=True, capture_output=True, env=env)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    for command in CASES.values():  # warm the page cache once
        wall_time(command, env)
    seconds = {name: statistics.median(wall_time(cmd, env) for _ in range(args.repeats)) for name, cmd in CASES.items()}
    torch_import = seconds["python -c 'import torch'"]
    print(f"{'command':<28} {'median s':>9} {'vs import torch':>16}")
    for name, value in seconds.items():
        print(f"{name:<28} {value:>9.3f} {value / torch_import:>15.2f}x")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"seconds_median": seconds, "ratio_to_import_torch":
                                   {k: v / torch_import for k, v in seconds.items()},
                                   "repeats": args.repeats, "python": platform.python_version(),
                                   "machine": platform.machine(), "cpus": os.cpu_count()}, indent=2) + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
