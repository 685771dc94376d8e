"""The one timing rule the in-process benchmarks share: the best of ``repeats`` runs (the
least disturbed by the rest of a shared machine); and what every results file says of the
machine it ran on."""

from __future__ import annotations

import os
import platform
import time
from typing import Any


def best_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def machine(**extra: Any) -> dict[str, Any]:
    """The machine a result was measured on: this project's hosts differ in kind (Intel Xeon
    with AVX-512 VNNI, AMD EPYC Zen 3 with AVX2 only, Zen 4 and Zen 5 with AVX-512), and
    lucidlm's kernels with them. The model name alone ("AMD EPYC") does not tell the EPYCs
    apart; the CPU family and model numbers do (family 25 is Zen 3 and Zen 4, 26 is Zen 5)."""
    from lucidlm.quantization import blocks_kernel

    return {"platform": platform.platform(), "cpu": blocks_kernel.cpu_model(), "cpu_family_model": _family_model(),
            "cpus": os.cpu_count(), "lucidlm_kernels": blocks_kernel.instruction_set() or "none (torch's)", **extra}


def run_record() -> dict[str, Any]:
    """When, from which commit and by which command a result was measured: what the README quotes
    beside each result ("2026-12-07, 03:34 UTC, at e84e165", the command line)."""
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    git = lambda *args: subprocess.run(["git", "-C", root, *args], capture_output=True, text=True).stdout.strip()  # noqa: E731
    return {"utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()), "commit": git("rev-parse", "--short", "HEAD"),
            "uncommitted_changes": bool(git("status", "--porcelain", "--untracked-files=no")),
            "command": ["python", *sys.argv]}


def _family_model() -> str:
    """"family/model" of the first CPU in /proc/cpuinfo, e.g. "26/2" ("" where it cannot be read)."""
    numbers = {}
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key in ("cpu family", "model") and key not in numbers:
                    numbers[key] = value.strip()
                if len(numbers) == 2:
                    break
    except OSError:
        return ""
    return f"{numbers.get('cpu family', '?')}/{numbers.get('model', '?')}"
