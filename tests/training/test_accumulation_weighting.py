"""Gradient accumulation over examples that count different numbers of tokens (padding, masked
prompts): an optimizer step of several micro-batches (and processes) equals one big batch whose
loss is the mean over every counted token, as ``F.cross_entropy(ignore_index=-100)`` takes it:
the gradient, the updated weights and the logged loss. Steps that span an epoch boundary
included, and a resumed run draws and weighs what an uninterrupted one does."""

import copy
import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from lucidlm.config import preset
from lucidlm.model.transformer import Transformer
from lucidlm.tokenizers import CharTokenizer
from lucidlm.training.batches import ExampleBatches
from lucidlm.training.config import FinetuneConfig, LoopConfig
from lucidlm.training.distributed import DistributedContext
from lucidlm.training.finetune import finetune
from lucidlm.training.loop import Trainer
from lucidlm.weights.checkpoint import save_model

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py: tiny runs on one torch thread

VOCAB, LENGTH, N_TRAIN = 13, 12, 7


def examples(seed: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` examples of 3 to 12 tokens right-padded to 12, a prompt of 1 to 5 tokens masked:
    ids (n, 12) and targets (n, 12), -100 where no loss counts. Built here, not by lucidlm."""
    rng = np.random.default_rng(seed)
    ids = torch.zeros((n, LENGTH), dtype=torch.long)
    targets = torch.full((n, LENGTH), -100, dtype=torch.long)
    for row in range(n):
        length, prompt = int(rng.integers(3, LENGTH + 1)), int(rng.integers(1, 6))
        ids[row, :length] = torch.as_tensor(rng.integers(1, VOCAB, length))
        for t in range(min(prompt, length - 1) - 1, length - 1):  # position t predicts token t + 1
            targets[row, t] = ids[row, t + 1]
    return ids, targets


def source(batch_size: int, ctx: DistributedContext = DistributedContext()) -> ExampleBatches:
    return ExampleBatches(examples(0, N_TRAIN), examples(1, 3), batch_size, seed=5, ctx=ctx)


def tiny_model() -> Transformer:
    torch.manual_seed(0)
    model = Transformer(preset("llama", vocab_size=VOCAB, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1,
                               d_mlp=32, max_seq_len=LENGTH))
    model.reset_parameters(0.3)
    return model


def one_big_batch(model: torch.nn.Module, ids: torch.Tensor, targets: torch.Tensor):
    """The reference: the mean cross-entropy over every counted token of the whole step, and its gradient."""
    reference = copy.deepcopy(model)
    logits = reference(ids)  # (B, T, V)
    loss = F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1), ignore_index=-100, reduction="mean")
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in reference.named_parameters()}


@pytest.mark.parametrize("batch_size, accumulation", [(2, 2), (1, 4), (2, 3)])  # 2 x 3: steps span epochs
def test_accumulated_steps_equal_one_big_batch(batch_size, accumulation):
    lr = 0.5
    model = tiny_model()
    data = source(batch_size)
    config = LoopConfig(batch_size=batch_size, gradient_accumulation_steps=accumulation, learning_rate=lr,
                        decay_lr=False, grad_clip=0.0, max_iters=4, progress=False, sample_tokens=0)
    # Plain SGD: the new weights are the old minus lr x the gradient, directly comparable.
    trainer = Trainer(model, data, torch.optim.SGD(model.parameters(), lr=lr), config)
    drawn = []
    draw = data.next
    data.next = lambda: drawn.append(draw()) or drawn[-1]
    counts = set()
    for step in range(4):
        before = copy.deepcopy(model)
        drawn.clear()
        trainer.train_step()
        assert len(drawn) == accumulation
        ids, targets = torch.cat([b[0] for b in drawn]), torch.cat([b[1] for b in drawn])
        counts.update(int((b[1] != -100).sum()) for b in drawn)
        expected_loss, grads = one_big_batch(before, ids, targets)
        torch.testing.assert_close(torch.tensor(trainer.flush_losses()[0]), expected_loss, rtol=1e-6, atol=0)
        updated, old = dict(model.named_parameters()), dict(before.named_parameters())
        for name, grad in grads.items():
            torch.testing.assert_close(updated[name].detach(), old[name].detach() - lr * grad, rtol=0, atol=1e-6,
                                       msg=lambda m: f"step {step}, {name}: {m}")
    assert len(counts) > 1  # the micro-batches did count different numbers of tokens


def test_ranks_and_micro_batches_together_equal_one_big_batch():
    """2 processes x 2 micro-batches, simulated in one: each rank's source (the same global
    batches, its own rows) weighs its micro-batches; DDP's average of the ranks' summed
    gradients is one big batch's gradient."""
    world, accumulation = 2, 3  # 4 global micro-batches an epoch: step 1 spans its end
    model = tiny_model()
    sources = [source(1, DistributedContext(rank=r, world_size=world)) for r in range(world)]
    for data in sources:
        data.set_accumulation(accumulation)
    for step in range(3):
        total, grads, rows = torch.zeros(()), {}, []
        for data in sources:
            for _ in range(accumulation):
                x, y, share = data.next()
                data.prefetch()
                rows.append((x, y))
                micro = copy.deepcopy(model)
                logits = micro(x)
                loss = F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1), ignore_index=-100)
                loss = loss / accumulation * share  # what Trainer.train_step does
                loss.backward()
                total += loss.detach() / world  # flush_losses: the ranks' mean
                for name, p in micro.named_parameters():
                    grads[name] = grads.get(name, 0) + p.grad / world  # DDP: the ranks' mean
        expected_loss, expected = one_big_batch(model, torch.cat([r[0] for r in rows]), torch.cat([r[1] for r in rows]))
        torch.testing.assert_close(total, expected_loss, rtol=1e-6, atol=0)
        for name in expected:
            torch.testing.assert_close(grads[name], expected[name], rtol=1e-5, atol=1e-7, msg=lambda m: f"{step} {name} {m}")


def test_a_resumed_source_draws_and_weighs_what_an_uninterrupted_one_does():
    accumulation = 3  # 4 micro-batches an epoch: steps 1 and 2 span epoch boundaries

    def steps(data: ExampleBatches, n: int) -> list:
        out = []
        for _ in range(n * accumulation):  # as Trainer.train_step calls it
            out.append(data.next())
            data.prefetch()
        return out

    whole = source(2)
    whole.set_accumulation(accumulation)
    expected = steps(whole, 5)
    first = source(2)
    first.set_accumulation(accumulation)
    steps(first, 2)
    state = json.loads(json.dumps(first.state_dict()))  # as trainer_state.json keeps it
    resumed = source(2)
    resumed.set_accumulation(accumulation)
    resumed.load_state_dict(state)
    got = steps(first, 3), steps(resumed, 3)
    for batches in got:
        for (x, y, share), (ex, ey, eshare) in zip(batches, expected[2 * accumulation:]):
            assert torch.equal(x, ex) and torch.equal(y, ey) and share == eshare
    assert len({share for *_, share in expected}) > 2  # the weights do differ


# ---------------------------------------------------------------------------- lucidlm finetune

@pytest.fixture(scope="module")
def qa(tmp_path_factory) -> Path:
    """A tiny Llama and 16 examples of very different lengths (a masked prompt, then 2 or 25 tokens)."""
    root = tmp_path_factory.mktemp("qa")
    tokenizer = CharTokenizer.train("abcdefghijklmnopqrstuvwxyz ?.:\n")
    torch.manual_seed(0)
    base = Transformer(preset("llama", vocab_size=tokenizer.vocab_size, d_model=32, n_layers=1, n_heads=4,
                              n_kv_heads=2, d_mlp=64, max_seq_len=48), tokenizer=tokenizer)
    base.reset_parameters(0.3)
    save_model(base, root / "base")
    lines = [{"prompt": "what is x?", "completion": " " + ("y" * 25 if i % 3 else "ab") + "."} for i in range(16)]
    (root / "qa.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    return root


def tune(root: Path, out: str, batch_size: int, accumulation: int, **changes):
    settings = dict(method="full", batch_size=batch_size, gradient_accumulation_steps=accumulation, max_iters=2,
                    lr_decay_iters=4, warmup_iters=0, eval_interval=2, eval_iters=1, sample_tokens=0,
                    mask_prompt=True, progress=False, val_fraction=0.25, log_interval=1)
    config = FinetuneConfig(model=str(root / "base"), data=str(root / "qa.jsonl"), out_dir=str(root / out),
                            **{**settings, **changes})
    result = finetune(config)
    return result.train_losses, load_file(str(root / out / "checkpoint" / "model.safetensors"))


def test_finetune_batch_4_equals_batch_2_accumulated_twice(qa):
    one, one_weights = tune(qa, "b4", 4, 1)
    two, two_weights = tune(qa, "b2x2", 2, 2)
    assert max(abs(a - b) for a, b in zip(one, two)) <= 1e-5, (one, two)
    for name in one_weights:
        torch.testing.assert_close(two_weights[name], one_weights[name], rtol=0, atol=1e-5)


def test_finetune_with_accumulation_resumes_exactly(qa):
    """5 micro-batches of 1 a step, 12 examples an epoch (step 2 spans its end): 4 steps in one
    go, or 2 and a resume."""
    whole, whole_weights = tune(qa, "whole", 1, 5, max_iters=4)
    tune(qa, "resumed", 1, 5)
    resumed, resumed_weights = tune(qa, "resumed", 1, 5, max_iters=4, resume=True)
    assert resumed == whole and len(whole) == 4
    assert all(torch.equal(resumed_weights[name], whole_weights[name]) for name in whole_weights)


@pytest.mark.parametrize("batch_size", [1, 2, 3, 5])
def test_evaluation_is_the_mean_over_counted_tokens(batch_size):
    """The logged val loss is F.cross_entropy over every counted token of the evaluated
    examples at once, whatever --batch-size cuts them into (a mean of the batches' means
    moved with it: 4.107 to 4.134 on one model and one validation set)."""
    model = tiny_model().eval()
    train, val = examples(0, N_TRAIN), examples(1, 5)
    data = ExampleBatches(train, val, batch_size, seed=5, ctx=DistributedContext())
    config = LoopConfig(batch_size=batch_size, max_iters=1, progress=False, sample_tokens=0)
    trainer = Trainer(model, data, torch.optim.SGD(model.parameters(), lr=0.1), config)
    losses = trainer.estimate_loss(iters=100)  # every batch of both splits
    with torch.no_grad():
        for split, (ids, targets) in (("train", train), ("val", val)):
            logits = model(ids)
            expected = F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1), ignore_index=-100)
            assert losses[split] == pytest.approx(float(expected), rel=1e-6, abs=1e-6)
