"""Time to the first token of each chat turn, with and without prompt caching (``reuse_cache``),
on the embedded SmolLM2-135M as ``lucidlm.load()`` gives it, in ONE process.

A conversation of ``--turns`` turns is answered greedily with reuse (what ``Conversation`` and
``lucidlm chat`` do). At each turn the same prompt is also answered by a fresh prefill of the
whole conversation, one token (the cost of every turn before prompt caching), and the turn is
then run again with reuse from the same kept cache, so the two alternate under the same load.
The answers must be equal. Prints a table and writes benchmarks/results/prompt_cache.json.

    python benchmarks/bench_prompt_cache.py --turns 8 --new-tokens 100 --threads 1
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

import lucidlm
from lucidlm.chat import Conversation, encode_chat
from lucidlm.generation import generate

QUESTIONS = ["Hi! Who are you?", "Tell me about the history of Paris.", "What about its museums?",
             "Which one should I visit first, and why?", "How do I get there from the airport?",
             "What should I eat nearby?", "Give me a short plan for the whole day.", "Thanks! Anything else?",
             "Summarise our conversation."]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=100)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = lucidlm.load()
    convo, rows = Conversation(), []
    for turn in range(args.turns):
        convo.add_user(QUESTIONS[turn % len(QUESTIONS)])
        ids = encode_chat(model.tokenizer, convo.messages)
        kept = model.kept_kv_cache
        options = dict(temperature=0, max_new_tokens=args.new_tokens)
        fresh = generate(model, ids, **{**options, "max_new_tokens": 1})  # forgets the kept cache...
        model.kept_kv_cache = kept  # ...which is still valid: nothing else changed (prompt_cache.py)
        answer = "".join(convo.reply(model, **options))
        reused = convo.last_result
        assert reused.token_ids[0] == fresh.token_ids[0]
        rows.append({"turn": turn + 1, "prompt_tokens": len(ids), "cached_tokens": reused.cached_tokens,
                     "new_tokens": len(reused.token_ids), "first_token_fresh_s": fresh.prompt_seconds,
                     "first_token_reused_s": reused.prompt_seconds, "answer": answer[:40]})
    print("turn  prompt  cached  fresh ms  reused ms  speed-up")
    for r in rows:
        print(f"{r['turn']:4d}  {r['prompt_tokens']:6d}  {r['cached_tokens']:6d}  {r['first_token_fresh_s'] * 1e3:8.0f}  "
              f"{r['first_token_reused_s'] * 1e3:9.0f}  {r['first_token_fresh_s'] / r['first_token_reused_s']:7.1f}x")
    out = Path(__file__).parent / "results" / "prompt_cache.json"
    out.write_text(json.dumps({"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "threads": args.threads,
                               "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
