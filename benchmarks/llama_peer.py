"""llama.cpp as a benchmark peer (llama-cpp-python, built by setup_peers.sh). Never imported by
lucidlm itself.

Decoding goes through llama.cpp's own batch API (``llama_decode`` with one sequence id per
row), greedy by argmax over the returned logits, so batch 8 is a real batch of 8 sequences
sharing each forward pass, the same work lucidlm's ``generate_batch`` does.

    python benchmarks/llama_peer.py --first-token THREADS   # a fresh process: load, 1 token
"""

from __future__ import annotations

import sys
import time
from typing import Callable, Sequence

import numpy as np


def gguf_path() -> str:
    from lucidlm.pretrained import find_gguf
    return str(find_gguf("smollm2-135m"))


def open_model(threads: int, n_seq: int = 8):
    import llama_cpp as lc

    lc.llama_backend_init()
    mparams = lc.llama_model_default_params()
    model = lc.llama_model_load_from_file(gguf_path().encode(), mparams)
    cparams = lc.llama_context_default_params()
    cparams.n_ctx, cparams.n_batch, cparams.n_ubatch = 1024, 512, 512
    cparams.n_seq_max = n_seq
    cparams.n_threads = cparams.n_threads_batch = threads
    ctx = lc.llama_init_from_model(model, cparams)
    n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(model))
    return lc, model, ctx, n_vocab


class Runner:
    def __init__(self, threads: int) -> None:
        self.lc, self.model, self.ctx, self.n_vocab = open_model(threads)
        self.batch = self.lc.llama_batch_init(512, 0, 8)

    def clear(self) -> None:
        self.lc.llama_memory_clear(self.lc.llama_get_memory(self.ctx), True)

    def decode(self, rows: list[list[int]], positions: list[int], want_logits: list[bool]) -> list[int]:
        """One llama_decode of several sequences' tokens; returns the argmax of each row that
        asked for logits. rows[s] are the tokens of sequence s at positions[s], ... ."""
        b, n = self.batch, 0
        wanted = []
        for seq, tokens in enumerate(rows):
            for j, token in enumerate(tokens):
                b.token[n], b.pos[n], b.n_seq_id[n] = token, positions[seq] + j, 1
                b.seq_id[n][0] = seq
                last = j == len(tokens) - 1 and want_logits[seq]
                b.logits[n] = last
                if last:
                    wanted.append(n)
                n += 1
        b.n_tokens = n
        if self.lc.llama_decode(self.ctx, b) != 0:
            raise RuntimeError("llama_decode failed")
        out = []
        for i in wanted:
            logits = np.ctypeslib.as_array(self.lc.llama_get_logits_ith(self.ctx, i), shape=(self.n_vocab,))
            out.append(int(logits.argmax()))
        return out

    def greedy(self, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
        self.clear()
        nexts = self.decode(prompts, [0] * len(prompts), [True] * len(prompts))
        generated = [[t] for t in nexts]
        length = len(prompts[0])
        for step in range(new_tokens - 1):
            nexts = self.decode([[t] for t in nexts], [length + step] * len(prompts), [True] * len(prompts))
            for row, token in zip(generated, nexts):
                row.append(token)
        return generated


def run_llama_cpp(threads: int, repeats: int, light: bool, prefill: int, prompt: int, new1: int, batch: int,
                  new8: int, prompt_ids: Callable[..., list[int]],
                  metrics: Sequence[str] = ("prefill512", "decode1", "decode8")) -> dict:
    import llama_cpp

    start = time.perf_counter()
    runner = Runner(threads)
    out = {"load_s": time.perf_counter() - start, "threads": threads, "llama_cpp": llama_cpp.__version__}
    ids16 = prompt_ids(prompt)
    if light:
        runner.greedy([ids16], 16)
        return out

    def best(fn) -> float:
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        return min(times)

    ids = prompt_ids(prefill)

    def do_prefill() -> None:
        runner.clear()
        runner.decode([ids], [0], [True])
    if "prefill512" in metrics:
        do_prefill()
        out["prefill512_tok_s"] = prefill / best(do_prefill)
    if "decode1" in metrics:
        runner.greedy([ids16], 8)
        out["decode1_tok_s"] = new1 / best(lambda: runner.greedy([ids16], new1))
    if "decode8" in metrics:
        prompts = [prompt_ids(prompt, seed=i) for i in range(batch)]
        runner.greedy(prompts, 4)
        out["decode8_tok_s"] = batch * new8 / best(lambda: runner.greedy(prompts, new8))
    return out


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--first-token":
        runner = Runner(int(sys.argv[2]))
        print(runner.greedy([[504, 3575, 282, 4649, 314]], 1))
    else:
        raise SystemExit(__doc__)
