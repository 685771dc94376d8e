"""What a long run says while it works: evaluation progress, an ETA from training-step time
only, and a schedule that ends before its warm-up or decay does."""

import argparse
import math
import re
import types
from pathlib import Path

import pytest
import torch

import lucidlm.training.loop as loop_module
from lucidlm.training import Trainer
from lucidlm.training.callbacks import Console
from lucidlm.training.config import LoopConfig
from lucidlm.training.loop import Callback

SHAKESPEARE = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "tinyshakespeare.txt"


class Clock:
    """A fake perf_counter: only the data below moves it, by known amounts."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


class TimedData:
    """Batches of random ids; a training batch costs 1 s of the clock, an eval batch 1000 s."""

    def __init__(self, clock: Clock, vocab: int) -> None:
        self.clock, self.vocab, self.tokens_per_batch = clock, vocab, 2 * 8
        self.generator = torch.Generator().manual_seed(0)

    def batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.randint(0, self.vocab, (2, 9), generator=self.generator)
        return ids[:, :-1], ids[:, 1:]

    def next(self):
        self.clock.now += 1.0
        return self.batch()

    def prefetch(self) -> None: ...

    def eval_batches(self, split, iters):
        for _ in range(iters):
            self.clock.now += 1000.0
            yield self.batch()


class Counting(Callback):
    def __init__(self) -> None:
        self.starts, self.batches = [], 0

    def on_eval_start(self, trainer, batches):
        self.starts.append((trainer.step, batches))

    def on_eval_batch(self, trainer):
        self.batches += 1


def test_evaluation_shows_progress_and_the_eta_counts_training_steps_only(monkeypatch, capsys):
    from lucidlm.config import preset
    from lucidlm.model.transformer import Transformer

    clock = Clock()
    monkeypatch.setattr(loop_module, "time", types.SimpleNamespace(perf_counter=clock.perf_counter))
    torch.manual_seed(0)
    model = Transformer(preset("llama", vocab_size=11, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1, d_mlp=32,
                               max_seq_len=8))
    config = LoopConfig(max_iters=10, eval_interval=4, eval_iters=3, log_interval=1, warmup_iters=0,
                        lr_decay_iters=10, progress=False, sample_tokens=0)
    counting = Counting()
    trainer = Trainer(model, TimedData(clock, 11), torch.optim.AdamW(model.parameters()), config,
                      callbacks=[Console(False), counting])
    trainer.fit()
    lines = capsys.readouterr().out.splitlines()
    # Every evaluation (steps 0, 4, 8 and the final 10) announces itself before its result line.
    for step in (0, 4, 8, 10):
        said = lines.index(f"evaluating at step {step} (up to 6 batches)...")
        assert lines[said + 1].startswith(f"step {step}: train loss")
    assert counting.starts == [(0, 6), (4, 6), (8, 6), (10, 6)] and counting.batches == 4 * 6
    # Each step took 1 s and each evaluation 6000 s: the ETA is the steps left at 1 s each.
    evals = {int(m.group(1)): m.group(2) for m in (re.match(r"step (\d+): .*?(?:, eta (\S+))?$", line)
                                                   for line in lines) if m}
    assert evals == {0: None, 4: "0:06", 8: "0:02", 10: None}
    assert trainer.seconds_left() == 0.0 and trainer.steps_timed == 10


def cosine_lr(step, lr, warmup, decay, min_lr):
    """The documented schedule (nanoGPT's get_lr), written out here on its own."""
    if step < warmup:
        return lr * (step + 1) / (warmup + 1)
    ratio = (step - warmup) / (decay - warmup)
    return min_lr + (lr - min_lr) * (1 + math.cos(math.pi * ratio)) / 2


def printed_lr(line: str) -> float:
    return float(re.search(r"the last step's learning rate is (\S+) ", line).group(1))


@pytest.mark.parametrize("max_iters", [50, 100, 700])
def test_a_schedule_that_ends_early_is_warned_about(max_iters, capsys):
    from lucidlm.training.schedule import schedule_warning

    config = LoopConfig(max_iters=max_iters)  # the defaults: warm-up 100, decay to step 2000
    assert (config.warmup_iters, config.lr_decay_iters, config.learning_rate, config.min_lr) == (100, 2000, 1e-3, 1e-4)
    line = schedule_warning(config)
    expected = cosine_lr(max_iters - 1, 1e-3, 100, 2000, 1e-4)
    assert printed_lr(line) == pytest.approx(expected, rel=2e-3)
    # step 99 of a 100-step run is still the warm-up's (lr * 100 / 101): the peak comes at step 100
    where = "inside the 100-step warm-up" if max_iters <= 100 else "before the cosine decay reaches --min-lr"
    assert line.startswith(f"warning: --max-iters {max_iters} ends {where}")
    assert schedule_warning(LoopConfig(max_iters=2000)) is None
    assert schedule_warning(LoopConfig(max_iters=50, decay_lr=False)) is None
    assert schedule_warning(LoopConfig(max_iters=50, warmup_iters=5, lr_decay_iters=50)) is None


def test_cli_train_with_few_steps_warns_and_shows_evaluation(tmp_path, capsys):
    from lucidlm.commands import train as train_command

    corpus = tmp_path / "head.txt"
    corpus.write_text(SHAKESPEARE.read_text()[:20000])
    parser = argparse.ArgumentParser()
    train_command.register(parser.add_subparsers())
    args = parser.parse_args([
        "train", "--data", str(corpus), "--out", str(tmp_path / "run"), "--n-layer", "1", "--n-head", "2",
        "--n-embd", "16", "--block-size", "16", "--batch-size", "4", "--max-iters", "3", "--eval-iters", "2",
        "--sample-tokens", "0", "--no-progress"])  # the default schedule: warm-up 100, decay 2000
    assert args.handler(args) == 0
    lines = capsys.readouterr().out.splitlines()
    warning = next(line for line in lines if line.startswith("warning: --max-iters 3 ends inside the 100-step"))
    assert printed_lr(warning) == pytest.approx(1e-3 * 3 / 101, rel=2e-3)
    assert "evaluating at step 0 (up to 4 batches)..." in lines
    assert "evaluating at step 3 (up to 4 batches)..." in lines
