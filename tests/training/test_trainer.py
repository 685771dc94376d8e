"""The Trainer: exact resume, atomic checkpoints, refusals with clear messages, Ctrl-C, CLI."""

import argparse
import json
import os
import signal
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import lucidlm
from lucidlm.errors import CheckpointError, DataError
from lucidlm.training import TrainConfig, build_pretraining, train
from lucidlm.training import checkpoint as ckpt

SHAKESPEARE = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "tinyshakespeare.txt"


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py: tiny runs on one torch thread


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("corpus") / "shakespeare_head.txt"
    path.write_text(SHAKESPEARE.read_text()[:30000])
    return path


def tiny(corpus: Path, out: Path, **overrides) -> TrainConfig:
    settings = dict(data=str(corpus), out_dir=str(out), n_layer=2, n_head=2, n_embd=32, block_size=16,
                    batch_size=4, max_iters=12, lr_decay_iters=12, warmup_iters=3, learning_rate=1e-2, min_lr=1e-3, eval_interval=5,
                    eval_iters=2, sample_tokens=5, progress=False)
    return TrainConfig(**{**settings, **overrides})


def weights(out: Path) -> dict[str, torch.Tensor]:
    return load_file(str(out / "checkpoint" / "model.safetensors"))


@pytest.fixture(scope="module")
def full_runs(corpus, tmp_path_factory):
    """Uninterrupted 12-step runs, without and with dropout."""
    base = tmp_path_factory.mktemp("full")
    return {p: train(tiny(corpus, base / f"drop{p}", dropout=p)) for p in (0.0, 0.1)}


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_resume_is_bit_identical(corpus, tmp_path, full_runs, dropout):
    full = full_runs[dropout]
    first = train(tiny(corpus, tmp_path, dropout=dropout, max_iters=7))
    assert first.step == 7 and first.train_losses == full.train_losses[:7]
    resumed = train(tiny(corpus, tmp_path, dropout=dropout, resume=True))
    assert resumed.step == 12
    assert resumed.train_losses == full.train_losses  # exact float equality, every step
    full_weights, resumed_weights = weights(Path(full.checkpoint).parent), weights(tmp_path)
    assert all(torch.equal(full_weights[k], resumed_weights[k]) for k in full_weights)
    assert resumed.val_loss == full.val_loss
    steps = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == [0, 5, 7, 10, 12]


def test_training_lowers_loss_and_writes_outputs(full_runs):
    run = full_runs[0.0]
    out = Path(run.checkpoint).parent
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 5, 10, 12]
    for r in records:
        assert {"train_loss", "val_loss", "val_ppl", "lr", "tokens_per_s", "elapsed"} <= set(r)
    # Untrained: about log(vocab); after 12 steps clearly lower.
    vocab = lucidlm.load(str(out)).config.vocab_size
    assert abs(records[0]["val_loss"] - torch.log(torch.tensor(float(vocab))).item()) < 0.3
    assert records[-1]["val_loss"] < records[0]["val_loss"] - 0.3
    assert (out / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    state = json.loads((out / "checkpoint" / "trainer_state.json").read_text())
    assert state["step"] == 12 and len(state["train_losses"]) == 12


def test_checkpoint_loads_and_generates(full_runs):
    out = Path(full_runs[0.0].checkpoint).parent
    model = lucidlm.load(str(out))
    assert model.tokenizer is not None and model.config.max_seq_len == 16
    result = model.generate("ROMEO:", max_new_tokens=8, temperature=0)
    assert len(result.token_ids) == 8 and isinstance(result.text, str)
    # Greedy continuation computed by hand from the loaded model agrees.
    ids = model.tokenizer.encode("ROMEO:")
    with torch.no_grad():
        for _ in range(8):
            ids.append(int(model(torch.tensor([ids[-16:]]))[0, -1].argmax()))
    assert result.token_ids == ids[-8:]


def test_weight_decay_only_on_matrices(corpus, tmp_path):
    trainer = build_pretraining(tiny(corpus, tmp_path))
    decay, no_decay = trainer.optimizer.param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.dim() >= 2 for p in decay["params"]) and all(p.dim() < 2 for p in no_decay["params"])
    n_params = len(list(trainer.model.parameters()))  # tied embedding counted once
    assert len(decay["params"]) + len(no_decay["params"]) == n_params
    assert decay["betas"] == (0.9, 0.99)


def test_crash_while_saving_keeps_the_last_good_checkpoint(corpus, tmp_path, monkeypatch):
    train(tiny(corpus, tmp_path, max_iters=4))
    good = {p.name: p.read_bytes() for p in (tmp_path / "checkpoint").iterdir()}

    def half_written_then_crash(optimizer, path, *belongs):
        Path(path).write_bytes(b"\x00" * 100)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ckpt, "save_optimizer", half_written_then_crash)
    with pytest.raises(OSError, match="No space left"):
        train(tiny(corpus, tmp_path, max_iters=8, resume=True))  # its step-5 checkpoint crashes
    assert {p.name: p.read_bytes() for p in (tmp_path / "checkpoint").iterdir()} == good
    assert not list(tmp_path.glob(".checkpoint.*"))
    assert lucidlm.load(str(tmp_path)).config.d_model == 32
    monkeypatch.undo()
    resumed = train(tiny(corpus, tmp_path, max_iters=8, resume=True))
    assert resumed.step == 8


def test_crash_between_the_two_renames_is_recovered(tmp_path):
    (tmp_path / ".checkpoint.old-abc").mkdir()
    (tmp_path / ".checkpoint.old-abc" / ckpt.STATE_NAME).write_text("{}")
    assert ckpt.find_checkpoint(tmp_path) == tmp_path / "checkpoint"
    assert (tmp_path / "checkpoint" / ckpt.STATE_NAME).is_file()


def test_resume_with_different_settings_names_the_fields(corpus, tmp_path):
    train(tiny(corpus, tmp_path, max_iters=3))
    with pytest.raises(CheckpointError) as err:
        train(tiny(corpus, tmp_path, max_iters=6, resume=True, batch_size=8, n_embd=64))
    message = str(err.value)
    assert "batch_size: 4 -> 8" in message and "n_embd: 32 -> 64" in message and "max_iters" not in message


def test_existing_checkpoint_without_resume_and_resume_without_checkpoint(corpus, tmp_path):
    train(tiny(corpus, tmp_path, max_iters=2))
    with pytest.raises(CheckpointError, match="--resume"):
        train(tiny(corpus, tmp_path, max_iters=2))
    with pytest.raises(CheckpointError, match="no checkpoint"):
        train(tiny(corpus, tmp_path / "fresh", resume=True))


def test_unwritable_output_fails_before_training(corpus, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    with pytest.raises(CheckpointError, match="cannot write to the output directory"):
        train(tiny(corpus, blocker / "run"))


def test_too_small_corpus_is_refused(tmp_path):
    small = tmp_path / "small.txt"
    small.write_text("hello world " * 20)
    with pytest.raises(DataError, match="distinct batches"):
        train(tiny(small, tmp_path / "run"))


def test_ctrl_c_saves_a_checkpoint_and_resume_is_exact(corpus, tmp_path, monkeypatch, full_runs, ctrl_c_after_step):
    ctrl_c_after_step(3)
    stopped = train(tiny(corpus, tmp_path))
    assert stopped.interrupted and stopped.step == 3
    assert json.loads((tmp_path / "checkpoint" / "trainer_state.json").read_text())["step"] == 3
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # handler restored
    monkeypatch.undo()
    resumed = train(tiny(corpus, tmp_path, resume=True))
    assert resumed.train_losses == full_runs[0.0].train_losses


def test_sigterm_saves_a_checkpoint_as_ctrl_c_does(corpus, tmp_path, monkeypatch, full_runs, capsys):
    """A scheduler's preemption (SIGTERM) killed a single-process run with everything since the
    last checkpoint lost: it now stops after the step and saves, as Ctrl-C does, and the resume is
    exact (the oracle: an uninterrupted run's losses)."""
    from lucidlm.training import Trainer

    original = Trainer.train_step

    def step_then_sigterm(self):
        loss = original(self)
        if self.step == 3:
            os.kill(os.getpid(), signal.SIGTERM)  # delivered to the trainer's handler
        return loss

    monkeypatch.setattr(Trainer, "train_step", step_then_sigterm)
    stopped = train(tiny(corpus, tmp_path))
    assert stopped.interrupted and stopped.step == 3
    assert "SIGTERM: stopping after this step and saving a checkpoint" in capsys.readouterr().out
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # handler restored
    monkeypatch.undo()
    resumed = train(tiny(corpus, tmp_path, resume=True))
    assert resumed.train_losses == full_runs[0.0].train_losses


def test_cli_trains_and_the_model_generates(corpus, tmp_path, capsys):
    from lucidlm.commands import train as train_command

    parser = argparse.ArgumentParser()
    train_command.register(parser.add_subparsers())
    out = tmp_path / "cli"
    args = parser.parse_args([
        "train", "--data", str(corpus), "--out", str(out), "--n-layer", "1", "--n-head", "2", "--n-embd", "16",
        "--block-size", "16", "--batch-size", "4", "--max-iters", "6", "--eval-interval", "3", "--eval-iters", "1",
        "--warmup-iters", "2", "--lr-decay-iters", "6", "--sample-prompt", "ROMEO:", "--no-progress",
    ])
    assert args.handler(args) == 0
    printed = capsys.readouterr().out
    assert "step 6: train loss" in printed and "sample: 'ROMEO:" in printed
    model = lucidlm.load(str(out))
    assert (model.config.n_layers, model.config.d_model, model.config.n_heads) == (1, 16, 2)
    assert model.generate("ROMEO:", max_new_tokens=4, temperature=0).token_ids
    help_text = parser.format_help() + parser._subparsers._group_actions[0].choices["train"].format_help()
    for flag in ("--n-layer", "--block-size", "--gradient-accumulation-steps", "--resume", "--beta2"):
        assert flag in help_text
    assert "(default: 0.99)" in help_text  # beta2


def test_both_recipes_come_from_the_package():
    """The package docstring's finetune(FinetuneConfig(...)) works as written (finetune was the
    submodule, not callable, and FinetuneConfig was not exported)."""
    import lucidlm.training as training
    from lucidlm.training import FinetuneConfig, TrainConfig, finetune, pretrain

    assert callable(finetune) and callable(pretrain)
    assert finetune.__module__ == "lucidlm.training.finetune" and FinetuneConfig.__name__ == "FinetuneConfig"
    assert {"finetune", "FinetuneConfig", "pretrain", "TrainConfig"} <= set(training.__all__)
    assert TrainConfig is training.TrainConfig
