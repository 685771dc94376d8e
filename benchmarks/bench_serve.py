"""``lucidlm serve`` under 8 concurrent clients: ``--parallel 1`` (one request at a time) against
``--parallel 8`` (waiting requests decode as one batch), on the embedded SmolLM2-135M as
``lucidlm.load()`` gives it, in ONE process.

One in-process ``OpenAIServer`` (what ``lucidlm serve`` runs) answers on a free port, served from
the main thread that loaded the model, as ``lucidlm serve`` does; each round
8 client threads send their requests at once over HTTP (urllib), each a different greedy
completion of ``--new-tokens`` tokens. The rounds alternate between the two settings (the
server's ``parallel`` is set between rounds: same model, same process, same load), after one
untimed round of each. Per round: aggregate completion tokens a second (all tokens / the time
from the first request sent to the last answer read), mean and max latency of a request. The
answers must be the same under both settings (greedy: a batch changes no token). Prints a
table and writes benchmarks/results/serve.json.

    python benchmarks/bench_serve.py --threads 2 --rounds 3 --new-tokens 64
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
import urllib.request
from pathlib import Path

import torch

import lucidlm
from lucidlm.serving import OpenAIServer
from timing import machine, run_record

PROMPTS = ["The capital of France is", "Once upon a time, in a small village,", "def fibonacci(n):",
           "The three primary colors are", "List of planets: Mercury, Venus,", "My favourite recipe for soup is",
           "The history of the Roman Empire began", "To install Python on Linux, first"]
SETTINGS = (1, 8)


def ask(url: str, prompt: str, new_tokens: int) -> dict:
    body = json.dumps({"model": "smollm2-135m", "prompt": prompt, "max_tokens": new_tokens, "temperature": 0})
    request = urllib.request.Request(f"{url}/completions", data=body.encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=600) as response:
        return json.loads(response.read())


def one_round(server: OpenAIServer, parallel: int, new_tokens: int) -> dict:
    server.parallel = parallel
    before = server.batches.copy()
    answers, latencies = [None] * len(PROMPTS), [0.0] * len(PROMPTS)
    go = threading.Barrier(len(PROMPTS) + 1)

    def client(i: int) -> None:
        go.wait()
        sent = time.perf_counter()
        answers[i] = ask(server.url, PROMPTS[i], new_tokens)
        latencies[i] = time.perf_counter() - sent

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(PROMPTS))]
    for thread in threads:
        thread.start()
    go.wait()
    start = time.perf_counter()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - start
    tokens = sum(a["usage"]["completion_tokens"] for a in answers)
    return {"parallel": parallel, "seconds": wall, "completion_tokens": tokens, "tok_per_s": tokens / wall,
            "mean_latency_s": statistics.mean(latencies), "max_latency_s": max(latencies),
            "batches": {str(rows): count for rows, count in sorted((server.batches - before).items())},
            "texts": [a["choices"][0]["text"] for a in answers]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--serve-from", choices=("main", "thread"), default="main",
                        help="the thread that serves, so runs the model: main (the one that loaded it, as lucidlm "
                             "serve does) or another (to measure what that costs)")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "serve.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    server = OpenAIServer(lucidlm.load(), "smollm2-135m", port=0)
    measured: dict = {}

    def drive() -> None:  # the clients' side, in a thread: the main thread serves, as `lucidlm serve` does
        try:
            measured["warm"] = {parallel: one_round(server, parallel, args.new_tokens) for parallel in SETTINGS}
            measured["rounds"] = [one_round(server, parallel, args.new_tokens) for _ in range(args.rounds)
                                  for parallel in SETTINGS]
        finally:
            server.shutdown()

    if args.serve_from == "main":
        threading.Thread(target=drive, daemon=True).start()
        try:
            server.serve_forever()  # the model's work on the thread that loaded it (serving/model_worker.py)
        finally:
            server.server_close()
    else:  # served from another thread than the loading one: what serve did before model_worker.py
        threading.Thread(target=server.serve_forever, daemon=True).start()
        try:
            drive()
        finally:
            server.server_close()
    warm, rounds = measured["warm"], measured["rounds"]  # untimed, timed
    texts = warm[SETTINGS[0]]["texts"]
    assert all(r["texts"] == texts for r in [*warm.values(), *rounds]), "a batch changed a greedy answer"
    summary = {}
    print("parallel  round  tok/s  mean latency s  max latency s  batches (rows: count)")
    for r in rounds:
        print(f"{r['parallel']:8d}  {rounds.index(r) // len(SETTINGS) + 1:5d}  {r['tok_per_s']:5.0f}  "
              f"{r['mean_latency_s']:14.2f}  {r['max_latency_s']:13.2f}  {r['batches']}")
    for parallel in SETTINGS:
        mine = [r for r in rounds if r["parallel"] == parallel]
        summary[str(parallel)] = {key: statistics.median(r[key] for r in mine)
                                  for key in ("tok_per_s", "mean_latency_s", "max_latency_s")}
        print(f"parallel {parallel}, median of {len(mine)} rounds: {summary[str(parallel)]['tok_per_s']:.0f} tok/s, "
              f"mean latency {summary[str(parallel)]['mean_latency_s']:.2f} s, "
              f"max {summary[str(parallel)]['max_latency_s']:.2f} s")
    for r in rounds:
        del r["texts"]
    out = args.out
    out.write_text(json.dumps({"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), **run_record(),
                               "machine": machine(threads=args.threads), "clients": len(PROMPTS),
                               "served_from": args.serve_from,
                               "new_tokens": args.new_tokens, "median": summary, "rounds": rounds}, indent=1) + "\n")


if __name__ == "__main__":
    main()
