"""Generation on CPU, side by side: lucidlm (fp32, bf16, int8, int4, the GGUF's own quants)
vs transformers (fp32) and llama.cpp (llama-cpp-python built from its sdist by
``benchmarks/setup_peers.sh``), all on the embedded SmolLM2-135M-Instruct Q4_1 GGUF file, with
the same token ids and the same number of threads.

Each side runs in its own subprocess: once to warm the page cache, then ``--rounds`` times,
alternating the sides so that load from other processes on a shared machine hits all of them
alike; each metric keeps its best round. Peak RSS is measured in a separate, light subprocess
per side (load + 16 greedy tokens), so the bigger buffers of prefill 512 and batch 8 do not
count. "fresh first token" is the wall time of a new process that loads the model and prints
one generated token (``python -m lucidlm generate`` for lucidlm's default).

The "compiled" sides call ``model.compile()`` (what ``--compile`` does): their child first
runs one short generation at each shape it will time (batch 1, batch 8, prefill 512) and
reports that time as "compile warm-up" (what a user's first answers cost); the timed runs
come after. Their light and fresh-process runs would only time the compiler again, so RSS is
that child's peak (compiler included) and fresh first token is not measured.

    python benchmarks/bench_generation.py [--threads 2] [--rounds 2] [--sides ...] [--metrics ...]
                                          [--budget-min 45]

Metrics: load (in-process, warm page cache), prefill 512 tokens (one forward pass filling the
KV cache), decode at batch 1 (16-token prompt, 64 greedy tokens, prefill included) and the
aggregate at batch 8 (8 prompts of 16 tokens, 32 greedy tokens each), peak RSS, fresh first
token. ``--metrics`` keeps a subset (the others are skipped, not run). A round that would end
past ``--budget-min`` (judged by the previous round's duration) is not started, so a run on
a slow, shared machine ends in bounded time with at least one full round.
Prints a table and writes benchmarks/results/generation.json.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

from llama_peer import peer_gguf
from timing import best_time, machine, run_record

RESULTS = Path(__file__).resolve().parent / "results" / "generation.json"
SIDES = {
    "lucidlm default": {"kind": "ours"},  # lucidlm.load()'s: the file's Q4_1 and Q8_0, lucidlm's kernels (DEFAULT_LOAD)
    # the default until 2026-11-25: Q4_1 layers through torch's int4 kernel, the Q8_0 table as bf16
    "lucidlm previous default": {"kind": "ours", "quantize": "gguf", "dtype": "bfloat16", "float_embeddings": True,
                                 "env": {"LUCIDLM_CPU_KERNEL": "torch"}},
    "lucidlm default compiled": {"kind": "ours", "compile": True},
    # the default's layers with the bfloat16 residual stream it had until 2026-11-26
    "lucidlm default, bf16 stream": {"kind": "ours", "quantize": "gguf", "dtype": "bfloat16"},
    # requantized int4 everywhere through torch's tiles, compiled: the fastest batch-1 path before lucidlm's kernels
    "lucidlm int4 compiled, torch kernel": {"kind": "ours", "quantize": "int4", "compile": True,
                                            "env": {"LUCIDLM_CPU_KERNEL": "torch"}},
    "lucidlm fp32": {"kind": "ours", "dtype": "float32"},
    "lucidlm bf16": {"kind": "ours", "dtype": "bfloat16"},
    "lucidlm int8": {"kind": "ours", "quantize": "int8"},
    "lucidlm int4": {"kind": "ours", "quantize": "int4"},
    "lucidlm gguf": {"kind": "ours", "quantize": "gguf"},  # the file's own quants (Q4_1 + Q8_0 embedding)
    "lucidlm bf16 compiled": {"kind": "ours", "dtype": "bfloat16", "compile": True},
    "lucidlm int4 compiled": {"kind": "ours", "quantize": "int4", "compile": True},
    "lucidlm gguf compiled": {"kind": "ours", "quantize": "gguf", "compile": True},
    "transformers fp32": {"kind": "hf"},
    "llama.cpp Q4_1": {"kind": "llama"},
}
PREFILL, PROMPT, NEW1, BATCH, NEW8 = 512, 16, 64, 8, 32
# Not run by default: compiled bf16 decodes within noise of eager bf16, compiled gguf no faster
# than eager (README), and each costs minutes of compiling on 2 cores; name them in --sides.
OPTIONAL = ("lucidlm bf16 compiled", "lucidlm gguf compiled", "lucidlm default compiled", "lucidlm default, bf16 stream",
            "lucidlm int4 compiled, torch kernel")
METRICS = ("load", "first_token", "prefill512", "decode1", "decode8", "rss")


def prompt_ids(n: int, seed: int = 0, vocab: int = 49152) -> list[int]:
    import random
    rng = random.Random(n * 1000 + seed)
    return [rng.randrange(100, vocab) for _ in range(n)]


# ------------------------------------------------------------------------------------ sides


def load_ours(spec: dict):
    import torch

    import lucidlm
    dtype = getattr(torch, spec["dtype"]) if "dtype" in spec else None
    return lucidlm.load("smollm2-135m", dtype=dtype, quantize=spec.get("quantize"), compile=spec.get("compile", False),
                        quantize_embeddings=not spec.get("float_embeddings", False))


def run_ours(spec: dict, repeats: int, light: bool, metrics: tuple[str, ...] = METRICS) -> dict:
    import torch

    from lucidlm.generation import DecodeSession, generate, generate_batch

    start = time.perf_counter()
    model = load_ours(spec)
    out = {"load_s": time.perf_counter() - start}
    ids16 = prompt_ids(PROMPT)
    if light:
        generate(model, ids16, max_new_tokens=16, temperature=0, stop_on_eos=False)
        return out
    long_ids = prompt_ids(PREFILL)
    prompts = [prompt_ids(PROMPT, seed=i) for i in range(BATCH)]

    def prefill() -> None:  # the prompt pass generation runs (compiled on a compiled side)
        with DecodeSession(model, [long_ids], capacity=PREFILL + 1) as session:
            session.prefill()

    def decode() -> None:
        result = generate(model, ids16, max_new_tokens=NEW1, temperature=0, stop_on_eos=False)
        assert len(result.token_ids) == NEW1

    def batch() -> None:
        results = generate_batch(model, prompts, max_new_tokens=NEW8, temperature=0, stop_on_eos=False)
        assert all(len(r.token_ids) == NEW8 for r in results)

    # First calls: the compiler's warm-up on a compiled side, at the very lengths timed below (a
    # compiled model's cache length is prompt + new tokens rounded up to a power of two, and
    # each length is its own decode graph: 8 new tokens would warm a 64-slot step, not 128).
    start = time.perf_counter()
    decode()
    if "decode8" in metrics:
        batch()
    if "prefill512" in metrics:
        prefill()
    if spec.get("compile"):
        out["compile_s"] = time.perf_counter() - start
    if "prefill512" in metrics:
        out["prefill512_tok_s"] = PREFILL / best_time(prefill, repeats)
    if "decode1" in metrics:
        out["decode1_tok_s"] = NEW1 / best_time(decode, repeats)
    if "decode8" in metrics:
        out["decode8_tok_s"] = BATCH * NEW8 / best_time(batch, repeats)
    return out


def run_hf(spec: dict, repeats: int, light: bool, metrics: tuple[str, ...] = METRICS) -> dict:
    import torch
    import transformers

    from lucidlm.pretrained import find_gguf

    path = find_gguf("smollm2-135m")
    transformers.logging.set_verbosity_error()
    start = time.perf_counter()
    model = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                              dtype=torch.float32).eval()
    out = {"load_s": time.perf_counter() - start}

    def gen(ids: torch.Tensor, new: int) -> None:
        seq = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                             do_sample=False, pad_token_id=2)
        assert seq.shape[1] - ids.shape[1] == new
    with torch.inference_mode():
        ids16 = torch.tensor([prompt_ids(PROMPT)])
        if light:
            gen(ids16, 16)
            return out
        if "prefill512" in metrics:
            ids = torch.tensor([prompt_ids(PREFILL)])
            model(ids, use_cache=True, logits_to_keep=1)
            out["prefill512_tok_s"] = PREFILL / best_time(lambda: model(ids, use_cache=True, logits_to_keep=1),
                                                          repeats)
        if "decode1" in metrics:
            gen(ids16, 8)
            out["decode1_tok_s"] = NEW1 / best_time(lambda: gen(ids16, NEW1), repeats)
        if "decode8" in metrics:
            batch = torch.tensor([prompt_ids(PROMPT, seed=i) for i in range(BATCH)])
            gen(batch, 4)
            out["decode8_tok_s"] = BATCH * NEW8 / best_time(lambda: gen(batch, NEW8), repeats)
    return out


def child(side: str, threads: int, repeats: int, light: bool, metrics: tuple[str, ...], gguf: str | None) -> None:
    spec = SIDES[side]
    if spec["kind"] == "llama":  # gguf: the path, found by the parent (lucidlm's lookup imports torch)
        from llama_peer import run_llama_cpp
        out = run_llama_cpp(gguf, threads, repeats, light, PREFILL, PROMPT, NEW1, BATCH, NEW8, prompt_ids, metrics)
    else:
        import torch
        torch.set_num_threads(threads)
        run = run_hf if spec["kind"] == "hf" else run_ours
        out = run(spec, repeats, light, metrics)
        out["threads"] = torch.get_num_threads()
    out["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB
    print("RESULT " + json.dumps(out))


def spawn(side: str, threads: int, repeats: int, light: bool = False, metrics: tuple[str, ...] = METRICS) -> dict:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               OMP_NUM_THREADS=str(threads), **SIDES[side].get("env", {}))
    cmd = [sys.executable, __file__, "--child", side, "--threads", str(threads), "--repeats", str(repeats),
           "--metrics", *metrics]
    if SIDES[side]["kind"] == "llama":
        cmd += ["--gguf", peer_gguf()]
    proc = subprocess.run(cmd + (["--light"] if light else []), capture_output=True, text=True, env=env)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"{side} benchmark failed:\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def fresh_first_token(side: str, threads: int) -> float:
    """Wall time of a new process that loads the model and generates one token."""
    spec = SIDES[side]
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS=str(threads),
               **spec.get("env", {}))
    # as bench_load.py: keep lucidlm's bytecode between runs, as a user's install does. This project's
    # machines set PYTHONDONTWRITEBYTECODE=1, so a tree without __pycache__ compiled lucidlm's ~115
    # modules in every fresh process (~0.1 s), while llama_cpp's came precompiled from pip
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    if spec["kind"] == "llama":
        cmd = [sys.executable, str(Path(__file__).with_name("llama_peer.py")), "--first-token", str(threads), peer_gguf()]
    else:
        cmd = [sys.executable, "-m", "lucidlm", "generate", "The capital of France is", "--max-new-tokens", "1",
               "--temperature", "0"]
        if "dtype" in spec:
            cmd += ["--dtype", spec["dtype"]]
        if "quantize" in spec:
            cmd += ["--quantize", spec["quantize"]]
    start = time.perf_counter()
    subprocess.run(cmd, check=True, capture_output=True, env=env)
    return time.perf_counter() - start


def lower_is_better(key: str) -> bool:
    """Seconds and megabytes: less is better; tokens per second (``*_tok_s``): more is."""
    return key.endswith(("_s", "_mb")) and not key.endswith("_tok_s")


def best_of(runs: list[dict]) -> dict:
    best = dict(runs[0])
    for key in best:
        values = [r[key] for r in runs if key in r]
        best[key] = min(values) if lower_is_better(key) else max(values)
    return best


ROWS = [("load, warm (s)", "load_s"), ("compile warm-up (s)", "compile_s"), ("fresh first token (s)", "first_token_s"),
        ("prefill 512 (tok/s)", "prefill512_tok_s"), ("decode b=1 (tok/s)", "decode1_tok_s"),
        ("decode b=8 aggr. (tok/s)", "decode8_tok_s"), ("peak RSS, b=1 (MB)", "rss_mb")]


def table(sides: list[str], rows: list[tuple[str, str]], values: dict[str, dict[str, float]], fmt: str) -> str:
    """One line per side, one column per metric (side names are too long for columns)."""
    width = max(len(s) for s in sides) + 2
    lines = [" " * width + "".join(f"{label:>{max(len(label), 9) + 2}}" for label, _ in rows)]
    for side in sides:
        cells = [fmt.format(values[side][key]) if key in values[side] else "-" for _, key in rows]
        lines.append(f"{side:<{width}}" + "".join(f"{c:>{max(len(label), 9) + 2}}" for c, (label, _) in zip(cells, rows)))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2, help="threads for every side")
    parser.add_argument("--repeats", type=int, default=2, help="timed repeats per measurement (best is kept)")
    parser.add_argument("--rounds", type=int, default=2, help="alternating runs of all sides (best is kept)")
    parser.add_argument("--sides", nargs="+", choices=list(SIDES), default=[s for s in SIDES if s not in OPTIONAL])
    parser.add_argument("--metrics", nargs="+", choices=METRICS, default=list(METRICS),
                        help="measure only these (default: all)")
    parser.add_argument("--budget-min", type=float, default=45.0,
                        help="start no round that would end later than this many minutes after the start")
    parser.add_argument("--child", choices=list(SIDES), help=argparse.SUPPRESS)
    parser.add_argument("--light", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--gguf", help=argparse.SUPPRESS)
    args = parser.parse_args()
    metrics = tuple(args.metrics)
    if args.child:
        child(args.child, args.threads, args.repeats, args.light, metrics, args.gguf)
        return

    began = time.perf_counter()
    sides = args.sides
    light = {side: "rss" in metrics and not SIDES[side].get("compile") for side in sides}
    for side in sides:
        if light[side]:
            spawn(side, args.threads, 1, light=True, metrics=metrics)  # warm the page cache
    runs: dict[str, list[dict]] = {side: [] for side in sides}
    loads = []
    round_s = 0.0
    for _ in range(args.rounds):
        if runs[sides[0]] and time.perf_counter() - began + round_s > 60 * args.budget_min:
            print(f"stopping after {len(runs[sides[0]])} round(s): another would pass --budget-min {args.budget_min}")
            break
        round_start = time.perf_counter()
        for side in sides:
            loads.append(os.getloadavg()[0])
            run = spawn(side, args.threads, args.repeats, metrics=metrics)
            if light[side]:
                run["rss_mb"] = spawn(side, args.threads, 1, light=True, metrics=metrics)["peak_rss_mb"]
            elif "rss" in metrics:
                run["rss_mb"] = run["peak_rss_mb"]  # compiled: the timed child's peak, compiler included
            if "first_token" in metrics and SIDES[side]["kind"] != "hf" and not SIDES[side].get("compile"):
                run["first_token_s"] = fresh_first_token(side, args.threads)
            runs[side].append(run)
            print(f"  {side}: " + ", ".join(f"{k} {v:.2f}" for k, v in run.items() if isinstance(v, float)),
                  flush=True)
        round_s = time.perf_counter() - round_start
    rounds = len(runs[sides[0]])
    results = {side: best_of(side_runs) for side, side_runs in runs.items()}
    peer = "llama.cpp Q4_1" if "llama.cpp Q4_1" in results else sides[-1]
    rows = [(label, key) for label, key in ROWS if any(key in r for r in results.values())]
    print(f"\nSmolLM2-135M-Instruct (Q4_1 GGUF), CPU, {args.threads} threads, {rounds} alternating rounds "
          f"({(time.perf_counter() - began) / 60:.0f} min); load average during the run "
          f"{min(loads):.1f}..{max(loads):.1f}")
    print(table(sides, rows, results, "{:.2f}"))
    ratios: dict[str, dict[str, float]] = {}
    for side in sides:
        ratios[side] = {}
        for _, key in rows:
            ours, theirs = results[side].get(key), results[peer].get(key)
            if ours and theirs:
                ratios[side][key] = theirs / ours if lower_is_better(key) else ours / theirs
    print(f"\nratio to {peer} (> 1 = better than {peer})")
    print(table(sides, rows, ratios, "{:.2f}x"))
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    import torch
    versions = {"torch": torch.__version__}
    for package in ("transformers", "llama_cpp"):
        try:
            versions[package] = __import__(package).__version__
        except ImportError:
            pass
    RESULTS.write_text(json.dumps({
        "model": "SmolLM2-135M-Instruct, the embedded Q4_1 GGUF (token embedding Q8_0)",
        "run": run_record(),
        "machine": machine(load_average_min_max=[min(loads), max(loads)]),
        "versions": versions,
        "settings": {"threads": args.threads, "rounds": rounds, "metrics": list(metrics), "repeats": args.repeats, "prefill": PREFILL,
                     "decode_prompt": PROMPT, "decode_new_b1": NEW1, "batch": BATCH, "decode_new_b8": NEW8},
        "results": results, f"ratios_to_{peer}": ratios,
        "runs": runs,  # every round of every side, in the order run: the paired ratios come from these
    }, indent=2) + "\n")
    print(f"\nwrote {RESULTS}")


if __name__ == "__main__":
    main()
