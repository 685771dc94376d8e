"""llama.cpp as a benchmark peer (llama-cpp-python, built by setup_peers.sh). Never imported by
lucidlm itself.

Decoding goes through llama.cpp's own batch API (``llama_decode`` with one sequence id per
row), greedy by argmax over the returned logits, so batch 8 is a real batch of 8 sequences
sharing each forward pass, the same work lucidlm's ``generate_batch`` does.

    python benchmarks/llama_peer.py --first-token THREADS GGUF   # a fresh process: load, 1 token

The GGUF's path comes from the caller (``peer_gguf()`` in the benchmark's own process): this
module imports neither lucidlm nor torch, whose import (~1 s, ~190 MB) would otherwise count in
llama.cpp's load time, first token and peak RSS.
"""

from __future__ import annotations

import functools
import subprocess
import sys
import time
from typing import Callable, Sequence

import numpy as np


@functools.lru_cache(maxsize=None)
def peer_gguf() -> str:
    """The embedded model's GGUF, for a benchmark to hand to llama.cpp's process. Looked up in a
    process of its own: lucidlm's lookup imports torch, and a child started after that inherits
    the parent's peak RSS as its own ru_maxrss floor (Linux carries it across exec), 219 MB."""
    code = "from lucidlm.pretrained import find_gguf; print(find_gguf('smollm2-135m'))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"cannot find the embedded model's GGUF:\n{done.stderr[-2000:]}")
    return done.stdout.strip().splitlines()[-1]


def open_model(path: str, threads: int, n_seq: int = 8, n_ctx: int = 1024):
    """n_seq, n_ctx: the context's sequences and KV cells (llama.cpp allocates and clears all of
    them up front, so a light run that counts them would count prefill 512's and batch 8's)."""
    import llama_cpp as lc

    lc.llama_backend_init()
    mparams = lc.llama_model_default_params()
    model = lc.llama_model_load_from_file(path.encode(), mparams)
    cparams = lc.llama_context_default_params()
    cparams.n_ctx, cparams.n_batch, cparams.n_ubatch = n_ctx, 512, 512
    cparams.n_seq_max = n_seq
    # One KV cache shared by the sequences: split per sequence (the default), 1024 slots give
    # each of 8 sequences 128 and the 512-token prefill fails to find room.
    cparams.kv_unified = True
    cparams.n_threads = cparams.n_threads_batch = threads
    ctx = lc.llama_init_from_model(model, cparams)
    n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(model))
    return lc, model, ctx, n_vocab


class Runner:
    def __init__(self, path: str, threads: int, n_seq: int = 8, n_ctx: int = 1024) -> None:
        self.lc, self.model, self.ctx, self.n_vocab = open_model(path, threads, n_seq, n_ctx)
        self.batch = self.lc.llama_batch_init(512, 0, n_seq)

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


def run_llama_cpp(path: str, threads: int, repeats: int, light: bool, prefill: int, prompt: int, new1: int, batch: int,
                  new8: int, prompt_ids: Callable[..., list[int]],
                  metrics: Sequence[str] = ("prefill512", "decode1", "decode8")) -> dict:
    import llama_cpp

    start = time.perf_counter()
    # light (peak RSS): a context for its one 16 + 16-token sequence, as lucidlm's light run sets
    # up a cache for just that (llama.cpp rounds the cells up to 256)
    runner = Runner(path, threads, n_seq=1, n_ctx=prompt + 16) if light else Runner(path, threads)
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
    if len(sys.argv) == 4 and sys.argv[1] == "--first-token":
        runner = Runner(sys.argv[3], int(sys.argv[2]), n_seq=1, n_ctx=8)  # the cache a 1-token answer needs
        print(runner.greedy([[504, 3575, 282, 4649, 314]], 1))
    else:
        raise SystemExit(__doc__)
