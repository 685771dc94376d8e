"""lucidlm's training loop against nanoGPT's own, unmodified ``train.py``, side by side.

nanoGPT (MIT, ``../shared/peers/nanoGPT``) runs as a subprocess from a temporary copy whose
``data/shakespeare_char`` holds train.bin / val.bin / meta.pkl written here exactly as its
``prepare.py`` would (character ids, first 90% trains) from ``../shared/data/tinyshakespeare.txt``
(no download). lucidlm trains the same model on the same tokens in another subprocess.
The runs alternate (nanoGPT, lucidlm, nanoGPT, ...) so both see the same machine load.

Compared: milliseconds per training iteration, excluding every log window that contains
an evaluation and the first 10 iterations (warm-up, compilation). Both are timed the same
way: wall-clock time between two loss read-backs (nanoGPT's ``iter N: loss`` lines, as
they arrive; lucidlm's ``on_log`` callback), divided by the iterations in between.

    python benchmarks/bench_train_shakespeare.py --config cpu     # nanoGPT README's CPU run
    python benchmarks/bench_train_shakespeare.py --config gpu     # train_shakespeare_char.py, bf16, compile
    python benchmarks/bench_train_shakespeare.py --config gpu --variants eager,compile,reduce-overhead

Prints a table and writes benchmarks/results/train_shakespeare_{cpu,gpu}.json.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("LUCIDLM_SHARED", ROOT.parent / "shared"))  # a copy travels to the GPU machine
NANOGPT = SHARED / "peers" / "nanoGPT"
CORPUS = SHARED / "data" / "tinyshakespeare.txt"
WARMUP = 10

# nanoGPT README's CPU command; the GPU config is config/train_shakespeare_char.py as it is.
CONFIGS = {
    "cpu": dict(device="cpu", compile=False, eval_iters=20, log_interval=1, block_size=64, batch_size=12, n_layer=4,
                n_head=4, n_embd=128, max_iters=2000, lr_decay_iters=2000, dropout=0.0, eval_interval=250),
    "gpu": dict(device="cuda", compile=True, eval_iters=20, log_interval=10, block_size=256, batch_size=64, n_layer=6,
                n_head=6, n_embd=384, max_iters=5000, lr_decay_iters=5000, dropout=0.2, eval_interval=250),
}


def prepare_nanogpt(workdir: Path) -> Path:
    """A copy of nanoGPT with its shakespeare_char data written as prepare.py writes it."""
    import numpy as np

    target = workdir / "nanoGPT"
    shutil.copytree(NANOGPT, target)
    data = CORPUS.read_text()
    chars = sorted(set(data))
    stoi = {c: i for i, c in enumerate(chars)}
    n = len(data)
    folder = target / "data" / "shakespeare_char"
    np.array([stoi[c] for c in data[: int(n * 0.9)]], dtype=np.uint16).tofile(folder / "train.bin")
    np.array([stoi[c] for c in data[int(n * 0.9):]], dtype=np.uint16).tofile(folder / "val.bin")
    with open(folder / "meta.pkl", "wb") as f:  # nanoGPT reads its vocab size from this file
        pickle.dump({"vocab_size": len(chars), "itos": dict(enumerate(chars)), "stoi": stoi}, f)
    return target


def run_nanogpt(copy: Path, cfg: dict, env: dict) -> dict:
    """nanoGPT's train.py as it is. Its printed ``time`` is one iteration's host time, taken
    before that iteration's ``loss.item()`` waits for the GPU; so iteration time is taken
    instead from when each log line arrives (printed right after that wait), the same
    clock as lucidlm's windows."""
    flags = [f"--{k}={v}" for k, v in cfg.items() if k not in ("compile_mode", "dtype")] + [f"--out_dir={copy / 'out'}"]
    proc = subprocess.Popen([sys.executable, "train.py", "config/train_shakespeare_char.py", *flags], cwd=copy,
                            env={**env, "PYTHONUNBUFFERED": "1"}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    lines = [(time.perf_counter(), line) for line in proc.stdout]
    stderr = proc.stderr.read()
    if proc.wait() != 0:
        raise SystemExit(f"nanoGPT failed:\n{stderr[-3000:]}")
    stamps = [(int(m[1]), t) for t, line in lines if (m := re.match(r"iter (\d+): loss", line))]
    per_iter = []
    for (start, t0), (end, t1) in zip(stamps, stamps[1:]):
        # The evaluation at iteration e runs before e's step, inside the window ending at e.
        if start >= WARMUP and end % cfg["eval_interval"] != 0:
            per_iter += [1000 * (t1 - t0) / (end - start)] * (end - start)
    vals = re.findall(r"step (\d+): train loss ([\d.]+), val loss ([\d.]+)", "".join(line for _, line in lines))
    return {"ms_per_iter": statistics.mean(per_iter), "median_ms": statistics.median(per_iter),
            "iters_timed": len(per_iter), "val_loss": float(vals[-1][2]) if vals else None}


# name: (compile, compile mode, lucidlm --dtype). "auto" is float32 on CPU (nanoGPT's precision
# there: its train.py never autocasts on CPU) and bf16 autocast on CUDA (as nanoGPT's GPU config).
VARIANTS = {"eager": (False, "default", "auto"), "compile": (True, "default", "auto"),
            "reduce-overhead": (True, "reduce-overhead", "auto"), "max-autotune": (True, "max-autotune", "auto"),
            "bf16": (False, "default", "bfloat16"), "bf16-compile": (True, "default", "bfloat16")}


def run_lucidlm(cfg: dict, env: dict, workdir: Path, variant: str) -> dict:
    out = Path(tempfile.mkdtemp(dir=workdir))
    compile, mode, dtype = VARIANTS[variant]
    args = [sys.executable, __file__, "--worker",
            json.dumps({**cfg, "compile": compile, "compile_mode": mode, "dtype": dtype}),
            "--out", str(out)]
    done = subprocess.run(args, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"lucidlm failed:\n{done.stderr[-3000:]}")
    report = json.loads((out / "bench_times.json").read_text())
    per_iter = [ms / steps for start, steps, ms in report["windows"] if start >= WARMUP for _ in range(steps)]
    return {"ms_per_iter": statistics.mean(per_iter), "median_ms": statistics.median(per_iter),
            "iters_timed": len(per_iter), "val_loss": report["val_loss"]}


def worker(cfg: dict, out: Path) -> None:
    """One lucidlm run with nanoGPT's settings; writes the step time of every log window."""
    sys.path.insert(0, str(ROOT / "src"))
    import torch

    from lucidlm.training import Callback, TrainConfig, pretrain

    class Windows(Callback):
        def __init__(self) -> None:
            self.windows, self.last = [], None  # (first step, steps, ms) of each timed window

        def on_log(self, trainer, losses) -> None:  # losses are read back here: the device is idle
            now = time.perf_counter()
            if self.last is not None:
                start, then = self.last
                self.windows.append((start, trainer.step - start, 1000 * (now - then)))
            self.last = (trainer.step, now)

        def on_evaluate(self, trainer, record) -> None:
            self.last = None  # the window with the evaluation is not timed

    if cfg["device"] == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True  # as nanoGPT's train.py sets
        torch.backends.cudnn.allow_tf32 = True
    windows = Windows()
    result = pretrain(TrainConfig(
        data=str(CORPUS), out_dir=str(out), tokenizer="char", preset="shakespeare-char", n_layer=cfg["n_layer"],
        n_head=cfg["n_head"], n_embd=cfg["n_embd"], block_size=cfg["block_size"], batch_size=cfg["batch_size"],
        learning_rate=1e-3, min_lr=1e-4, max_iters=cfg["max_iters"], lr_decay_iters=cfg["lr_decay_iters"],
        warmup_iters=100, beta2=0.99, weight_decay=0.1, grad_clip=1.0, dropout=cfg["dropout"],
        eval_interval=cfg["eval_interval"], eval_iters=cfg["eval_iters"], log_interval=cfg["log_interval"],
        sample_tokens=0, progress=False, device=cfg["device"], compile=cfg["compile"],
        compile_mode=cfg["compile_mode"], dtype=cfg["dtype"]), callbacks=[windows])
    (out / "bench_times.json").write_text(json.dumps({"windows": windows.windows, "val_loss": result.val_loss}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", choices=sorted(CONFIGS), default="cpu")
    parser.add_argument("--max-iters", type=int, default=None, help="override both runs' max_iters")
    parser.add_argument("--rounds", type=int, default=1, help="alternating nanoGPT/lucidlm pairs (default: 1)")
    parser.add_argument("--threads", type=int, default=None, help="OMP_NUM_THREADS for both (default: as is)")
    parser.add_argument("--variants", default=None,
                        help=f"comma-separated lucidlm variants from {', '.join(VARIANTS)} (default: eager,compile "
                             f"on cpu, compile,reduce-overhead on gpu)")
    parser.add_argument("--results", default=None, help="write the JSON here (default: benchmarks/results/)")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(json.loads(args.worker), Path(args.out))
        return
    cfg = dict(CONFIGS[args.config])
    if args.max_iters:
        cfg["max_iters"] = args.max_iters
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    if args.threads:
        env["OMP_NUM_THREADS"] = str(args.threads)
    variants = (args.variants or ("compile,reduce-overhead" if args.config == "gpu" else "eager,compile")).split(",")
    runs: dict[str, list[dict]] = {"nanoGPT": [], **{f"lucidlm {v}": [] for v in variants}}
    with tempfile.TemporaryDirectory() as tmp:
        copy = prepare_nanogpt(Path(tmp))
        for _ in range(args.rounds):
            runs["nanoGPT"].append(run_nanogpt(copy, cfg, env))
            for v in variants:
                runs[f"lucidlm {v}"].append(run_lucidlm(cfg, env, Path(tmp), v))
    nano_ms = statistics.mean(r["ms_per_iter"] for r in runs["nanoGPT"])
    tokens = cfg["batch_size"] * cfg["block_size"]
    rows, summary = [], {}
    for name, results in runs.items():
        ms = statistics.mean(r["ms_per_iter"] for r in results)
        summary[name] = {"ms_per_iter": ms, "tokens_per_s": tokens / ms * 1000, "speedup_vs_nanogpt": nano_ms / ms,
                         "val_loss": [r["val_loss"] for r in results], "runs": results}
        val = results[-1]["val_loss"]
        rows.append((name, f"{ms:.2f}", f"{tokens / ms * 1000:,.0f}", f"{nano_ms / ms:.2f}x",
                     f"{val:.4f}" if val is not None else "-"))
    header = ("run", "ms/iter", "tokens/s", "vs nanoGPT", "final val loss")
    widths = [max(len(str(r[i])) for r in rows + [header]) for i in range(len(header))]
    for row in [header] + rows:
        print("  ".join(str(c).ljust(w) for c, w in zip(row, widths)))
    import torch

    device = torch.cuda.get_device_name(0) if args.config == "gpu" and torch.cuda.is_available() else \
        f"{os.cpu_count()} CPU cores ({platform.processor() or platform.machine()})"
    report = {"benchmark": f"train_shakespeare_char_{args.config}", "date": time.strftime("%Y-%m-%d"),
              "device": device, "config": cfg, "rounds": args.rounds, "threads": args.threads,
              "torch": torch.__version__, "load_avg_1m": os.getloadavg()[0],
              "timing": f"mean ms per iteration, excluding evaluation iterations and the first {WARMUP}", **summary}
    path = Path(args.results) if args.results else ROOT / "benchmarks" / "results" / f"train_shakespeare_{args.config}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
