"""Decode-step time of the embedded SmolLM2-135M, eager against compiled variants, in ONE
process: every variant is loaded (and compiled) first, then the rounds alternate between
them, so load from other processes on a shared machine hits all of them alike.

Each variant is ``WEIGHTS[:OPTIONS]``: WEIGHTS is default (``lucidlm.load()``'s), float32, bf16, int8, int4,
gguf, gguf-bf16 or gguf-f32 (the
file's own quants); OPTIONS, comma-separated, compile the model (``model.compile``) and pick
inductor settings: ``compiled`` (``model.compile()``'s own CPU settings, what ``--compile`` does),
``freezing``, ``cpp_wrapper``, ``max_autotune`` (each implies compiled, on torch's defaults
plus that setting).

    python benchmarks/bench_decode_step.py bf16 bf16:compiled int4 int4:compiled int4:freezing

Per variant: the compile warm-up (the first generation's wall time) and the time of each
decode step (one token at batch 1: forward pass, greedy pick and loop, prefill excluded),
over ``--rounds`` runs of ``--new-tokens`` greedy tokens. On a loaded machine the median
says more about the neighbours than about the code; the minimum and the 10th percentile
are what the step costs when it gets the cores. Greedy tokens must equal the first run's.
Prints a table and writes benchmarks/results/decode_step.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results" / "decode_step.json"
WEIGHTS = {"default": {}, "float32": {"dtype": "float32"}, "bf16": {"dtype": "bfloat16"}, "int8": {"quantize": "int8"},
           "int4": {"quantize": "int4"}, "gguf": {"quantize": "gguf"},
           "gguf-bf16": {"dtype": "bfloat16", "quantize": "gguf"}, "gguf-f32": {"dtype": "float32", "quantize": "gguf"}}
OPTIONS = ("compiled", "freezing", "cpp_wrapper", "max_autotune")


def build(variant: str):
    import torch

    import lucidlm
    weights, _, options = variant.partition(":")
    spec = WEIGHTS[weights]
    model = lucidlm.load("smollm2-135m", dtype=getattr(torch, spec["dtype"]) if "dtype" in spec else None,
                         quantize=spec.get("quantize"))
    chosen = [o for o in options.split(",") if o]
    unknown = [o for o in chosen if o not in OPTIONS]
    if unknown:
        raise SystemExit(f"{variant}: unknown option {unknown[0]!r}; options: {', '.join(OPTIONS)}")
    extra = {o: True for o in chosen if o != "compiled"}
    if chosen:  # options=None: lucidlm's CPU settings; a dict: torch's defaults plus those
        model.compile(prefill=False, options=extra or None)
    return model


def step_times(model, prompt: list[int], new_tokens: int) -> tuple[list[float], list[int]]:
    """Seconds per decode step (the prefill's token dropped) and the greedy tokens."""
    import torch

    from lucidlm.generation.decode import sample_rows
    from lucidlm.generation.sampling import SamplingSettings

    times, tokens = [], []
    last = time.perf_counter()
    for ids in sample_rows(model, [prompt], new_tokens, SamplingSettings(temperature=0), None,
                           torch.zeros(1, dtype=torch.bool)):
        now = time.perf_counter()
        times.append(now - last)
        last = now
        tokens.append(int(ids[0]))
    return times[1:], tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("variants", nargs="+", help="WEIGHTS[:OPTIONS], e.g. int4:compiled")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=64)
    args = parser.parse_args()
    import random

    import torch
    torch.set_num_threads(args.threads)
    rng = random.Random(16000)
    prompt = [rng.randrange(100, 49152) for _ in range(16)]  # bench_generation's batch-1 prompt

    models, warmup, reference, times = {}, {}, {}, {v: [] for v in args.variants}
    for variant in args.variants:
        models[variant] = build(variant)
        start = time.perf_counter()
        reference[variant] = step_times(models[variant], prompt, args.new_tokens)[1]
        warmup[variant] = time.perf_counter() - start
        print(f"{variant}: first generation {warmup[variant]:.1f} s", flush=True)
    loads = [os.getloadavg()[0]]
    for _ in range(args.rounds):
        for variant, model in models.items():
            steps, tokens = step_times(model, prompt, args.new_tokens)
            assert tokens == reference[variant], f"{variant}: greedy tokens changed between runs"
            times[variant] += steps
        loads.append(os.getloadavg()[0])
    results = {}
    print(f"\nSmolLM2-135M decode step, batch 1, {args.threads} threads, {args.rounds} rounds; load average "
          f"{min(loads):.1f}..{max(loads):.1f}")
    print(f"{'variant':<28}{'warm-up s':>10}{'min ms':>9}{'p10 ms':>9}{'median ms':>11}{'tok/s at min':>14}")
    for variant in args.variants:
        s = sorted(times[variant])
        eager = reference.get(variant.split(":")[0])  # None when the eager variant was not run
        row = {"first_generation_s": warmup[variant], "step_min_ms": 1000 * s[0],
               "step_p10_ms": 1000 * s[len(s) // 10], "step_median_ms": 1000 * s[len(s) // 2],
               "tokens_equal_eager": None if eager is None else reference[variant] == eager}
        results[variant] = row
        print(f"{variant:<28}{row['first_generation_s']:>10.1f}{row['step_min_ms']:>9.2f}{row['step_p10_ms']:>9.2f}"
              f"{row['step_median_ms']:>11.2f}{1000 / row['step_min_ms']:>14.1f}")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({
        "model": "SmolLM2-135M-Instruct, the embedded Q4_1 GGUF", "batch": 1, "prompt_tokens": len(prompt),
        "new_tokens": args.new_tokens, "rounds": args.rounds, "threads": args.threads,
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "load_average_min_max":
                    [min(loads), max(loads)]},
        "torch": torch.__version__, "results": results}, indent=2) + "\n")
    print(f"\nwrote {RESULTS}")


if __name__ == "__main__":
    main()
