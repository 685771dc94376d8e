"""Masked cross-entropy vs NumPy and PyTorch; the learning-rate schedule vs nanoGPT's formula."""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from lucidlm.training.loss import masked_cross_entropy
from lucidlm.training.schedule import get_lr


def numpy_sequence_loss(logits: np.ndarray, targets: np.ndarray, mask: np.ndarray) -> float:
    """Seed 004's sequence_loss_fn in NumPy: -sum(onehot * log_softmax) averaged over the mask
    (the one-hot sum picks the target's log-probability)."""
    shifted = logits - logits.max(-1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    per_token = -np.take_along_axis(log_probs, targets[..., None], axis=-1)[..., 0]
    return float((per_token * mask).sum() / mask.sum())


def test_seed004_mask_of_target_zero_matches_numpy():
    # Seed 004's own test shape: (1, 3, 25670) logits, targets [[0, 2, 0]]; id 0 is padding.
    rng = np.random.default_rng(42)
    logits = rng.standard_normal((1, 3, 25670)).astype(np.float64)
    targets = np.array([[0, 2, 0]])
    expected = numpy_sequence_loss(logits, targets, (targets > 0).astype(np.float64))
    got = masked_cross_entropy(torch.from_numpy(logits), torch.from_numpy(targets), ignore_index=0)
    assert got.item() == pytest.approx(expected, rel=1e-6)
    # Only position 1 counts: the loss is that one token's -log p.
    assert expected == pytest.approx(-(logits[0, 1, 2] - np.log(np.exp(logits[0, 1]).sum())), rel=1e-9)


def test_matches_torch_ignore_index_and_explicit_mask():
    torch.manual_seed(0)
    logits = torch.randn(4, 7, 50)
    targets = torch.randint(0, 50, (4, 7))
    targets[0, 3:] = -100
    targets[2, :2] = -100
    reference = F.cross_entropy(logits.reshape(-1, 50), targets.reshape(-1), ignore_index=-100)
    assert torch.allclose(masked_cross_entropy(logits, targets), reference, rtol=1e-6, atol=1e-7)

    mask = torch.rand(4, 7) > 0.3
    counted = mask & (targets != -100)
    manual = numpy_sequence_loss(logits.double().numpy(), targets.clamp(min=0).numpy(), counted.double().numpy())
    assert masked_cross_entropy(logits, targets, mask=mask).item() == pytest.approx(manual, rel=1e-5)


def test_no_masking_is_plain_cross_entropy_and_all_masked_is_zero():
    logits = torch.randn(2, 5, 11)
    targets = torch.randint(0, 11, (2, 5))
    assert torch.allclose(masked_cross_entropy(logits, targets),
                          F.cross_entropy(logits.reshape(-1, 11), targets.reshape(-1)))
    assert masked_cross_entropy(logits, torch.full((2, 5), -100)).item() == 0.0


def test_gradient_ignores_masked_positions():
    logits = torch.randn(1, 4, 9, requires_grad=True)
    targets = torch.tensor([[1, 2, -100, -100]])
    masked_cross_entropy(logits, targets).backward()
    assert torch.all(logits.grad[0, 2:] == 0) and torch.any(logits.grad[0, :2] != 0)


def nanogpt_get_lr(it, learning_rate, warmup_iters, lr_decay_iters, min_lr):
    # Copied from nanoGPT's train.py (karpathy/nanoGPT, master).
    if it < warmup_iters:
        return learning_rate * (it + 1) / (warmup_iters + 1)
    if it > lr_decay_iters:
        return min_lr
    decay_ratio = (it - warmup_iters) / (lr_decay_iters - warmup_iters)
    assert 0 <= decay_ratio <= 1
    coeff = 0.5 * (1.0 + math.cos(math.pi * decay_ratio))
    return min_lr + coeff * (learning_rate - min_lr)


@pytest.mark.parametrize("step", [0, 1, 50, 99, 100, 101, 550, 1000, 1999, 2000, 2001, 5000])
def test_lr_schedule_matches_nanogpt(step):
    args = (1e-3, 100, 2000, 1e-4)  # the shakespeare-char CPU run
    assert get_lr(step, *args) == nanogpt_get_lr(step, *args)


def test_lr_schedule_key_values():
    lr, warmup, decay, min_lr = 1e-3, 100, 2000, 1e-4
    assert get_lr(0, lr, warmup, decay, min_lr) == pytest.approx(lr / 101)
    assert get_lr(warmup, lr, warmup, decay, min_lr) == pytest.approx(lr)  # peak after warmup
    assert get_lr((warmup + decay) // 2, lr, warmup, decay, min_lr) == pytest.approx((lr + min_lr) / 2)
    assert get_lr(decay, lr, warmup, decay, min_lr) == pytest.approx(min_lr)
    assert get_lr(10 * decay, lr, warmup, decay, min_lr) == min_lr
    values = [get_lr(s, lr, warmup, decay, min_lr) for s in range(decay + 1)]
    assert all(a <= b for a, b in zip(values[:warmup], values[1:warmup + 1]))  # rises during warmup
    assert all(a >= b for a, b in zip(values[warmup:], values[warmup + 1:]))  # then never rises
