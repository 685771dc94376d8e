"""``lucidlm serve`` under 8 clients: ``--parallel 1`` (one request at a time) against
``--parallel 8`` with static batching (``--no-cont-batching``: waiting requests decode as one
batch) and with continuous batching (the default: requests that come while a batch runs join
it), on the embedded SmolLM2-135M as ``lucidlm.load()`` gives it, in ONE process.

One in-process ``OpenAIServer`` (what ``lucidlm serve`` runs) answers on a free port, served from
the main thread that loaded the model, as ``lucidlm serve`` does; each round 8 client threads
send their requests over HTTP (urllib), each a different greedy completion:

- ``--arrivals burst``: all at once, each of ``--new-tokens`` tokens;
- ``--arrivals staggered``: one every ``--gap`` seconds, with budgets from half to 1.75 times
  ``--new-tokens`` (rows end at different times, and requests come while a batch runs);
- ``--arrivals steady``: the clients start one every ``--gap`` seconds and each sends
  ``--requests`` requests one after another, budgets as staggered's in turn: a server under
  steady load, whose batch runs long past its cache's first end. A fourth setting runs
  continuous batching without slides (``RowJoins.slides``: the batch then takes no request
  once its clock nears its cache's end, and drains).

The rounds alternate between the settings (set on the server between rounds: same model, same
process, same load), after one untimed round of each. Per round: aggregate completion tokens a
second (all tokens / the time from the first request sent to the last answer read), mean and
max latency of a request. The answers must be the same under every setting (greedy: a batch
changes no token). Prints a table and writes benchmarks/results/serve.json (burst),
serve_staggered.json or serve_steady.json.

    python benchmarks/bench_serve.py --threads 2 --rounds 3 --new-tokens 64
    python benchmarks/bench_serve.py --threads 2 --rounds 3 --new-tokens 64 --arrivals staggered
    python benchmarks/bench_serve.py --threads 2 --rounds 3 --new-tokens 64 --arrivals steady --requests 12
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
from lucidlm.generation.row_joins import RowJoins
from lucidlm.serving import OpenAIServer
from lucidlm.serving.batching import Joining
from timing import machine, run_record

PROMPTS = ["The capital of France is", "Once upon a time, in a small village,", "def fibonacci(n):",
           "The three primary colors are", "List of planets: Mercury, Venus,", "My favourite recipe for soup is",
           "The history of the Roman Empire began", "To install Python on Linux, first"]
SETTINGS = ((1, False), (8, False), (8, True))  # (parallel, continuous batching)
STEADY_SETTINGS = (*SETTINGS[:2], (8, "no slides"), SETTINGS[2])  # continuous batching whose batches never slide
STAGGERED_BUDGETS = (1.0, 1.5, 0.5, 1.25, 0.75, 1.75, 0.625, 1.125)  # x --new-tokens, client by client


def label(setting: tuple[int, bool]) -> str:
    parallel, continuous = setting
    if continuous == "no slides":
        return f"parallel {parallel} continuous, no slides"
    return "parallel 1" if parallel == 1 else f"parallel {parallel} {'continuous' if continuous else 'static'}"


def ask(url: str, prompt: str, new_tokens: int) -> dict:
    body = json.dumps({"model": "smollm2-135m", "prompt": prompt, "max_tokens": new_tokens, "temperature": 0})
    request = urllib.request.Request(f"{url}/completions", data=body.encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=600) as response:
        return json.loads(response.read())


def one_round(server: OpenAIServer, setting: tuple, new_tokens: int, gap: float = 0.0, requests: int = 1) -> dict:
    """All clients at once (``gap`` 0, each ``new_tokens``) or one every ``gap`` seconds with
    STAGGERED_BUDGETS; each client sends ``requests`` one after another."""
    server.parallel, continuous = setting
    server.joining = Joining(server.model_turn) if continuous else None
    RowJoins.slides = continuous != "no slides"
    before = server.batches.copy()
    n = len(PROMPTS) * requests
    answers, latencies = [None] * n, [0.0] * n
    go = threading.Barrier(len(PROMPTS) + 1)
    budgets = [round(new_tokens * share) if gap else new_tokens for share in STAGGERED_BUDGETS]

    def client(i: int) -> None:
        go.wait()
        time.sleep(i * gap)
        for k in range(i, n, len(PROMPTS)):  # its j-th request: its prompt, the budget after its last one's
            sent = time.perf_counter()
            answers[k] = ask(server.url, PROMPTS[i], budgets[(i + k // len(PROMPTS)) % len(budgets)])
            latencies[k] = time.perf_counter() - sent

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(PROMPTS))]
    for thread in threads:
        thread.start()
    go.wait()
    start = time.perf_counter()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - start
    tokens = sum(a["usage"]["completion_tokens"] for a in answers)
    return {"setting": label(setting), "parallel": setting[0], "continuous": setting[1], "seconds": wall,
            "completion_tokens": tokens, "tok_per_s": tokens / wall,
            "mean_latency_s": statistics.mean(latencies), "max_latency_s": max(latencies),
            "batches": {str(rows): count for rows, count in sorted((server.batches - before).items())},
            "joined": server.joining.joined if server.joining is not None else 0,
            "texts": [a["choices"][0]["text"] for a in answers]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--serve-from", choices=("main", "thread"), default="main",
                        help="the thread that serves, so runs the model: main (the one that loaded it, as lucidlm "
                             "serve does) or another (to measure what that costs)")
    parser.add_argument("--arrivals", choices=("burst", "staggered", "steady"), default="burst",
                        help="the clients' requests all at once, one every --gap seconds with budgets that differ, or "
                             "as staggered with --requests each, one after another")
    parser.add_argument("--gap", type=float, default=0.1, help="seconds between clients with --arrivals staggered "
                                                                 "or steady")
    parser.add_argument("--requests", type=int, default=12, help="requests per client with --arrivals steady")
    parser.add_argument("--out", type=Path, default=None,
                        help="default: benchmarks/results/serve.json (burst), serve_staggered.json or "
                             "serve_steady.json")
    args = parser.parse_args()
    gap = args.gap if args.arrivals != "burst" else 0.0
    requests = args.requests if args.arrivals == "steady" else 1
    settings = STEADY_SETTINGS if args.arrivals == "steady" else SETTINGS
    out = args.out or Path(__file__).parent / "results" / {"burst": "serve.json", "staggered": "serve_staggered.json",
                                                           "steady": "serve_steady.json"}[args.arrivals]
    torch.set_num_threads(args.threads)
    server = OpenAIServer(lucidlm.load(), "smollm2-135m", port=0)
    measured: dict = {}

    def drive() -> None:  # the clients' side, in a thread: the main thread serves, as `lucidlm serve` does
        try:
            measured["warm"] = {setting: one_round(server, setting, args.new_tokens, gap, requests)
                                for setting in settings}
            measured["rounds"] = [one_round(server, setting, args.new_tokens, gap, requests)
                                  for _ in range(args.rounds) for setting in settings]
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
    texts = warm[settings[0]]["texts"]
    assert all(r["texts"] == texts for r in [*warm.values(), *rounds]), "a batch changed a greedy answer"
    summary = {}
    print(f"{'setting':34s}  round  tok/s  mean latency s  max latency s  joined  batches (rows: count)")
    for r in rounds:
        print(f"{r['setting']:34s}  {rounds.index(r) // len(settings) + 1:5d}  {r['tok_per_s']:5.0f}  "
              f"{r['mean_latency_s']:14.2f}  {r['max_latency_s']:13.2f}  {r['joined']:6d}  {r['batches']}")
    for setting in settings:
        mine = [r for r in rounds if r["setting"] == label(setting)]
        summary[label(setting)] = {key: statistics.median(r[key] for r in mine)
                                   for key in ("tok_per_s", "mean_latency_s", "max_latency_s")}
        print(f"{label(setting)}, median of {len(mine)} rounds: {summary[label(setting)]['tok_per_s']:.0f} tok/s, "
              f"mean latency {summary[label(setting)]['mean_latency_s']:.2f} s, "
              f"max {summary[label(setting)]['max_latency_s']:.2f} s")
    for r in rounds:
        del r["texts"]
    out.write_text(json.dumps({"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), **run_record(),
                               "machine": machine(threads=args.threads), "clients": len(PROMPTS),
                               "served_from": args.serve_from, "arrivals": args.arrivals, "gap_s": gap,
                               "requests_per_client": requests,
                               "new_tokens": args.new_tokens, "median": summary, "rounds": rounds}, indent=1) + "\n")


if __name__ == "__main__":
    main()
