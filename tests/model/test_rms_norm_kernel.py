"""lucidlm's C loop for RMSNorm over float32 rows (quantization/kernels/rms_norm_rows.c,
``torch.ops.lucidlm.rms_norm_rows``) against RMSNorm computed in float64 (and against torch's own
rms_norm where values are special), and its use by RMSNorm layers: inference on the CPU only,
never under autograd, hooks or a compiled graph."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lucidlm.config import ModelConfig
from lucidlm.language_model import LanguageModel
from lucidlm.model.norms import RMSNorm
from lucidlm.quantization import blocks_kernel

NAN, INF = float("nan"), float("inf")


@pytest.fixture(autouse=True, scope="module")
def kernels_loaded():
    # built by scripts/install.sh on CI's machines (AVX-512 VNNI or AVX2): test_blocks_kernel.py says so
    assert blocks_kernel.available(), blocks_kernel.unavailable_reason()


def reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) * weight, in float64 (as LLaMA's RMSNorm defines it)."""
    x64 = x.double()
    return x64 / torch.sqrt(x64.pow(2).mean(-1, keepdim=True) + eps) * weight.double()


@pytest.mark.parametrize("shape", [(1, 1, 576), (8, 1, 576), (512, 576), (2, 4, 3, 256), (3, 7, 5), (4, 8), (2, 9),
                                   (6, 17), (1, 1), (5, 3, 64), (0, 576)])
@pytest.mark.parametrize("eps", [1e-5, 1e-6, 0.0])
def test_equals_rms_norm_in_float64(shape, eps):
    g = torch.Generator().manual_seed(sum(shape) + int(eps * 1e6))
    x = torch.randn(*shape, generator=g) * 3 + 0.5
    weight = torch.randn(shape[-1], generator=g)
    got = torch.ops.lucidlm.rms_norm_rows(x, weight, eps)
    assert got.dtype == torch.float32 and got.shape == x.shape
    torch.testing.assert_close(got.double(), reference(x, weight, eps), rtol=2e-6, atol=2e-6)


def test_strided_input_and_weight_are_read_as_their_values():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(6, 40, generator=g).t()[:, :5]  # (40, 5), columns 6 floats apart
    weight = torch.randn(10, generator=g)[::2]  # (5,), every other float
    torch.testing.assert_close(torch.ops.lucidlm.rms_norm_rows(x, weight, 1e-5).double(), reference(x, weight, 1e-5),
                               rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("row", [
    [1.0, NAN, 3.0] + [0.5] * 13, [INF] + [1.0] * 9, [-INF, 2.0, 3.0], [0.0] * 16, [1e30] * 12, [1e-30] * 20,
    [3e38, -3e38] * 4,
])
def test_special_values_as_torch_treats_them(row):
    x = torch.tensor([row, list(reversed(row))])
    weight = torch.linspace(-1.5, 2.0, len(row))
    for eps in (1e-5, 0.0):
        torch.testing.assert_close(torch.ops.lucidlm.rms_norm_rows(x, weight, eps),
                                   F.rms_norm(x, (len(row),), weight, eps), equal_nan=True, rtol=2e-6, atol=1e-6)


def test_bad_inputs_are_refused_by_name():
    x, weight = torch.randn(2, 8), torch.randn(8)
    with pytest.raises(RuntimeError, match="float32"):
        torch.ops.lucidlm.rms_norm_rows(x.double(), weight, 1e-5)
    with pytest.raises(RuntimeError, match="float32"):
        torch.ops.lucidlm.rms_norm_rows(x, weight.bfloat16(), 1e-5)
    with pytest.raises(RuntimeError, match=r"\(D,\)"):
        torch.ops.lucidlm.rms_norm_rows(x, torch.randn(7), 1e-5)


def tiny_model() -> LanguageModel:
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=40, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64,
                      positions="rope", norm="rms", mlp="swiglu", d_mlp=96, qk_norm=True)
    return LanguageModel(cfg).eval()


def counted(monkeypatch) -> list:
    calls, real = [], torch.ops.lucidlm.rms_norm_rows
    monkeypatch.setattr(torch.ops.lucidlm, "rms_norm_rows", lambda *args: calls.append(args[0].shape) or real(*args))
    return calls


def test_the_switch_reaches_every_rms_norm_layer_and_the_forward_pass_stays_the_same(monkeypatch):
    model = tiny_model()
    norms = [m for m in model.modules() if isinstance(m, RMSNorm)]
    assert len(norms) == 2 * 2 + 2 * 2 + 1 and not any(n.row_kernel for n in norms)  # ln1, ln2, q/k norms, final
    ids = torch.tensor([[1, 5, 9, 2, 7, 3]])
    with torch.no_grad():
        want = model(ids)
    assert blocks_kernel.use_cpu_loops(model) is True
    assert all(n.row_kernel for n in norms)
    calls = counted(monkeypatch)
    with torch.no_grad():
        got = model(ids)
    assert len(calls) == len(norms)  # each layer went through the loop once
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_autograd_hooks_and_other_dtypes_keep_torchs_rms_norm(monkeypatch):
    norm = RMSNorm(16)
    norm.weight.data = torch.linspace(0.5, 1.5, 16)
    norm.row_kernel = True
    calls = counted(monkeypatch)
    x = torch.randn(3, 16, requires_grad=True)
    norm(x).sum().backward()  # grad mode: the loop has no backward, torch's rms_norm runs
    assert calls == [] and x.grad is not None and norm.weight.grad is not None
    expected = torch.autograd.grad(reference(x, norm.weight, norm.eps).sum(), x)[0]
    torch.testing.assert_close(x.grad, expected, rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        norm(x.bfloat16())  # other activations: the spelled-out form
        seen = []
        norm.hook_normalized.add_hook(lambda t, hook: seen.append(t.shape))
        norm(x)  # a hook looks inside: the spelled-out form that has the values to show
        assert seen == [(3, 16)]
        norm.hook_normalized.remove_hooks()
        assert calls == []
        norm(x)
    assert calls == [(3, 16)]


def test_off_where_the_kernels_are_not_available(monkeypatch):
    monkeypatch.setattr(blocks_kernel, "available", lambda: False)
    model = tiny_model()
    assert blocks_kernel.use_cpu_loops(model) is False
    assert not any(m.row_kernel for m in model.modules() if isinstance(m, RMSNorm))


def test_the_embedded_default_takes_it_and_greedy_tokens_do_not_change():
    import lucidlm
    from lucidlm.generation import generate_batch

    default = lucidlm.load()  # Q4_1 layers on lucidlm's kernels
    norms = [m for m in default.modules() if isinstance(m, RMSNorm)]
    assert norms and all(n.row_kernel for n in norms)
    assert not any(m.row_kernel for m in lucidlm.load(dtype="float32").modules() if isinstance(m, RMSNorm))
    prompts = [default.tokenizer.encode("The capital of France is"), default.tokenizer.encode("def fib(n):")]
    for block in default.blocks:
        block.decode_kernel = False  # each layer through its module (test_decode_block.py covers the one-call step)
    got = generate_batch(default, prompts, max_new_tokens=24, temperature=0, stop_on_eos=False)
    for norm in norms:
        norm.row_kernel = False  # torch's rms_norm, as before the loader switched the loop on
    want = generate_batch(default, prompts, max_new_tokens=24, temperature=0, stop_on_eos=False)
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
