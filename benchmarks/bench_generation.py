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

    python benchmarks/bench_generation.py [--threads 2] [--rounds 2] [--sides ...]

Metrics: load (in-process, warm page cache), prefill 512 tokens (one forward pass filling the
KV cache), decode at batch 1 (16-token prompt, 64 greedy tokens, prefill included) and the
aggregate at batch 8 (8 prompts of 16 tokens, 32 greedy tokens each), peak RSS.
Prints a table and writes benchmarks/results/generation.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

from timing import best_time

RESULTS = Path(__file__).resolve().parent / "results" / "generation.json"
SIDES = {
    "lucidlm fp32": {"kind": "ours", "dtype": "float32"},
    "lucidlm bf16": {"kind": "ours", "dtype": "bfloat16"},
    "lucidlm int8": {"kind": "ours", "quantize": "int8"},
    "lucidlm int4": {"kind": "ours", "quantize": "int4"},
    "lucidlm gguf": {"kind": "ours", "quantize": "gguf"},  # the file's own quants (Q4_1 + Q8_0 embedding)
    "transformers fp32": {"kind": "hf"},
    "llama.cpp Q4_1": {"kind": "llama"},
}
PREFILL, PROMPT, NEW1, BATCH, NEW8 = 512, 16, 64, 8, 32


def prompt_ids(n: int, seed: int = 0, vocab: int = 49152) -> list[int]:
    import random
    rng = random.Random(n * 1000 + seed)
    return [rng.randrange(100, vocab) for _ in range(n)]


# ------------------------------------------------------------------------------------ sides


def load_ours(spec: dict):
    import torch

    import lucidlm
    dtype = getattr(torch, spec["dtype"]) if "dtype" in spec else None
    return lucidlm.load("smollm2-135m", dtype=dtype, quantize=spec.get("quantize"))


def run_ours(spec: dict, repeats: int, light: bool) -> dict:
    import torch

    from lucidlm.generation import generate, generate_batch

    start = time.perf_counter()
    model = load_ours(spec)
    out = {"load_s": time.perf_counter() - start}
    ids16 = prompt_ids(PROMPT)
    if light:
        generate(model, ids16, max_new_tokens=16, temperature=0, stop_on_eos=False)
        return out
    with torch.inference_mode():
        ids = torch.tensor([prompt_ids(PREFILL)])

        def prefill() -> None:
            model.setup_kv_cache(1, max_seq_len=PREFILL + 1)
            model(ids, input_pos=torch.arange(PREFILL), last_token_only=True)
            model.clear_kv_cache()
        prefill()
        out["prefill512_tok_s"] = PREFILL / best_time(prefill, repeats)

    def decode() -> None:
        result = generate(model, ids16, max_new_tokens=NEW1, temperature=0, stop_on_eos=False)
        assert len(result.token_ids) == NEW1
    generate(model, ids16, max_new_tokens=8, temperature=0)
    out["decode1_tok_s"] = NEW1 / best_time(decode, repeats)
    prompts = [prompt_ids(PROMPT, seed=i) for i in range(BATCH)]

    def batch() -> None:
        results = generate_batch(model, prompts, max_new_tokens=NEW8, temperature=0, stop_on_eos=False)
        assert all(len(r.token_ids) == NEW8 for r in results)
    generate_batch(model, prompts, max_new_tokens=4, temperature=0, stop_on_eos=False)
    out["decode8_tok_s"] = BATCH * NEW8 / best_time(batch, repeats)
    return out


def run_hf(spec: dict, repeats: int, light: bool) -> dict:
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
        ids = torch.tensor([prompt_ids(PREFILL)])
        model(ids, use_cache=True, logits_to_keep=1)
        out["prefill512_tok_s"] = PREFILL / best_time(lambda: model(ids, use_cache=True, logits_to_keep=1), repeats)
        gen(ids16, 8)
        out["decode1_tok_s"] = NEW1 / best_time(lambda: gen(ids16, NEW1), repeats)
        batch = torch.tensor([prompt_ids(PROMPT, seed=i) for i in range(BATCH)])
        gen(batch, 4)
        out["decode8_tok_s"] = BATCH * NEW8 / best_time(lambda: gen(batch, NEW8), repeats)
    return out


def child(side: str, threads: int, repeats: int, light: bool) -> None:
    spec = SIDES[side]
    if spec["kind"] == "llama":
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from llama_peer import run_llama_cpp
        out = run_llama_cpp(threads, repeats, light, PREFILL, PROMPT, NEW1, BATCH, NEW8, prompt_ids)
    else:
        import torch
        torch.set_num_threads(threads)
        out = run_hf(spec, repeats, light) if spec["kind"] == "hf" else run_ours(spec, repeats, light)
        out["threads"] = torch.get_num_threads()
    out["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB
    print("RESULT " + json.dumps(out))


def spawn(side: str, threads: int, repeats: int, light: bool = False) -> dict:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               OMP_NUM_THREADS=str(threads))
    cmd = [sys.executable, __file__, "--child", side, "--threads", str(threads), "--repeats", str(repeats)]
    proc = subprocess.run(cmd + (["--light"] if light else []), capture_output=True, text=True, env=env)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"{side} benchmark failed:\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def fresh_first_token(side: str, threads: int) -> float:
    """Wall time of a new process that loads the model and generates one token."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS=str(threads))
    spec = SIDES[side]
    if spec["kind"] == "llama":
        cmd = [sys.executable, str(Path(__file__).with_name("llama_peer.py")), "--first-token", str(threads)]
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


def best_of(runs: list[dict]) -> dict:
    best = dict(runs[0])
    for key in best:
        values = [r[key] for r in runs if key in r]
        best[key] = min(values) if key.endswith(("_s", "_mb")) else max(values)
    return best


ROWS = [("load, warm (s)", "load_s"), ("fresh first token (s)", "first_token_s"),
        ("prefill 512 (tok/s)", "prefill512_tok_s"), ("decode b=1 (tok/s)", "decode1_tok_s"),
        ("decode b=8 aggr. (tok/s)", "decode8_tok_s"), ("peak RSS, b=1 (MB)", "rss_mb")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2, help="threads for every side")
    parser.add_argument("--repeats", type=int, default=2, help="timed repeats per measurement (best is kept)")
    parser.add_argument("--rounds", type=int, default=2, help="alternating runs of all sides (best is kept)")
    parser.add_argument("--sides", nargs="+", choices=list(SIDES), default=list(SIDES))
    parser.add_argument("--child", choices=list(SIDES), help=argparse.SUPPRESS)
    parser.add_argument("--light", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.threads, args.repeats, args.light)
        return

    sides = args.sides
    for side in sides:
        spawn(side, args.threads, 1, light=True)  # warm the page cache
    runs: dict[str, list[dict]] = {side: [] for side in sides}
    loads = []
    for _ in range(args.rounds):
        for side in sides:
            loads.append(os.getloadavg()[0])
            run = spawn(side, args.threads, args.repeats)
            run["rss_mb"] = spawn(side, args.threads, 1, light=True)["peak_rss_mb"]
            if SIDES[side]["kind"] != "hf":
                run["first_token_s"] = fresh_first_token(side, args.threads)
            runs[side].append(run)
    results = {side: best_of(side_runs) for side, side_runs in runs.items()}
    peer = "llama.cpp Q4_1" if "llama.cpp Q4_1" in results else sides[-1]
    print(f"\nSmolLM2-135M-Instruct (Q4_1 GGUF), CPU, {args.threads} threads, {args.rounds} alternating rounds; "
          f"load average during the run {min(loads):.1f}..{max(loads):.1f}")
    width = 13
    print(f"{'metric':<26}" + "".join(f"{s[:width]:>{width + 1}}" for s in sides))
    for label, key in ROWS:
        print(f"{label:<26}" + "".join(f"{results[s].get(key, float('nan')):>{width + 1}.2f}" for s in sides))
    print(f"\nratio to {peer} (> 1 = better than {peer})")
    ratios: dict[str, dict[str, float]] = {}
    for side in sides:
        ratios[side] = {}
        for _, key in ROWS:
            ours, theirs = results[side].get(key), results[peer].get(key)
            if ours and theirs:
                ratios[side][key] = theirs / ours if key.endswith(("_s", "_mb")) else ours / theirs
    for label, key in ROWS:
        print(f"{label:<26}" + "".join(f"{ratios[s].get(key, float('nan')):>{width}.2f}x" for s in sides))
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
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "load_average_min_max": [min(loads),
                                                                                                   max(loads)]},
        "versions": versions,
        "settings": {"threads": args.threads, "rounds": args.rounds, "repeats": args.repeats, "prefill": PREFILL,
                     "decode_prompt": PROMPT, "decode_new_b1": NEW1, "batch": BATCH, "decode_new_b8": NEW8},
        "results": results, f"ratios_to_{peer}": ratios,
    }, indent=2) + "\n")
    print(f"\nwrote {RESULTS}")


if __name__ == "__main__":
    main()
