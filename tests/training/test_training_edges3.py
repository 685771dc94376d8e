"""Edges of the training engine (bug hunt round 3): every step's loss reaches ``on_log`` and the
bar, a batch larger than the examples, the fused-AdamW choice of a resume, splits with no
token to count, a resume that changes the step count, and a window longer than the context.

References are written by hand here: ``F.cross_entropy(ignore_index=-100)``, nanoGPT's cosine
formula, ``torch.optim.AdamW``'s own defaults."""

import json
import math
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from lucidlm.config import preset
from lucidlm.errors import DataError
from lucidlm.model.transformer import Transformer
from lucidlm.tokenizers import CharTokenizer
from lucidlm.training import FinetuneConfig, TrainConfig
from lucidlm.training.callbacks import Console
from lucidlm.training.examples import Examples, split_examples
from lucidlm.training.finetune import build_finetuning, finetune
from lucidlm.training.loop import Callback, Trainer
from lucidlm.training.pretrain import build_pretraining, pretrain
from lucidlm.weights.checkpoint import save_model
from test_training_edges import corpus  # a tinyshakespeare slice as a file

pytestmark = pytest.mark.usefixtures("one_thread")

IGNORE = -100


def base_model(root: Path, context: int = 48) -> Path:
    """A tiny LLaMA-shaped base with a character vocabulary, saved as a lucidlm directory."""
    tokenizer = CharTokenizer.train("abcdefghijklmnopqrstuvwxyz ?.:\n")
    torch.manual_seed(0)
    model = Transformer(preset("llama", vocab_size=tokenizer.vocab_size, d_model=32, n_layers=1, n_heads=4,
                               n_kv_heads=2, d_mlp=64, max_seq_len=context), tokenizer=tokenizer)
    model.reset_parameters(0.3)
    save_model(model, root / "base")
    return root / "base"


def jsonl(path: Path, pairs) -> Path:
    path.write_text("".join(json.dumps({"prompt": p, "completion": c}) + "\n" for p, c in pairs))
    return path


def masked_mean_loss(model: torch.nn.Module, ids: torch.Tensor, targets: torch.Tensor) -> float:
    """The reference: PyTorch's mean over every target that is not -100, each example counted once."""
    with torch.no_grad():
        logits = model(ids)  # (N, L, V)
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE).item()


# ----------------------------------------------------------------------------- on_log and the bar

class Recorder(Callback):
    def __init__(self) -> None:
        self.logged: list[float] = []

    def on_log(self, trainer, losses):
        self.logged += losses


@pytest.mark.parametrize("max_iters, eval_interval, log_interval", [(12, 5, 4), (13, 250, 10)])
def test_every_step_loss_reaches_on_log_and_the_bar(tmp_path, monkeypatch, max_iters, eval_interval, log_interval):
    """An evaluation (or checkpoint) reads pending losses back first; they still go to on_log."""
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)  # the Console draws its bar
    recorder = Recorder()
    trainer = build_pretraining(TrainConfig(
        data=str(corpus(tmp_path, 40000)), out_dir=str(tmp_path / "out"), n_layer=1, n_embd=32, n_head=2,
        block_size=16, batch_size=4, max_iters=max_iters, eval_interval=eval_interval, log_interval=log_interval,
        eval_iters=1, sample_tokens=0, warmup_iters=2, lr_decay_iters=max_iters), callbacks=[recorder])
    console = next(c for c in trainer.callbacks if isinstance(c, Console))
    result = trainer.fit()
    assert console.bar.n == max_iters  # was 9 of 12, and 10 of 13 with the default intervals
    assert len(recorder.logged) == max_iters
    assert recorder.logged == result.train_losses


# ----------------------------------------------------------------------------- a batch larger than the data

def test_a_batch_larger_than_the_examples_counts_each_example_once(tmp_path, capsys):
    base = base_model(tmp_path)
    data = jsonl(tmp_path / "d.jsonl", [("q?", c) for c in (" ab.", " yyyyyyyyyyyyyyyyyy.", " cd e.", " zz.")])
    trainer = build_finetuning(FinetuneConfig(
        model=str(base), data=str(data), out_dir=str(tmp_path / "out"), method="full", batch_size=8, epochs=1,
        warmup_iters=0, eval_interval=100, eval_iters=1, sample_tokens=0, mask_prompt=True, progress=False,
        val_fraction=0.25))
    assert "--batch-size 3" in capsys.readouterr().out  # the one-line warning names what runs
    ids, targets = trainer.data.splits["train"]  # (3, L) each
    assert trainer.config.max_iters == 1  # --epochs 1: one pass, one step
    assert trainer.config.batch_size == 3  # recorded as run
    x, y, share = trainer.data.next()
    assert len(x) == 3
    rows = sorted(next(i for i in range(len(ids)) if torch.equal(ids[i], r)) for r in x)
    assert rows == [0, 1, 2]  # was [1, 0, 2, 1, 0, 2, 1, 0]
    model = trainer.model.eval()
    step_loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten(), ignore_index=IGNORE).item()
    assert step_loss == pytest.approx(masked_mean_loss(model, ids, targets), rel=1e-6)  # 5.584041, was 5.573588


def test_accumulation_over_the_examples_makes_epochs_1_one_pass(tmp_path):
    """3 examples, batch 1, accumulation 5: the step took 5 rows, 2 of them from epoch 2."""
    base = base_model(tmp_path)
    data = jsonl(tmp_path / "d.jsonl", [("q?", c) for c in (" ab.", " yyyyyyyy.", " cd e.", " zz.")])
    trainer = build_finetuning(FinetuneConfig(
        model=str(base), data=str(data), out_dir=str(tmp_path / "out"), method="full", batch_size=1,
        gradient_accumulation_steps=5, epochs=1, warmup_iters=0, eval_interval=100, eval_iters=1, sample_tokens=0,
        mask_prompt=True, progress=False, val_fraction=0.25, grad_clip=0.0))
    ids, targets = trainer.data.splits["train"]
    assert (trainer.config.gradient_accumulation_steps, trainer.config.max_iters) == (3, 1)
    model = trainer.model
    reference = masked_mean_loss(model.eval(), ids, targets)  # before the step changes the weights
    drawn = []
    real_next = trainer.data.next

    def recording_next():
        x, y, share = real_next()
        drawn.extend(next(i for i in range(len(ids)) if torch.equal(ids[i], r)) for r in x)
        return x, y, share

    trainer.data.next = recording_next
    step_loss = trainer.train_step().item()  # the share-weighted sum over the step's micro-batches
    assert sorted(drawn) == [0, 1, 2]
    assert step_loss == pytest.approx(reference, rel=1e-5)


def test_fewer_examples_than_processes_is_refused():
    from lucidlm.training.batches import fit_batch_to_examples

    assert fit_batch_to_examples(3, 8, 1, 1) == (3, 1)
    assert fit_batch_to_examples(10, 4, 4, 1) == (4, 2)
    assert fit_batch_to_examples(10, 4, 1, 2) == (4, 1)
    with pytest.raises(DataError, match="fewer than the 4 processes"):
        fit_batch_to_examples(3, 1, 1, 4)


# ----------------------------------------------------------------------------- fused AdamW on resume

def test_a_resume_runs_the_adamw_kernel_it_asks_for(tmp_path):
    """torch's own choice for a fresh AdamW(fused=None / True) is the reference, not the saved run's."""
    base = dict(data=str(corpus(tmp_path, 40000)), out_dir=str(tmp_path / "out"), n_layer=1, n_embd=32, n_head=2,
                block_size=16, batch_size=4, eval_interval=100, eval_iters=1, sample_tokens=0, warmup_iters=2,
                lr_decay_iters=8, progress=False)
    pretrain(TrainConfig(max_iters=2, fused_adamw=True, **base))
    trainer = build_pretraining(TrainConfig(max_iters=4, fused_adamw=False, resume=True, **base))
    fresh = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))])
    assert [g["fused"] for g in trainer.optimizer.param_groups] == [fresh.param_groups[0]["fused"]] * 2  # None
    assert trainer.optimizer.state  # the moments were still loaded
    trainer.fit()  # and it steps with the loaded state under the other kernel
    (tmp_path / "out2").mkdir()
    base["out_dir"] = str(tmp_path / "out2")
    pretrain(TrainConfig(max_iters=2, fused_adamw=False, **base))
    trainer = build_pretraining(TrainConfig(max_iters=4, fused_adamw=True, resume=True, **base))
    assert [g["fused"] for g in trainer.optimizer.param_groups] == [True, True]
    steps = [s["step"] for s in trainer.optimizer.state.values()]
    assert all(s.dtype == torch.float32 for s in steps)  # placed as the fused kernel wants it
    trainer.fit()


# ----------------------------------------------------------------------------- no token with a loss

def test_no_completion_token_left_in_the_train_split_is_refused(tmp_path):
    base = base_model(tmp_path)
    data = jsonl(tmp_path / "d.jsonl", [("what is the answer to this?", " yes" + "." * i) for i in range(8)])
    with pytest.raises(DataError, match=r"--max-length above 27.*--mask-prompt"):
        build_finetuning(FinetuneConfig(model=str(base), data=str(data), out_dir=str(tmp_path / "out"), batch_size=2,
                                        max_iters=4, max_length=12, mask_prompt=True, sample_tokens=0,
                                        progress=False, val_fraction=0.25))


def test_no_completion_token_left_in_the_val_split_is_refused_and_others_warned(tmp_path, capsys):
    """Only the held-out examples have prompts past --max-length: the val loss would be a false 0.0.
    Which rows are held out depends on the count and the seed only, so the file puts them there."""
    base = base_model(tmp_path)
    n, fraction, seed = 8, 0.25, 1337
    dummy = Examples(torch.zeros(n, 2, dtype=torch.long), torch.zeros(n, 2, dtype=torch.long), [2] * n, [0] * n, "x")
    _, val_rows = split_examples(dummy, fraction, seed)
    long_prompt, short_prompt = "what is the answer to this?", "q?"
    pairs = [(long_prompt if i in val_rows.tolist() else short_prompt, " yes.") for i in range(n)]
    common = dict(model=str(base), out_dir=str(tmp_path / "out"), batch_size=2, max_iters=2, max_length=12,
                  mask_prompt=True, sample_tokens=0, progress=False, val_fraction=fraction, seed=seed)
    with pytest.raises(DataError, match=r"none of the 2 validation example\(s\).*--max-length above 27"):
        build_finetuning(FinetuneConfig(data=str(jsonl(tmp_path / "v.jsonl", pairs)), **common))
    # one long prompt among the train examples: a warning, and the run goes on
    train_row = next(i for i in range(n) if i not in val_rows.tolist())
    pairs = [(long_prompt if i == train_row else short_prompt, " yes.") for i in range(n)]
    build_finetuning(FinetuneConfig(data=str(jsonl(tmp_path / "w.jsonl", pairs)), **common))
    assert "warning: 1 of 8 example(s) keep no token with a loss" in capsys.readouterr().out


class NoTargets:
    """Eval batches whose every target is ignored (as a prompt-masked, truncated val split)."""

    tokens_per_batch = 8

    def __init__(self, vocab: int) -> None:
        generator = torch.Generator().manual_seed(0)
        self.ids = torch.randint(vocab, (2, 4), generator=generator)  # (B, T)

    def eval_batches(self, split, iters):
        yield self.ids, torch.full_like(self.ids, IGNORE)


def test_an_evaluation_over_no_counted_token_is_nan_not_zero():
    model = Transformer(preset("llama", vocab_size=16, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1, d_mlp=32,
                               max_seq_len=8))
    data = NoTargets(16)
    trainer = Trainer(model, data, torch.optim.AdamW(model.parameters()), TrainConfig(progress=False))
    reference = F.cross_entropy(model(data.ids).flatten(0, 1), torch.full((8,), IGNORE), ignore_index=IGNORE)
    assert math.isnan(reference.item())
    losses = trainer.estimate_loss(1)
    assert math.isnan(losses["val"]) and math.isnan(losses["train"])  # was 0.0 (ppl 1.00)


# ----------------------------------------------------------------------------- --max-iters / --epochs on resume

class LearningRates(Callback):
    def __init__(self) -> None:
        self.rates: list[float] = []

    def on_log(self, trainer, losses):
        self.rates.append(trainer.optimizer.param_groups[0]["lr"])


def nanogpt_lr(step: int, lr: float, warmup: int, decay: int, min_lr: float) -> float:
    if step < warmup:
        return lr * (step + 1) / (warmup + 1)
    if step > decay:
        return min_lr
    ratio = (step - warmup) / max(1, decay - warmup)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (lr - min_lr)


@pytest.mark.parametrize("length", [{"max_iters": 4}, {"epochs": 1}])
def test_a_resume_may_lengthen_a_run_with_the_default_decay(tmp_path, length):
    """As the --resume help says: --max-iters (and --epochs) may change. The saved decay length stays."""
    base = base_model(tmp_path)
    data = jsonl(tmp_path / "d.jsonl", [("q?", " yes" + "." * i) for i in range(10)])  # 8 train, batch 2
    kw = dict(model=str(base), data=str(data), out_dir=str(tmp_path / "out"), batch_size=2, warmup_iters=1,
              eval_interval=100, eval_iters=1, sample_tokens=0, progress=False, val_fraction=0.2, log_interval=1)
    finetune(FinetuneConfig(**length, **kw))
    longer = {"max_iters": 8} if "max_iters" in length else {"epochs": 2}
    rates = LearningRates()
    result = finetune(FinetuneConfig(resume=True, **longer, **kw), callbacks=[rates])  # was CheckpointError
    assert result.step == 8
    lr = 1e-3  # LoRA's default peak; min_lr defaults to a tenth
    assert rates.rates == pytest.approx([nanogpt_lr(s, lr, 1, 4, lr / 10) for s in range(4, 8)])
    state = json.loads((tmp_path / "out" / "checkpoint" / "trainer_state.json").read_text())
    assert state["train_config"]["lr_decay_iters"] == 4 and state["train_config"]["max_iters"] == 8


# ----------------------------------------------------------------------------- --block-size past the context

def test_a_window_longer_than_the_context_is_recorded_as_run(tmp_path, capsys):
    base = base_model(tmp_path, context=32)
    text = tmp_path / "text.txt"  # in the base's character vocabulary
    text.write_text("the quick brown fox jumps over the lazy dog. what is this? a test.\n" * 60)
    result = finetune(FinetuneConfig(model=str(base), data=str(text), out_dir=str(tmp_path / "out"),
                                     block_size=128, batch_size=2, max_iters=1, eval_interval=100, eval_iters=1,
                                     sample_tokens=0, progress=False, method="lora"))
    assert "--block-size 128 is longer than the model's context of 32" in capsys.readouterr().out
    state = json.loads((Path(result.checkpoint) / "trainer_state.json").read_text())
    assert state["train_config"]["block_size"] == 32  # the windows trained on; was 128


# ----------------------------------------------------------------------------- trainer_state.json's format

def test_a_trainer_state_of_another_format_warns_or_is_refused(tmp_path):
    """trainer_state.json records its format. One from before the field (lucidlm before 2026-11-27
    drew and weighed accumulated micro-batches otherwise) resumes with a warning saying the run
    will not retrace the old one; a newer format is refused by name, not half read."""
    from lucidlm.errors import CheckpointError

    base = base_model(tmp_path)
    data = jsonl(tmp_path / "d.jsonl", [("q?", " yes" + "." * i) for i in range(10)])
    kw = dict(model=str(base), data=str(data), out_dir=str(tmp_path / "out"), batch_size=2, warmup_iters=1,
              eval_interval=100, eval_iters=1, sample_tokens=0, progress=False, val_fraction=0.2,
              gradient_accumulation_steps=2)
    finetune(FinetuneConfig(max_iters=2, **kw))
    path = tmp_path / "out" / "checkpoint" / "trainer_state.json"
    state = json.loads(path.read_text())
    assert state["format_version"] == 2
    path.write_text(json.dumps({**state, "format_version": 3}))
    with pytest.raises(CheckpointError, match="format_version 3, newer than this lucidlm reads"):
        finetune(FinetuneConfig(max_iters=3, resume=True, **kw))
    old = {k: v for k, v in state.items() if k != "format_version"}
    path.write_text(json.dumps(old))
    with pytest.warns(UserWarning, match="drew and weighed the micro-batches"):
        assert finetune(FinetuneConfig(max_iters=3, resume=True, **kw)).step == 3
