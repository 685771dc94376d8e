"""One LoRA training step on SmolLM2-135M: lucidlm vs transformers + peft, side by side.

Both libraries load the same GGUF (transformers dequantizes it to float32), attach LoRA
r=8, alpha=16 to q_proj and v_proj with identical A matrices (B = 0), and take AdamW steps
on the same batch of tinyshakespeare tokens. The first step's losses are compared (they
must agree: same weights, same batch), then steps alternate between the two libraries so
that machine load hits both alike; the median step time is reported. Peak memory is the
rise of the process's peak RSS during the steps, measured in a fresh process per library.

With ``--gradient-checkpointing`` both libraries recompute each block in the backward pass
(lucidlm's ``model.gradient_checkpointing``, transformers' ``gradient_checkpointing_enable``,
both torch's non-reentrant checkpoint), and the memory is measured both ways, off and on.

    python benchmarks/bench_lora_step.py [--batch-size 4] [--block-size 128] [--steps 5] [--gradient-checkpointing]

Prints a table and writes benchmarks/results/lora_step.json (lora_step_checkpointing.json).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
try:
    import lucidlm
except ImportError:  # a checkout without `pip install -e .`
    sys.path.insert(0, str(ROOT / "src"))
    import lucidlm
from lucidlm.peft import add_lora, lora_layers  # noqa: E402

CORPUS = ROOT.parent / "shared" / "data" / "tinyshakespeare.txt"
RESULTS = ROOT / "benchmarks" / "results" / "lora_step.json"
RESULTS_CHECKPOINTING = RESULTS.with_name("lora_step_checkpointing.json")
R, ALPHA, TARGETS, LR = 8, 16, ("q_proj", "v_proj"), 1e-3


def find_smollm2_gguf() -> Path:
    from lucidlm.pretrained import find_gguf
    return Path(find_gguf("smollm2-135m"))


def make_batch(tokenizer, batch_size: int, block_size: int) -> torch.Tensor:
    ids = tokenizer.encode(CORPUS.read_text()[:200_000])
    g = torch.Generator().manual_seed(0)
    starts = torch.randint(0, len(ids) - block_size - 1, (batch_size,), generator=g).tolist()
    return torch.tensor([ids[s:s + block_size + 1] for s in starts])  # (B, T+1)


# ------------------------------------------------------------------------------- the two sides

def build_ours(checkpointing: bool = False):
    model = lucidlm.load("smollm2-135m", dtype=torch.float32)  # float: the quantized default cannot train
    add_lora(model, r=R, alpha=ALPHA, targets=TARGETS, dropout=0.0)
    model.gradient_checkpointing = checkpointing
    model.train()
    return model


def build_theirs(checkpointing: bool = False):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    path = find_smollm2_gguf()
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    model = get_peft_model(model, LoraConfig(r=R, lora_alpha=ALPHA, target_modules=list(TARGETS), lora_dropout=0.0,
                                             task_type="CAUSAL_LM"))
    if checkpointing:  # non-reentrant, as lucidlm's (the reentrant one needs inputs that require grad under peft)
        kwargs = {"use_reentrant": False}
        if hasattr(model, "activation_checkpointing_enable"):  # transformers 5's name
            model.activation_checkpointing_enable(kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    model.train()
    return model


def copy_lora_a(ours, theirs) -> None:
    """The same random A in both: the steps then do exactly the same arithmetic."""
    their_modules = dict(theirs.named_modules())
    with torch.no_grad():
        for name, layer in lora_layers(ours):
            i, kind, proj = name.split(".")[1], name.split(".")[2], name.split(".")[3]
            hf = f"base_model.model.model.layers.{i}.{'self_attn' if kind == 'attn' else 'mlp'}.{proj}"
            their_modules[hf].lora_A["default"].weight.copy_(layer.lora_A["default"])


def ours_loss(model, batch):
    logits = model(batch[:, :-1])  # (B, T, V)
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())


def theirs_loss(model, batch):
    logits = model(input_ids=batch[:, :-1]).logits
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())


def stepper(model, loss_fn, batch):
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, weight_decay=0.0)

    def step() -> tuple[float, float]:
        start = time.perf_counter()
        loss = loss_fn(model, batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return time.perf_counter() - start, loss.item()

    return step


# ------------------------------------------------------------------------------- memory (own process)

def peak_rss_rise(side: str, batch_file: str, steps: int, checkpointing: bool = False) -> float:
    """MiB the peak RSS rises while taking ``steps`` steps, after loading (Linux only). The
    process loads nothing but its own model, and the heap's free pages go back to the OS
    before the counter is reset: memory a loader freed but glibc kept resident would
    otherwise serve the steps' first allocations unseen, and the rise would measure the
    loader (lucidlm at 297ab9b: 573-597 MiB untrimmed, 1057-1060 trimmed; 2026-12-07)."""
    from safetensors.torch import load_file

    from lucidlm.host_memory import trim

    model = build_ours(checkpointing) if side == "ours" else build_theirs(checkpointing)
    batch = load_file(batch_file)["batch"]
    step = stepper(model, ours_loss if side == "ours" else theirs_loss, batch)
    import gc
    gc.collect()
    trim()
    Path("/proc/self/clear_refs").write_text("5")  # reset the peak-RSS counter (VmHWM) to now
    before = _status_kib("VmRSS")
    for _ in range(steps):
        step()
    return (_status_kib("VmHWM") - before) / 1024


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def measure_memory(side: str, batch: torch.Tensor, checkpointing: bool = False) -> float | None:
    if not Path("/proc/self/clear_refs").exists():
        return None
    import tempfile

    from safetensors.torch import save_file

    with tempfile.TemporaryDirectory() as tmp:
        batch_file = str(Path(tmp) / "batch.safetensors")
        save_file({"batch": batch.contiguous()}, batch_file)
        cmd = [sys.executable, __file__, "--memory-of", side, "--batch-file", batch_file, "--memory-steps", "2",
               *(["--gradient-checkpointing"] if checkpointing else [])]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    return float(out.strip().splitlines()[-1])


# ------------------------------------------------------------------------------- main

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per library (after 1 warmup)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--memory-of", choices=("ours", "theirs"), help=argparse.SUPPRESS)
    parser.add_argument("--memory-steps", type=int, default=2, help=argparse.SUPPRESS)
    parser.add_argument("--batch-file", help=argparse.SUPPRESS)
    parser.add_argument("--no-memory", action="store_true", help="skip the per-process memory measurement")
    parser.add_argument("--gradient-checkpointing", action="store_true",
                        help="both libraries recompute each block in the backward pass; memory measured off and on")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.memory_of:
        print(peak_rss_rise(args.memory_of, args.batch_file, args.memory_steps, args.gradient_checkpointing))
        return

    import peft
    import transformers

    torch.manual_seed(0)
    checkpointing = args.gradient_checkpointing
    ours = build_ours(checkpointing)
    theirs = build_theirs(checkpointing)
    copy_lora_a(ours, theirs)
    batch = make_batch(ours.tokenizer, args.batch_size, args.block_size)
    steps = {"lucidlm": stepper(ours, ours_loss, batch), "transformers+peft": stepper(theirs, theirs_loss, batch)}
    if checkpointing:  # what the recompute costs, timed in the same alternation
        plain = build_ours()
        plain.load_state_dict(ours.state_dict())  # the same A (add_lora drew another)
        steps["lucidlm, no checkpointing"] = stepper(plain, ours_loss, batch)

    first = {name: step() for name, step in steps.items()}  # warmup, and the parity check
    loss_gap = abs(first["lucidlm"][1] - first["transformers+peft"][1])
    times: dict[str, list[float]] = {name: [] for name in steps}
    losses: dict[str, list[float]] = {name: [first[name][1]] for name in steps}
    for _ in range(args.steps):
        for name, step in steps.items():  # alternate, so a burst of machine load hits both
            seconds, loss = step()
            times[name].append(seconds)
            losses[name].append(loss)
    del ours, theirs, steps
    plain = None
    memory = {"lucidlm": None, "transformers+peft": None}
    memory_off = dict(memory)  # with --gradient-checkpointing: the same steps without it, for the saving
    if not args.no_memory:
        memory = {"lucidlm": measure_memory("ours", batch, checkpointing),
                  "transformers+peft": measure_memory("theirs", batch, checkpointing)}
        if checkpointing:
            memory_off = {"lucidlm": measure_memory("ours", batch), "transformers+peft": measure_memory("theirs", batch)}

    median = {name: statistics.median(t) for name, t in times.items()}
    ratio = median["lucidlm"] / median["transformers+peft"]
    tokens = args.batch_size * args.block_size
    print(f"\nLoRA step on SmolLM2-135M (r={R}, alpha={ALPHA}, {'+'.join(TARGETS)}), batch {args.batch_size} x "
          f"{args.block_size} tokens, fp32 CPU, {torch.get_num_threads()} threads"
          f"{', gradient checkpointing on both' if checkpointing else ''}")
    print(f"{'library':<26} {'median step (s)':>16} {'tokens/s':>10} {'peak RSS rise (MiB)':>20} {'loss after':>11}")
    for name in times:
        mem = f"{memory[name]:.0f}" if memory.get(name) is not None else "n/a"
        print(f"{name:<26} {median[name]:>16.3f} {tokens / median[name]:>10.0f} {mem:>20} {losses[name][-1]:>11.4f}")
    print(f"time ratio lucidlm / transformers+peft: {ratio:.2f}x (goal <= 1.0x); first-step loss gap {loss_gap:.2e}")
    if checkpointing:
        print(f"lucidlm's step with checkpointing / without: {median['lucidlm'] / median['lucidlm, no checkpointing']:.2f}x")
    if memory["lucidlm"] is not None and memory["transformers+peft"]:
        print(f"peak RSS rise ratio lucidlm / transformers+peft: {memory['lucidlm'] / memory['transformers+peft']:.2f}x")
    for name, off in memory_off.items():
        if off is not None:
            print(f"{name}: peak RSS rise {off:.0f} MiB without checkpointing -> {memory[name]:.0f} MiB with it "
                  f"({memory[name] / off:.2f}x)")

    results = RESULTS_CHECKPOINTING if checkpointing else RESULTS
    results.parent.mkdir(parents=True, exist_ok=True)
    results.write_text(json.dumps({
        "benchmark": "lora_step", "model": "SmolLM2-135M-Instruct (Q4_1 GGUF dequantized to fp32)",
        "gradient_checkpointing": checkpointing, "peak_rss_rise_mib_without_checkpointing": memory_off,
        "command": " ".join(["python", "benchmarks/bench_lora_step.py", *sys.argv[1:]]),
        "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
        "lora": {"r": R, "alpha": ALPHA, "targets": list(TARGETS), "dropout": 0.0},
        "batch_size": args.batch_size, "block_size": args.block_size, "timed_steps": args.steps,
        "median_step_s": median, "all_step_s": times, "tokens_per_s": {k: tokens / v for k, v in median.items()},
        "peak_rss_rise_mib": memory, "losses": losses, "first_step_loss_gap": loss_gap,
        "time_ratio_lucidlm_over_peer": ratio,
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__, "peft": peft.__version__,
                     "lucidlm": lucidlm.__version__},
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "threads": torch.get_num_threads(),
                    "load_average_1m": os.getloadavg()[0]},
    }, indent=2) + "\n")
    print(f"wrote {results}")


if __name__ == "__main__":
    main()
