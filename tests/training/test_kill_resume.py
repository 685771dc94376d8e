"""kill -9 at many moments of a training run, then resume: the losses equal an uninterrupted
run's bit for bit, metrics.jsonl holds each evaluation once, and after every kill the last
checkpoint still loads (issue 13, point 4).

The runs are ``lucidlm train`` / ``lucidlm finetune`` in forked processes; each kills itself
at a named point through the ``LUCIDLM_TEST_KILL_AT=NAME:N`` seam (the Nth time it gets there)."""

from __future__ import annotations

import json
import os
import shlex
import signal
import time
import traceback
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

import lucidlm
from lucidlm import cli
from lucidlm.config import preset
from lucidlm.model.transformer import Transformer
from lucidlm.tokenizers import CharTokenizer
from lucidlm.training import TrainConfig
from lucidlm.training import checkpoint as ckpt
from lucidlm.training.config import FinetuneConfig, command_line
from lucidlm.training.kill_points import ENV
from lucidlm.weights.checkpoint import save_model

SHAKESPEARE = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "tinyshakespeare.txt"


def lucidlm_run(config, command: str, kill_at: str | None = None, **changes) -> None:
    """``lucidlm COMMAND`` with ``config``'s flags in a forked process (a fresh interpreter would
    spend seconds importing torch), killed by the seam at ``kill_at`` or finishing with status 0."""
    args = shlex.split(command_line(config, command, **changes))[1:]
    log = Path(config.out_dir).parent / f"{Path(config.out_dir).name}.log"
    pid = os.fork()
    if pid == 0:  # the child: run the CLI, and never return into pytest
        code = 1
        try:
            fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            os.environ.pop(ENV, None)
            if kill_at:
                os.environ[ENV] = kill_at
            torch.set_num_threads(1)
            code = cli.main(args)
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(code if isinstance(code, int) else 1)
    deadline = time.monotonic() + 300
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail(f"lucidlm {command} {kill_at} hung")
        time.sleep(0.02)
    output = log.read_text(errors="replace")[-3000:]
    if kill_at:
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, f"not killed at {kill_at}:\n{output}"
    else:
        assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, output


def metrics_steps(out: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def saved_state(out: Path) -> dict:
    return json.loads((out / "checkpoint" / "trainer_state.json").read_text())


def assert_checkpoint_usable(out: Path, step: int, payload: str = "model.safetensors") -> None:
    """The checkpoint a kill left is whole: trainer state, optimizer and weights all read."""
    found = ckpt.find_checkpoint(out)  # puts a checkpoint moved aside by a kill mid-swap back
    assert found is not None, "a kill left no checkpoint"
    state = ckpt.read_trainer_state(found, payload)
    assert state["step"] == step
    optimizer, metadata = ckpt.read_optimizer(found / ckpt.OPTIMIZER_NAME)
    assert metadata["step"] == str(step) and metadata["run"] == state["run"]["id"]
    assert load_file(str(found / payload))  # the weights read back


@pytest.fixture(scope="module", autouse=True)
def imported_once():
    """What a run imports lazily, imported before the forks so that no child pays for it."""
    import lucidlm.generation  # noqa: F401  (the samples)
    import lucidlm.inspect.loss_plot  # noqa: F401  (loss.png, matplotlib)
    import lucidlm.training.finetune  # noqa: F401
    import lucidlm.training.pretrain  # noqa: F401
    import tqdm.auto  # noqa: F401


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    path.write_text(SHAKESPEARE.read_text()[:2500])
    return path


def tiny(corpus: Path, out: Path) -> TrainConfig:
    return TrainConfig(data=str(corpus), out_dir=str(out), n_layer=1, n_head=2, n_embd=16, block_size=8,
                       batch_size=2, max_iters=12, lr_decay_iters=12, warmup_iters=2, eval_interval=4, eval_iters=2,
                       sample_tokens=4, dropout=0.1, log_interval=1, seed=3, progress=False)


def test_pretraining_killed_anywhere_resumes_exactly(corpus, tmp_path):
    reference = tiny(corpus, tmp_path / "reference")
    lucidlm_run(reference, "train")
    config = tiny(corpus, tmp_path / "run")
    out = Path(config.out_dir)

    lucidlm_run(config, "train", "data:1")  # preparing the data: train.bin written, meta.json not
    assert (out / "data" / "train.bin").exists() and not (out / "data" / "meta.json").exists()
    lucidlm_run(config, "train", "checkpoint:1")  # the first checkpoint: weights written, the rest not
    assert ckpt.find_checkpoint(out) is None and metrics_steps(out) == [0]
    lucidlm_run(config, "train", "step:6")  # the advised rerun (no checkpoint yet: without --resume)
    assert_checkpoint_usable(out, 4)
    assert lucidlm.load(str(out)).config.d_model == 16
    for kill_at in ("eval:1", "metrics:1", "checkpoint:1", "swap:1"):  # all at step 8
        lucidlm_run(config, "train", kill_at, resume=True)
        assert_checkpoint_usable(out, 4)
        if kill_at == "metrics:1":
            assert (out / "metrics.jsonl").read_bytes().split(b"\n")[-1].startswith(b'{"step": 8')  # torn
    lucidlm_run(config, "train", "checkpoint:2", resume=True)  # saved step 8, killed saving step 12
    assert_checkpoint_usable(out, 8)
    assert metrics_steps(out) == [0, 4, 8, 12]  # the step-12 line of the killed run, dropped on resume
    lucidlm_run(config, "train", resume=True)

    expected, resumed = saved_state(Path(reference.out_dir)), saved_state(out)
    assert resumed["step"] == 12 and len(expected["train_losses"]) == 12
    assert resumed["train_losses"] == expected["train_losses"]  # bit-identical, every step
    assert metrics_steps(out) == [0, 4, 8, 12]
    for ours, theirs in zip(*(map(json.loads, (p / "metrics.jsonl").read_text().splitlines())
                              for p in (out, Path(reference.out_dir)))):
        assert (ours["train_loss"], ours["val_loss"], ours["sample"]) == \
            (theirs["train_loss"], theirs["val_loss"], theirs["sample"])
    weights, reference_weights = (load_file(str(p / "checkpoint" / "model.safetensors"))
                                  for p in (out, Path(reference.out_dir)))
    assert all(torch.equal(weights[k], reference_weights[k]) for k in reference_weights)


ALPHABET = "abcdefghijklmnopqrstuvwxyz ?.:\n"


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """A tiny Llama-shaped model and a text corpus to LoRA-tune it on."""
    root = tmp_path_factory.mktemp("base")
    tokenizer = CharTokenizer.train(ALPHABET)
    torch.manual_seed(0)
    model = Transformer(preset("llama", vocab_size=tokenizer.vocab_size, d_model=16, n_layers=1, n_heads=2,
                               n_kv_heads=1, d_mlp=32, max_seq_len=32), tokenizer=tokenizer)
    model.reset_parameters(0.3)
    save_model(model, root / "model")
    rng = np.random.default_rng(0)
    (root / "text.txt").write_text("".join(rng.choice(list(ALPHABET[:-1]), size=1500)))
    return root


def test_lora_finetuning_killed_anywhere_resumes_exactly(base, tmp_path):
    def tuned(out: Path) -> FinetuneConfig:
        return FinetuneConfig(model=str(base / "model"), data=str(base / "text.txt"), out_dir=str(out), rank=2,
                              alpha=4.0, targets="q,v", lora_dropout=0.1, block_size=8, batch_size=2, max_iters=8,
                              warmup_iters=1, eval_interval=4, eval_iters=1, sample_tokens=3, log_interval=1,
                              progress=False)

    reference, config = tuned(tmp_path / "reference"), tuned(tmp_path / "run")
    out = Path(config.out_dir)
    lucidlm_run(reference, "finetune")
    lucidlm_run(config, "finetune", "step:6")
    assert_checkpoint_usable(out, 4, "trainable.safetensors")
    for kill_at in ("eval:1", "metrics:1", "checkpoint:1"):  # all at step 8
        lucidlm_run(config, "finetune", kill_at, resume=True)
        assert_checkpoint_usable(out, 4, "trainable.safetensors")
    lucidlm_run(config, "finetune", resume=True)
    expected, resumed = saved_state(Path(reference.out_dir)), saved_state(out)
    assert resumed["step"] == 8 and resumed["train_losses"] == expected["train_losses"]
    assert metrics_steps(out) == [0, 4, 8]
    adapter, reference_adapter = (load_file(str(p / "checkpoint" / "trainable.safetensors"))
                                  for p in (out, Path(reference.out_dir)))
    assert adapter.keys() == reference_adapter.keys()
    assert all(torch.equal(adapter[k], reference_adapter[k]) for k in adapter)
