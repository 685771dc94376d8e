"""nanoGPT's documented CPU run of shakespeare-char, trained with lucidlm.

    python train.py config/train_shakespeare_char.py --device=cpu --compile=False --eval_iters=20
      --log_interval=1 --block_size=64 --batch_size=12 --n_layer=4 --n_head=4 --n_embd=128
      --max_iters=2000 --lr_decay_iters=2000 --dropout=0.0

nanoGPT reports val loss 1.88 for it; on this machine kind (2 CPU cores) nanoGPT took 55 s.
Those two numbers are quoted, not re-measured (nanoGPT is not a package). What is measured
side by side in this run: the milliseconds per optimizer step of lucidlm's model and of
Hugging Face's GPT2LMHeadModel of the same shape, in one identical plain training loop
(same batches, AdamW, fp32), so the step cost of the model code itself can be compared.

    python benchmarks/bench_train_shakespeare.py [--threads 2] [--max-iters 2000] [--peer-steps 100]

Prints a table and writes benchmarks/results/train_shakespeare.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
try:
    import lucidlm  # noqa: F401
except ImportError:  # running from a checkout without `pip install -e .`
    sys.path.insert(0, str(ROOT / "src"))

import torch

from lucidlm.training import TrainConfig, Trainer, get_batch, masked_cross_entropy

CORPUS = ROOT.parent / "shared" / "data" / "tinyshakespeare.txt"
RESULTS = ROOT / "benchmarks" / "results" / "train_shakespeare.json"
NANOGPT_VAL_LOSS = 1.88  # nanoGPT README, this exact command
NANOGPT_SECONDS = 55.0  # nanoGPT's own wall time for it on this machine kind (2 CPU cores)


def nanogpt_config(out_dir: str, max_iters: int) -> TrainConfig:
    return TrainConfig(
        data=str(CORPUS), out_dir=out_dir, tokenizer="char", preset="shakespeare-char", n_layer=4, n_head=4,
        n_embd=128, block_size=64, batch_size=12, learning_rate=1e-3, min_lr=1e-4, max_iters=max_iters,
        lr_decay_iters=2000, warmup_iters=100, beta2=0.99, weight_decay=0.1, grad_clip=1.0, dropout=0.0,
        eval_interval=250, eval_iters=20, final_eval_iters=200, sample_tokens=0, progress=False,
    )


def step_ms(model: torch.nn.Module, data, steps: int, forward) -> float:
    """Median ms per optimizer step in a plain loop: batch, forward, loss, backward, clip, AdamW."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.99), weight_decay=0.1)
    generator = torch.Generator().manual_seed(0)
    times = []
    for _ in range(steps + 5):
        start = time.perf_counter()
        x, y = get_batch(data, 12, 64, generator)
        loss = masked_cross_entropy(forward(model, x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
    times = sorted(times[5:])  # first steps warm up allocators
    return 1000 * times[len(times) // 2]


def hf_gpt2(vocab_size: int) -> torch.nn.Module:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=vocab_size, n_positions=64, n_embd=128, n_layer=4, n_head=4,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, activation_function="gelu")
    return GPT2LMHeadModel(config).train()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(),
                        help="torch CPU threads (default: %(default)s)")
    parser.add_argument("--max-iters", type=int, default=2000, help="training steps (default: %(default)s)")
    parser.add_argument("--peer-steps", type=int, default=100,
                        help="steps timed per model in the side-by-side loop (0 skips it) (default: %(default)s)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    with tempfile.TemporaryDirectory() as out:
        trainer = Trainer(nanogpt_config(out, args.max_iters))
        start = time.perf_counter()
        result = trainer.fit()
        wall = time.perf_counter() - start
        tokens = result.step * trainer.tokens_per_step
        data, vocab = trainer.data.train, trainer.model_config.vocab_size

    rows = [("lucidlm (full run)", f"{wall:.1f}", f"{result.val_loss:.4f}", f"{tokens / wall:,.0f}", "")]
    rows.append(("nanoGPT (quoted)", f"{NANOGPT_SECONDS:.1f}", f"{NANOGPT_VAL_LOSS:.2f}",
                 f"{2000 * 12 * 64 / NANOGPT_SECONDS:,.0f}", ""))
    peer = {}
    if args.peer_steps > 0:
        from lucidlm.config import preset
        from lucidlm.model import Transformer

        torch.manual_seed(0)
        ours = Transformer(preset("shakespeare-char", vocab_size=vocab)).train()
        peer["lucidlm_step_ms"] = step_ms(ours, data, args.peer_steps, lambda m, x: m(x))
        peer["hf_gpt2_step_ms"] = step_ms(hf_gpt2(vocab), data, args.peer_steps, lambda m, x: m(x).logits)
        rows.append(("step loop: lucidlm", "", "", f"{12 * 64 / peer['lucidlm_step_ms'] * 1000:,.0f}",
                     f"{peer['lucidlm_step_ms']:.1f}"))
        rows.append(("step loop: HF GPT2LMHeadModel", "", "", f"{12 * 64 / peer['hf_gpt2_step_ms'] * 1000:,.0f}",
                     f"{peer['hf_gpt2_step_ms']:.1f}"))

    header = ("run", "wall s", "val loss", "tokens/s", "ms/step")
    widths = [max(len(str(r[i])) for r in rows + [header]) for i in range(len(header))]
    for row in [header] + rows:
        print("  ".join(str(c).ljust(w) for c, w in zip(row, widths)))

    report = {
        "benchmark": "train_shakespeare_char_cpu",
        "config": "nanoGPT CPU run: 4 layers, 4 heads, 128 wide, block 64, batch 12, lr 1e-3 -> 1e-4, 2000 steps",
        "max_iters": result.step,
        "wall_seconds": wall,
        "final_val_loss": result.val_loss,
        "final_train_loss": result.train_loss,
        "final_eval_iters": 200,
        "tokens_per_s": tokens / wall,
        "nanogpt_reported_val_loss": NANOGPT_VAL_LOSS,
        "nanogpt_seconds_this_machine_kind": NANOGPT_SECONDS,
        **peer,
        "peer_steps": args.peer_steps,
        "threads": args.threads,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__,
                    "load_avg_1m": os.getloadavg()[0]},
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
