"""The llama.cpp peer of benchmarks/ measures llama.cpp alone: its processes (load, light RSS run,
fresh first token) import neither torch nor lucidlm, and the light run's context holds the light
run's tokens, not prefill 512's and batch 8's. Checked against a stand-in ``llama_cpp`` module
that records what it is asked for, so llama-cpp-python need not be installed; nothing is timed.

(Found 2026-12: the peer looked the GGUF up through ``lucidlm.pretrained``, whose ``import torch``,
~1 s and ~190 MB, was counted as llama.cpp's load time, first token and peak RSS.)
"""

from __future__ import annotations

import json
import os
import subprocess
import time
import sys
from pathlib import Path


BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
GGUF = "/models/peer.gguf"  # never opened: the stand-in only records the path

FAKE_LLAMA_CPP = '''
import atexit, ctypes, json, os, sys

__version__ = "stand-in"
N_VOCAB = 64


def _record(**what):
    with open(os.environ["FAKE_LLAMA_LOG"], "a") as f:
        f.write(json.dumps(what) + "\\n")


atexit.register(lambda: _record(heavy=sorted(m for m in ("torch", "lucidlm") if m in sys.modules)))


class _Params:
    pass


class _Batch:
    def __init__(self, n, n_seq):
        self.token, self.pos, self.n_seq_id, self.logits = [0] * n, [0] * n, [0] * n, [False] * n
        self.seq_id = [[0] * n_seq for _ in range(n)]
        self.n_tokens = 0


_LOGITS = (ctypes.c_float * N_VOCAB)()
_LOGITS[7] = 1.0  # greedy picks token 7


def llama_backend_init(): pass
def llama_model_default_params(): return _Params()
def llama_context_default_params(): return _Params()
def llama_model_get_vocab(model): return None
def llama_vocab_n_tokens(vocab): return N_VOCAB
def llama_batch_init(n, embd, n_seq): return _Batch(n, n_seq)
def llama_get_memory(ctx): return None
def llama_memory_clear(memory, data): pass
def llama_free(ctx): pass
def llama_model_free(model): pass
def llama_get_logits_ith(ctx, i): return ctypes.cast(_LOGITS, ctypes.POINTER(ctypes.c_float))


def llama_model_load_from_file(path, params):
    _record(model=path.decode())
    return object()


def llama_init_from_model(model, c):
    _record(n_ctx=c.n_ctx, n_seq_max=c.n_seq_max, n_threads=c.n_threads, n_threads_batch=c.n_threads_batch)
    return object()


def llama_decode(ctx, batch):
    _record(tokens=batch.token[:batch.n_tokens])
    return 0
'''


def run_peer(tmp_path: Path, args: list[str]) -> list[dict]:
    fake = tmp_path / "fake"
    fake.mkdir(exist_ok=True)
    (fake / "llama_cpp.py").write_text(FAKE_LLAMA_CPP)
    log = tmp_path / "calls.jsonl"
    log.unlink(missing_ok=True)
    env = {**os.environ, "PYTHONPATH": str(fake), "FAKE_LLAMA_LOG": str(log)}
    done = subprocess.run([sys.executable, *args], env=env, cwd=BENCH, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return [json.loads(line) for line in log.read_text().splitlines()]


def merged(calls: list[dict]) -> dict:
    out: dict = {}
    for call in calls:
        out.update(call)
    return out


def test_fresh_first_token_process_is_llama_cpp_alone(tmp_path):
    calls = run_peer(tmp_path, [str(BENCH / "llama_peer.py"), "--first-token", "2", GGUF])
    seen = merged(calls)
    assert seen["model"] == GGUF
    assert seen["heavy"] == []  # no torch, no lucidlm in llama.cpp's process
    assert (seen["n_threads"], seen["n_threads_batch"]) == (2, 2)
    assert seen["n_seq_max"] == 1 and seen["n_ctx"] <= 256  # the cache a one-token answer needs


def test_light_rss_run_counts_only_its_own_tokens(tmp_path):
    sys.path.insert(0, str(BENCH))
    try:
        from bench_generation import PROMPT, prompt_ids
    finally:
        sys.path.remove(str(BENCH))
    calls = run_peer(tmp_path, [str(BENCH / "bench_generation.py"), "--child", "llama.cpp Q4_1", "--light",
                                "--threads", "2", "--repeats", "1", "--metrics", "rss", "--gguf", GGUF])
    seen = merged(calls)
    assert seen["model"] == GGUF and seen["heavy"] == []
    assert (seen["n_threads"], seen["n_threads_batch"]) == (2, 2)
    # one sequence; no more cells than the 16 + 16 tokens run (llama.cpp's own minimum is 256)
    assert seen["n_seq_max"] == 1 and seen["n_ctx"] <= 256
    fed = [c["tokens"] for c in calls if "tokens" in c]
    assert fed[0] == prompt_ids(PROMPT)  # the ids lucidlm's light run gets
    assert len(fed) == 16 and all(step == [7] for step in fed[1:])  # 16 tokens: prompt pass + 15 steps


def test_load_benchmark_process_is_llama_cpp_alone(tmp_path):
    sys.path.insert(0, str(BENCH))
    try:
        from bench_load import LLAMA
    finally:
        sys.path.remove(str(BENCH))
    calls = run_peer(tmp_path, ["-c", LLAMA.format(bench=str(BENCH), threads=2, gguf=GGUF)])
    seen = merged(calls)
    assert [c["model"] for c in calls if "model" in c] == [GGUF, GGUF]  # first load, warm load
    assert seen["heavy"] == []
    assert seen["n_seq_max"] == 1 and seen["n_ctx"] <= 256  # like lucidlm.load: no cache for batch 8


def test_fresh_first_token_processes_keep_their_bytecode(monkeypatch):
    """Both sides' fresh processes start as a user's install does: bytecode kept between runs
    (llama_cpp's comes precompiled from pip; lucidlm's must not be recompiled every run)."""
    monkeypatch.syspath_prepend(str(BENCH))
    import bench_generation

    envs = []
    monkeypatch.setenv("PYTHONDONTWRITEBYTECODE", "1")
    monkeypatch.setattr(bench_generation, "peer_gguf", lambda: GGUF)
    monkeypatch.setattr(bench_generation.subprocess, "run", lambda cmd, **kw: envs.append(kw["env"]))
    for side in ("llama.cpp Q4_1", "lucidlm default"):
        bench_generation.fresh_first_token(side, 2)
    assert len(envs) == 2 and not any("PYTHONDONTWRITEBYTECODE" in env for env in envs)


def test_results_record_when_where_and_how(monkeypatch):
    """The results files carry the commit, time and command the README quotes beside them."""
    monkeypatch.syspath_prepend(str(BENCH))
    from timing import run_record

    monkeypatch.setattr(sys, "argv", ["benchmarks/bench_generation.py", "--rounds", "3"])
    record = run_record()
    head = subprocess.run(["git", "-C", str(BENCH), "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True).stdout.strip()
    assert record["commit"] == head
    assert record["command"] == ["python", "benchmarks/bench_generation.py", "--rounds", "3"]
    assert abs(time.mktime(time.strptime(record["utc"], "%Y-%m-%d %H:%M")) - time.mktime(time.gmtime())) < 120
