"""Speculative decoding against plain greedy decoding, side by side in ONE process, on the
embedded SmolLM2-135M-Instruct (chat template, greedy, 2 threads by default).

Variants, each checked to give plain greedy's tokens:

- the default model (its file's 4-bit quants), plain vs prompt lookup (``draft="prompt"``);
- the float32 model, plain vs prompt lookup vs a 4-bit draft (``lucidlm.load()``'s model)
  vs an int4 draft (``quantize="int4"``);

on prompts whose answer copies their input (repeat a paragraph; fix its typos) and on an
ordinary one (a short story). Rounds alternate the variants' order, so that they share the machine's load;
the figures are medians over the rounds. Also measured: one decode step against one pass of
K + 1 tokens (what a speculative round costs), per model: that ratio limits the speed-up.
Writes benchmarks/results/speculative.json (``--out`` names another file there).

    python benchmarks/bench_speculative.py --rounds 3 --new-tokens 96 --threads 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from timing import best_time, machine, run_record  # noqa: E402

import lucidlm  # noqa: E402
from lucidlm.generation import generate  # noqa: E402
from lucidlm.generation.decode import DecodeSession  # noqa: E402

PARAGRAPH = ("The Eifel Tower is one of the most famus landmarks in the world. It was bilt in 1889 for the World's "
             "Fair in Paris, and at first many artists hated it. Today milions of visitors climb its stairs or "
             "take the lift to the top, where they can see the hole city spread out beneath them.")
PROMPTS = {"repeat": f"Repeat the following text exactly, word for word:\n\n{PARAGRAPH}",
           "copy": f"Fix the spelling mistakes in this text and write it out again in full:\n\n{PARAGRAPH}",
           "ordinary": "Write a short story about a robot who learns to paint."}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--draft-tokens", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="speculative.json", help="file name under benchmarks/results/")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    models = {"default": lucidlm.load(), "float32": lucidlm.load("smollm2-135m", dtype=torch.float32),
              "int4": lucidlm.load("smollm2-135m", quantize="int4")}
    variants = [("default", None), ("default", "prompt"),
                ("float32", None), ("float32", "prompt"), ("float32", "default"), ("float32", "int4")]
    runs: dict[tuple, list] = {}
    for r in range(args.rounds):
        order = variants if r % 2 == 0 else variants[::-1]
        for prompt_name, prompt in PROMPTS.items():
            for target, draft in order:
                guesser = models.get(draft, draft)
                result = generate(models[target], prompt, chat=True, temperature=0, max_new_tokens=args.new_tokens,
                                  draft=guesser, draft_tokens=args.draft_tokens if draft else None)
                runs.setdefault((prompt_name, target, draft), []).append(result)
    rows = []
    for (prompt_name, target, draft), results in runs.items():
        plain = runs[(prompt_name, target, None)][0]
        assert all(res.token_ids == plain.token_ids for res in results), (prompt_name, target, draft)
        rate = statistics.median(len(res.token_ids) / res.seconds for res in results)
        plain_rate = statistics.median(len(res.token_ids) / res.seconds for res in runs[(prompt_name, target, None)])
        stats = results[0].speculation
        rows.append({"prompt": prompt_name, "model": target, "draft": draft, "new_tokens": len(plain.token_ids),
                     "tokens_per_second": round(rate, 2), "speed_up": round(rate / plain_rate, 2),
                     "rounds": stats.rounds if stats else None,
                     "acceptance_rate": round(stats.acceptance_rate, 3) if stats and stats.drafted else None,
                     "accepted_per_round": round(stats.accepted_per_round, 2) if stats and stats.rounds else None})
    passes = {name: pass_costs(model, args.draft_tokens) for name, model in models.items()}
    print("prompt    model    draft     tok/s  speed-up  acceptance  accepted/round")
    for row in rows:
        print(f"{row['prompt']:9s} {row['model']:8s} {str(row['draft']):8s} {row['tokens_per_second']:6.1f}  "
              f"{row['speed_up']:7.2f}x  {row['acceptance_rate'] if row['acceptance_rate'] is not None else '-':>10}  "
              f"{row['accepted_per_round'] if row['accepted_per_round'] is not None else '-':>14}")
    print("ms per pass (1 = a decode step; T = one pass of T tokens at the end of a 200-token cache):")
    for name, costs in passes.items():
        print(f"  {name:8s} " + "  ".join(f"{t}: {ms:.1f}" for t, ms in costs.items()))
    out = Path(__file__).parent / "results" / args.out
    out.write_text(json.dumps({**run_record(), "machine": machine(threads=args.threads), "rounds": args.rounds,
                               "draft_tokens": args.draft_tokens, "rows": rows, "ms_per_pass": passes}, indent=1)
                   + "\n")


def pass_costs(model, k: int) -> dict[str, float]:
    """ms for a decode step (key "1") and for one pass of T = 2 .. k + 1 tokens (what checking
    T - 1 drafts costs), over a 200-token cache; best of 7, the passes alternating."""
    prompt = list(range(1000, 1200))
    costs: dict[str, list] = {}
    with DecodeSession(model, [prompt], capacity=len(prompt) + 2 * k + 4, steady=True) as session:
        session.prefill()
        token = torch.tensor([504])
        for _ in range(7):
            for T in range(1, k + 2):
                session.rewind(len(prompt))
                run = (lambda: session.step(token)) if T == 1 else (lambda: session.feed(torch.full((1, T), 504)))
                costs.setdefault(str(T), []).append(best_time(run, 1))
    return {T: round(min(times) * 1e3, 2) for T, times in costs.items()}


if __name__ == "__main__":
    main()
