"""Generation speed and memory: lucidlm vs transformers on the embedded SmolLM2-135M GGUF (CPU).

Both in float32, plus lucidlm with bfloat16 weights: decoding one token reads every weight
once, so on a CPU it is memory-bound and halving the bytes per weight is what moves it.

Each side runs in its own subprocess (so peak RSS is its own): once to warm the disk cache
(and lucidlm's converted-model cache), then ``--rounds`` times alternating with the other
side; each metric's best over the rounds is reported.

    python benchmarks/bench_generation.py [--threads N] [--repeats 3] [--rounds 2]

Measures: warm load time, prefill tok/s (128- and 512-token prompts, one forward pass that
fills the KV cache), decode tok/s (128 greedy tokens after a 16-token prompt), peak RSS.
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

RESULTS = Path(__file__).resolve().parent / "results" / "generation.json"
SIDES = ("ours", "ours-bf16", "hf")
PREFILL_LENGTHS = (128, 512)
DECODE_PROMPT, DECODE_NEW = 16, 128


def prompt_ids(n: int, vocab: int = 49152) -> list[int]:
    import random
    rng = random.Random(n)
    return [rng.randrange(100, vocab) for _ in range(n)]


def best_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def run_ours(repeats: int, dtype_name: str = "float32") -> dict:
    import torch

    import lucidlm
    from lucidlm.generation import generate

    start = time.perf_counter()
    model = lucidlm.load("smollm2-135m", dtype=getattr(torch, dtype_name))
    load_s = time.perf_counter() - start
    out = {"load_s": load_s}
    with torch.inference_mode():
        for n in PREFILL_LENGTHS:
            ids = torch.tensor([prompt_ids(n)])

            def prefill() -> None:
                model.setup_kv_cache(1, max_seq_len=n + 1)
                model(ids, input_pos=torch.arange(n), last_token_only=True)
                model.clear_kv_cache()
            prefill()  # warm-up
            out[f"prefill{n}_tok_s"] = n / best_time(prefill, repeats)
    ids16 = prompt_ids(DECODE_PROMPT)

    def decode() -> None:
        result = generate(model, ids16, max_new_tokens=DECODE_NEW, temperature=0, stop_on_eos=False)
        assert len(result.token_ids) == DECODE_NEW
    generate(model, ids16, max_new_tokens=8, temperature=0)  # warm-up
    out["decode_tok_s"] = DECODE_NEW / best_time(decode, repeats)
    return out


def run_hf(repeats: int) -> dict:
    import torch
    import transformers

    from lucidlm.pretrained import find_gguf

    path = find_gguf("smollm2-135m")
    transformers.logging.set_verbosity_error()
    start = time.perf_counter()
    model = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                              dtype=torch.float32).eval()
    load_s = time.perf_counter() - start
    out = {"load_s": load_s}
    with torch.inference_mode():
        for n in PREFILL_LENGTHS:
            ids = torch.tensor([prompt_ids(n)])

            def prefill() -> None:
                model(ids, use_cache=True, logits_to_keep=1)
            prefill()
            out[f"prefill{n}_tok_s"] = n / best_time(prefill, repeats)
        ids16 = torch.tensor([prompt_ids(DECODE_PROMPT)])

        def decode() -> None:
            seq = model.generate(ids16, max_new_tokens=DECODE_NEW, min_new_tokens=DECODE_NEW, do_sample=False,
                                 pad_token_id=2)
            assert seq.shape[1] - DECODE_PROMPT == DECODE_NEW
        model.generate(ids16, max_new_tokens=8, do_sample=False, pad_token_id=2)
        out["decode_tok_s"] = DECODE_NEW / best_time(decode, repeats)
    return out


def child(side: str, threads: int, repeats: int) -> None:
    import torch
    if threads:
        torch.set_num_threads(threads)
    out = run_hf(repeats) if side == "hf" else run_ours(repeats, "bfloat16" if side == "ours-bf16" else "float32")
    out["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB
    out["threads"] = torch.get_num_threads()
    print("RESULT " + json.dumps(out))


def spawn(side: str, threads: int, repeats: int) -> dict:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    cmd = [sys.executable, __file__, "--child", side, "--threads", str(threads), "--repeats", str(repeats)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"{side} benchmark failed:\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def best_of(runs: list[dict]) -> dict:
    """Per metric, the best value over runs (lowest time / memory, highest speed)."""
    best = dict(runs[0])
    for key in best:
        values = [r[key] for r in runs]
        best[key] = min(values) if key in ("load_s", "peak_rss_mb") else max(values)
    best["rounds"] = len(runs)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=0, help="torch threads in each side (0 = torch's default)")
    parser.add_argument("--repeats", type=int, default=3, help="timed repeats per measurement (best is kept)")
    parser.add_argument("--rounds", type=int, default=2, help="alternating runs of each side (best is kept)")
    parser.add_argument("--child", choices=SIDES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.threads, args.repeats)
        return

    for side in SIDES:
        spawn(side, args.threads, 1)  # warm the page cache (and lucidlm's converted cache)
    # Alternate the sides for several rounds and keep each side's best figure: on a shared
    # machine, load from other processes comes and goes, and this gives both sides the
    # same chances.
    runs: dict[str, list[dict]] = {side: [] for side in SIDES}
    for _ in range(args.rounds):
        for side in SIDES:
            runs[side].append(spawn(side, args.threads, args.repeats))
    results = {side: best_of(side_runs) for side, side_runs in runs.items()}
    rows = [("warm load (s)", "load_s", False), ("prefill 128 (tok/s)", "prefill128_tok_s", True),
            ("prefill 512 (tok/s)", "prefill512_tok_s", True), ("decode 128 (tok/s)", "decode_tok_s", True),
            ("peak RSS (MB)", "peak_rss_mb", False)]
    print(f"\nSmolLM2-135M-Instruct, CPU, {results['ours']['threads']} thread(s), "
          f"load average {os.getloadavg()[0]:.1f}; ratios against transformers fp32 (> 1 = lucidlm better)")
    print(f"{'metric':<22}{'lucidlm fp32':>14}{'lucidlm bf16':>14}{'transformers fp32':>19}{'fp32 ratio':>12}"
          f"{'bf16 ratio':>12}")
    ratios: dict[str, dict[str, float]] = {"fp32": {}, "bf16": {}}
    for label, key, higher_is_better in rows:
        ours, ours_bf16, theirs = results["ours"][key], results["ours-bf16"][key], results["hf"][key]
        for name, value in (("fp32", ours), ("bf16", ours_bf16)):
            ratios[name][key] = value / theirs if higher_is_better else theirs / value
        print(f"{label:<22}{ours:>14.2f}{ours_bf16:>14.2f}{theirs:>19.2f}{ratios['fp32'][key]:>11.2f}x"
              f"{ratios['bf16'][key]:>11.2f}x")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    import torch
    import transformers
    RESULTS.write_text(json.dumps({
        "model": "SmolLM2-135M-Instruct (Q4_1 GGUF dequantized to fp32; lucidlm also cast to bf16)",
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "load_average": os.getloadavg()},
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
        "settings": {"prefill_lengths": PREFILL_LENGTHS, "decode_prompt": DECODE_PROMPT, "decode_new": DECODE_NEW,
                     "repeats": args.repeats, "threads": results["ours"]["threads"]},
        "lucidlm": results["ours"], "lucidlm_bf16": results["ours-bf16"], "transformers": results["hf"],
        "ratios_vs_transformers_fp32_lucidlm_better_if_above_1": ratios,
    }, indent=2) + "\n")
    print(f"\nwrote {RESULTS}")


if __name__ == "__main__":
    main()
