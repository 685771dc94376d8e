"""The eager decode step of the embedded default model (``lucidlm.load()``) from two or more
source trees, in fresh processes that take turns.

A change to the Python side of a decode step (the modules, their dispatch, the small ops between
the kernels) cannot be timed in one process against the code before it: both would import the
same ``lucidlm``. Here every round starts one process per tree (``PYTHONPATH`` set to it), in
turn, the order reversed every other round; each loads the model, warms up, and times greedy
generations of ``--new-tokens`` + 1 tokens at each batch size, less a generation of one token
(the prompt pass), per step. Prints the median and minimum ms per step of each tree, and whether
its greedy tokens equal the first tree's; writes benchmarks/results/step_ab.json.

    git worktree add /tmp/before HEAD~1
    python benchmarks/bench_step_ab.py /tmp/before/src src --batch 1 8 --processes 3 --rounds 4
    python benchmarks/bench_step_ab.py /tmp/before/src src --model gemma3-270m --output /tmp/gemma_ab.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from timing import machine, run_record

RESULTS = Path(__file__).resolve().parent / "results" / "step_ab.json"
PROMPT = "The quick brown fox jumps over the lazy dog and then"

CHILD = """
import json, sys, time
import torch
torch.set_num_threads({threads})
import lucidlm
from lucidlm.generation import generate_batch
model = lucidlm.load({model!r})
prompt = model.tokenizer.encode({prompt!r})
out = {{}}
for batch in {batches!r}:
    def run(n):
        return generate_batch(model, [prompt] * batch, max_new_tokens=n, min_new_tokens=n, temperature=0)
    run(4)
    steps, tokens = [], None
    for _ in range({rounds}):
        start = time.perf_counter(); result = run({new} + 1); whole = time.perf_counter() - start
        start = time.perf_counter(); run(1); prompt_pass = time.perf_counter() - start
        steps.append((whole - prompt_pass) / {new} * 1000)
        tokens = [r.token_ids for r in result]
    out[str(batch)] = {{"ms": steps, "tokens": tokens}}
print(json.dumps(out))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trees", nargs="+", help="source directories (each holds the lucidlm package)")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--processes", type=int, default=3, help="rounds of one fresh process per tree")
    parser.add_argument("--rounds", type=int, default=4, help="timed generations per batch size in each process")
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--model", default=None, help="a name lucidlm.load takes (default: the embedded model)")
    parser.add_argument("--output", type=Path, default=RESULTS, help="the results file")
    args = parser.parse_args()
    trees = [str(Path(t).resolve()) for t in args.trees]
    for tree in trees:
        if not (Path(tree) / "lucidlm" / "__init__.py").is_file():
            sys.exit(f"bench_step_ab: {tree} holds no lucidlm package; pass a tree's src directory.")
    code = CHILD.format(threads=args.threads, model=args.model, prompt=PROMPT, batches=args.batch, rounds=args.rounds,
                        new=args.new_tokens)
    runs: dict[str, dict[str, list]] = {t: {str(b): [] for b in args.batch} for t in trees}
    tokens: dict[str, dict[str, list]] = {t: {} for t in trees}
    load_before = os.getloadavg()
    for index in range(args.processes):
        for tree in trees if index % 2 == 0 else reversed(trees):
            env = dict(os.environ, PYTHONPATH=tree)
            done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=1800)
            if done.returncode != 0:
                sys.exit(f"bench_step_ab: the process for {tree} failed:\n{done.stderr[-2000:]}")
            for batch, row in json.loads(done.stdout.strip().splitlines()[-1]).items():
                runs[tree][batch] += row["ms"]
                tokens[tree][batch] = row["tokens"]
    summary = {}
    print(f"eager decode step, ms (median / min over {args.processes} x {args.rounds} generations of "
          f"{args.new_tokens} steps)")
    for tree in trees:
        summary[tree] = {}
        for batch in map(str, args.batch):
            same = tokens[tree][batch] == tokens[trees[0]][batch]
            summary[tree][batch] = {"median_ms": statistics.median(runs[tree][batch]), "min_ms": min(runs[tree][batch]),
                                    "tokens_equal_first_tree": same}
            row = summary[tree][batch]
            print(f"  {tree}  batch {batch}: {row['median_ms']:.2f} / {row['min_ms']:.2f}"
                  f"{'' if same else '  (greedy tokens differ from the first tree)'}")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps({
        "benchmark": f"eager decode step of lucidlm.load({args.model or ''}) from several source trees, fresh "
                     "processes taking turns",
        "run": run_record(),
        "machine": machine(threads=args.threads, load_average_before=load_before, load_average_after=os.getloadavg()),
        "settings": {**vars(args), "output": str(args.output)}, "summary": summary, "runs": runs}, indent=1) + "\n")


if __name__ == "__main__":
    main()
