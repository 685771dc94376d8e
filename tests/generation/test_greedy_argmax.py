"""Greedy decoding's pick in C (kernels/argmax_rows.c via blocks_kernel.argmax_rows) against
torch.argmax, the reference: the same index for every row, ties and NaNs included."""

from __future__ import annotations

import pytest
import torch

from lucidlm.generation.sampling import SamplingSettings, sample_next
from lucidlm.quantization import blocks_kernel

NAN, INF = float("nan"), float("inf")


def kernel(logits: torch.Tensor) -> torch.Tensor:
    assert blocks_kernel.available(), blocks_kernel.unavailable_reason()
    return torch.ops.lucidlm.argmax_rows(logits)


@pytest.mark.parametrize("B, V", [(1, 49152), (8, 49152), (3, 7), (5, 17), (2, 1), (4, 128256), (9, 1000)])
def test_random_rows_with_ties_at_the_top(B, V):
    g = torch.Generator().manual_seed(B * 1000 + V)
    x = torch.randn(B, V, generator=g)
    top = x.max() + 1
    for i in range(B):  # the largest value two or three times in a row, at different places
        for at in torch.randint(0, V, (1 + i % 3,), generator=g).tolist():
            x[i, at] = top
    assert torch.equal(kernel(x), x.argmax(dim=-1))
    small = torch.randint(-3, 3, (B, V), generator=g).float()  # ties everywhere
    assert torch.equal(kernel(small), small.argmax(dim=-1))


@pytest.mark.parametrize("row", [
    [1.0, NAN, 3.0, NAN], [1.0, 2.0, NAN], [NAN] * 9, [-INF, -INF, -INF], [INF, 1.0, INF], [0.0, -0.0, 0.0],
    [-0.0, 0.0], [-5.0] * 8 + [NAN] + [7.0] * 8, [-INF] * 8 + [-1e38] + [-INF] * 3,
])
def test_special_values_as_torch_treats_them(row):
    x = torch.tensor([row, list(reversed(row))])
    assert torch.equal(kernel(x), x.argmax(dim=-1))


def test_a_strided_view_is_read_as_its_values():
    x = torch.randn(6, 300, generator=torch.Generator().manual_seed(1))
    view = x[::2, 1::3]
    assert torch.equal(kernel(view), view.argmax(dim=-1))


def test_bad_input_is_refused_by_name():
    with pytest.raises(RuntimeError, match="argmax_rows: logits must be float32"):
        kernel(torch.zeros(2, 4, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="V >= 1"):
        kernel(torch.zeros(2, 0))


def test_greedy_sampling_picks_what_torch_argmax_picks():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(8, 49152, generator=g)
    logits[3, 100] = logits[3, 40000] = 50.0  # a tie: the first wins
    logits[5, 7] = NAN
    chosen = sample_next(logits, SamplingSettings(temperature=0))
    assert torch.equal(chosen, logits.argmax(dim=-1))
    assert chosen[3] == 100 and chosen[5] == 7
    # other dtypes and the fallback keep torch's own argmax
    assert torch.equal(blocks_kernel.argmax_rows(logits.double()), logits.double().argmax(dim=-1))
