"""torchrun with 2 CPU processes (gloo) trains like one process with the same global batch."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lucidlm.training import TrainConfig, train

SHAKESPEARE = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "tinyshakespeare.txt"
STEPS = 8

SETTINGS = dict(n_layer=2, n_head=2, n_embd=32, block_size=16, gradient_accumulation_steps=2, max_iters=STEPS,
                lr_decay_iters=STEPS, warmup_iters=2, learning_rate=1e-2, min_lr=1e-3, eval_interval=4, eval_iters=2,
                sample_tokens=0, progress=False)
SCRIPT = """
import sys, torch
torch.set_num_threads(1)
from lucidlm.training import TrainConfig, train
train(TrainConfig(data=sys.argv[1], out_dir=sys.argv[2], batch_size=int(sys.argv[3]), **{settings}))
""".format(settings=SETTINGS)


def losses(out: Path) -> list[float]:
    return json.loads((out / "checkpoint" / "trainer_state.json").read_text())["train_losses"]


@pytest.mark.slow  # three Python processes importing torch: ~30 s
def test_two_process_ddp_matches_single_process(tmp_path):
    corpus = tmp_path / "head.txt"
    corpus.write_text(SHAKESPEARE.read_text()[:30000])
    script = tmp_path / "train_tiny.py"
    script.write_text(SCRIPT)
    ddp_out, single_out = tmp_path / "ddp", tmp_path / "single"
    # Each of the 2 ranks takes 4 of the same 8 windows the single process draws.
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               str(script), str(corpus), str(ddp_out), "4"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("step 8: train loss") == 1  # only rank 0 logs

    subprocess.run([sys.executable, str(script), str(corpus), str(single_out), "8"], check=True, timeout=300)
    ddp_losses, single_losses = losses(ddp_out), losses(single_out)
    assert len(ddp_losses) == STEPS
    # Same data, same math; only the order of float additions differs (gradient all-reduce).
    assert ddp_losses == pytest.approx(single_losses, abs=1e-5)
    assert ddp_losses[-1] < ddp_losses[0] - 0.3
    state = json.loads((ddp_out / "checkpoint" / "trainer_state.json").read_text())
    assert state["world_size"] == 2 and len(state["torch_rng"]) == 2
    ddp_metrics = [json.loads(line) for line in (ddp_out / "metrics.jsonl").read_text().splitlines()]
    single_metrics = [json.loads(line) for line in (single_out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in ddp_metrics] == [0, 4, 8]
    assert ddp_metrics[-1]["val_loss"] == pytest.approx(single_metrics[-1]["val_loss"], abs=1e-4)

    # One process continues the 2-process run (same global batch of 8) as it continues its own.
    more, threads = {**SETTINGS, "max_iters": STEPS + 2, "eval_interval": 2}, torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for out in (ddp_out, single_out):
            train(TrainConfig(data=str(corpus), out_dir=str(out), batch_size=8, resume=True, **more))
    finally:
        torch.set_num_threads(threads)
    assert len(losses(ddp_out)) == STEPS + 2
    assert losses(ddp_out) == pytest.approx(losses(single_out), abs=1e-5)
