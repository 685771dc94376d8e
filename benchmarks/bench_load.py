"""Loading the embedded SmolLM2-135M-Instruct (Q4_1 GGUF, 98 MB, memory-mapped), side by side:
lucidlm's load paths vs llama.cpp on the same file (and, with --transformers, transformers
reading it), plus a fresh ``lucidlm generate`` to its first token.

Every measurement runs in a fresh process, the sides alternating round by round so that
load from other processes on a shared machine hits all of them alike:

- first load: ``lucidlm.load(...)`` once the imports are done (llama.cpp: model + a context of
  one sequence and its smallest cache, 256 cells: lucidlm's load sets up no cache at all);
- warm load: a second load in that same process (imports and page cache warm): issue 9's
  "warm load <= 0.3 s";
- peak RSS: the process's VmHWM after loading (and nothing else), issue 9's "<= 300 MB in
  int4"; ``import torch`` alone is the floor every lucidlm path stands on;
- first token: wall time to the token on stdout, wall time to the exit, and peak RSS of
  ``python -m lucidlm generate Hi --max-new-tokens 1 -q`` (llama.cpp: ``llama_peer.py
  --first-token``), issue 9's "<= 1.5 s".

Prints a table of medians with the load average, and writes benchmarks/results/load.json.

    python benchmarks/bench_load.py [--rounds 3] [--threads 2] [--transformers] [--before OLD_SRC]
                                    [--runtime-python VENV/bin/python]

``--before`` measures another source tree in the same run (same machine state), e.g.
``git worktree add /tmp/old 1dfb9c3 && python benchmarks/bench_load.py --before /tmp/old/src``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from llama_peer import peer_gguf
from timing import machine, run_record

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "load.json"

PEAK = """
def peak_mb():
    status = dict(line.split(":", 1) for line in open("/proc/self/status"))
    return int(status["VmHWM"].split()[0]) / 1024
"""
LUCIDLM = PEAK + """
import json, sys, time
import torch
torch.set_num_threads({threads})
import lucidlm, lucidlm.loading, lucidlm.language_model  # imports first: they are not the load
kwargs = {kwargs}
t = time.perf_counter(); model = lucidlm.load(**kwargs); first = time.perf_counter() - t
peak = peak_mb()
assert model.tokenizer.encode("Hi") and model.config.n_layers == 30
del model
t = time.perf_counter(); model = lucidlm.load(**kwargs); warm = time.perf_counter() - t
print(json.dumps({{"first_s": first, "warm_s": warm, "peak_mb": peak}}))
"""
LLAMA = PEAK + """
import json, sys, time
sys.path.insert(0, {bench!r})
import llama_cpp
from llama_peer import open_model
t = time.perf_counter(); lc, model, ctx, _ = open_model({gguf!r}, {threads}, n_seq=1, n_ctx=256); first = time.perf_counter() - t
peak = peak_mb()
lc.llama_free(ctx); lc.llama_model_free(model)
t = time.perf_counter(); lc, model, ctx, _ = open_model({gguf!r}, {threads}, n_seq=1, n_ctx=256); warm = time.perf_counter() - t
print(json.dumps({{"first_s": first, "warm_s": warm, "peak_mb": peak}}))
"""
TRANSFORMERS = PEAK + """
import json, time, warnings
import torch
from transformers import AutoModelForCausalLM
from lucidlm.pretrained import find_gguf
path = find_gguf("smollm2-135m")
def load():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
t = time.perf_counter(); model = load(); first = time.perf_counter() - t
peak = peak_mb()
del model
t = time.perf_counter(); model = load(); warm = time.perf_counter() - t
print(json.dumps({"first_s": first, "warm_s": warm, "peak_mb": peak}))
"""
IMPORT_TORCH = PEAK + """
import json, time
t = time.perf_counter(); import torch; s = time.perf_counter() - t
print(json.dumps({"first_s": s, "peak_mb": peak_mb()}))
"""

LOADS = {
    "lucidlm default": {},  # DEFAULT_LOAD: the Q4_1 layers as int4, the Q8_0 embedding as bfloat16
    "lucidlm bf16": {"dtype": "bfloat16"},
    "lucidlm float32": {"dtype": "float32"},
    "lucidlm int4": {"quantize": "int4"},
    "lucidlm gguf (Q4_1 kept)": {"quantize": "gguf"},
}


def run_json(command: list[str], env: dict[str, str]) -> dict:
    out = subprocess.run(command, env=env, check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def first_token(command: list[str], env: dict[str, str]) -> dict:
    """Wall time to the first byte the process writes to stdout (the token: the commands are
    quiet otherwise; the exit when they write nothing), wall time to its exit, and its peak RSS
    (the child's own ru_maxrss, via wait4) of one fresh process."""
    with tempfile.TemporaryFile() as sink:
        start = time.perf_counter()
        proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=sink)
        proc.stdout.read(1)  # blocks until the token (or the exit)
        output_s = time.perf_counter() - start
        proc.stdout.read()  # the rest, so the child never blocks on a full pipe
        _, status, usage = os.wait4(proc.pid, 0)
        seconds = time.perf_counter() - start
        if status != 0:
            sink.seek(0)
            raise RuntimeError(f"{command} failed: {sink.read().decode(errors='replace')[-2000:]}")
    return {"output_s": output_s, "wall_s": seconds, "peak_mb": usage.ru_maxrss / 1024}  # Linux: KiB


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--transformers", action="store_true", help="also transformers reading the GGUF (~15 s each)")
    parser.add_argument("--before", metavar="SRC", default=None,
                        help="another lucidlm source tree (e.g. a worktree of an older commit) measured in the same "
                             "run, rows marked 'before'")
    parser.add_argument("--runtime-python", metavar="PY", default=None,
                        help="an interpreter with lucidlm's runtime dependencies only, as the README's main command "
                             "installs them (e.g. a venv set up by PYTHON=venv/bin/python bash scripts/install.sh): "
                             "the first-token rows again under it, marked 'runtime install'")
    args = parser.parse_args()
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "HF_HUB_OFFLINE": "1", "TQDM_DISABLE": "1",
           "OMP_NUM_THREADS": str(args.threads)}
    # as on a user's machine, the children keep lucidlm's compiled bytecode between runs: this
    # project's machines set PYTHONDONTWRITEBYTECODE=1, which has every fresh process compile
    # lucidlm's ~150 modules from source again (~0.15 s of a fresh generate)
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    env["PYTHONUNBUFFERED"] = "1"  # a token printed into the pipe arrives when printed, not at the exit
    py = sys.executable
    sides: dict[str, list[str]] = {name: [py, "-c", LUCIDLM.format(threads=args.threads, kwargs=kwargs)]
                                   for name, kwargs in LOADS.items()}
    envs = {name: env for name in sides}
    if args.before:
        old_env = {**env, "PYTHONPATH": str(Path(args.before).resolve())}
        for name, kwargs in LOADS.items():
            sides[f"{name}, before"] = [py, "-c", LUCIDLM.format(threads=args.threads, kwargs=kwargs)]
            envs[f"{name}, before"] = old_env
    try:
        import llama_cpp  # noqa: F401 - a peer, built by setup_peers.sh
        # the path found here: lucidlm's lookup imports torch, which llama.cpp's process must not count
        sides["llama.cpp (same file)"] = [py, "-c", LLAMA.format(bench=str(ROOT / "benchmarks"), threads=args.threads,
                                                                 gguf=peer_gguf())]
    except ImportError:
        print("llama-cpp-python is not installed (benchmarks/setup_peers.sh): no llama.cpp row")
    if args.transformers:
        sides["transformers (GGUF, fp32)"] = [py, "-c", TRANSFORMERS]
    sides["import torch alone"] = [py, "-c", IMPORT_TORCH]
    tokens = {
        "lucidlm generate (default)": [py, "-m", "lucidlm", "generate", "Hi", "--max-new-tokens", "1", "-q"],
        "lucidlm generate --quantize int4": [py, "-m", "lucidlm", "generate", "Hi", "--max-new-tokens", "1", "-q",
                                             "--quantize", "int4"],
        "python -c 'import torch'": [py, "-c", "import torch"],
    }
    token_envs = {name: env for name in tokens}
    if args.before:
        for name in ("lucidlm generate (default)", "lucidlm generate --quantize int4"):
            tokens[f"{name}, before"] = tokens[name]
            token_envs[f"{name}, before"] = old_env
    if args.runtime_python:  # this machine's test oracles (and what they pull into import torch) left out
        for name in ("lucidlm generate (default)", "python -c 'import torch'"):
            tokens[f"{name}, runtime install"] = [args.runtime_python, *tokens[name][1:]]
    if "llama.cpp (same file)" in sides:
        tokens["llama.cpp first token"] = [py, str(ROOT / "benchmarks" / "llama_peer.py"), "--first-token",
                                           str(args.threads), peer_gguf()]

    load_before = os.getloadavg()
    for name, command in sides.items():  # warm the page cache once
        subprocess.run(command, env=envs.get(name, env), capture_output=True)
    for name, command in tokens.items():
        subprocess.run(command, env=token_envs.get(name, env), capture_output=True)
    loads: dict[str, list[dict]] = {name: [] for name in sides}
    starts: dict[str, list[dict]] = {name: [] for name in tokens}
    for _ in range(args.rounds):
        for name, command in sides.items():
            loads[name].append(run_json(command, envs.get(name, env)))
        for name, command in tokens.items():
            starts[name].append(first_token(command, token_envs.get(name, env)))
    load_after = os.getloadavg()

    def median(rows: list[dict], key: str) -> float | None:
        values = [r[key] for r in rows if key in r]
        return statistics.median(values) if values else None

    summary = {"load": {name: {k: median(rows, k) for k in ("first_s", "warm_s", "peak_mb")}
                        for name, rows in loads.items()},
               "first_token": {name: {k: median(rows, k) for k in ("output_s", "wall_s", "peak_mb")}
                               for name, rows in starts.items()}}
    print(f"load average {load_before[0]:.1f} before, {load_after[0]:.1f} after; medians of {args.rounds}")
    print(f"{'load':44s} {'first s':>8s} {'warm s':>8s} {'peak RSS MB':>12s}")
    for name, row in summary["load"].items():
        cells = [f"{row[k]:8.3f}" if row[k] is not None else f"{'':8s}" for k in ("first_s", "warm_s")]
        print(f"{name:44s} {cells[0]} {cells[1]} {row['peak_mb']:12.0f}")
    print(f"{'fresh process to first token':44s} {'token s':>8s} {'exit s':>8s} {'peak RSS MB':>12s}")
    for name, row in summary["first_token"].items():
        print(f"{name:44s} {row['output_s']:8.2f} {row['wall_s']:8.2f} {row['peak_mb']:12.0f}")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({
        "benchmark": "load the embedded smollm2-135m (Q4_1 GGUF) and a fresh generate to its first token",
        "run": run_record(),
        "machine": machine(threads=args.threads, load_average_before=load_before, load_average_after=load_after),
        "rounds": args.rounds, "before": args.before, "runtime_python": args.runtime_python, "medians": summary,
        "runs": {"load": loads, "first_token": starts},
    }, indent=2) + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
