"""``lucidlm.divergence.kl_divergence`` / ``lucidlm perplexity --kl-base`` against an independent
NumPy computation: the base model's distributions from transformers' float32 SmolLM2 (reading
the same GGUF file), the model's from the embedded default's 4-bit forward pass, the windows by
transformers' sliding-window recipe (tests/evaluation/test_perplexity.py holds lucidlm's windows
to it), every figure recomputed in float64 from the two sets of logits."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

import lucidlm
from lucidlm.divergence import QUANTILES, kl_divergence
from lucidlm.errors import InputError

pytestmark = pytest.mark.usefixtures("one_thread")

MAX_LENGTH, STRIDE = 96, 64  # overlapping windows: each scores only what no earlier one did


@pytest.fixture(scope="module")
def text(shared_dir) -> str:
    held_out = (shared_dir / "data" / "tinyshakespeare.txt").read_text(encoding="utf-8")[-40_000:]
    return held_out[:1500]


def log_softmax(x: np.ndarray) -> np.ndarray:
    top = x.max(-1, keepdims=True)
    return x - top - np.log(np.exp(x - top).sum(-1, keepdims=True))


def oracle(hf, model, ids: list[int], max_length: int, stride: int) -> dict:
    """The figures by hand: windows as transformers' recipe walks them (a window scores the
    tokens past the previous window's end), base logits from ``hf``, the model's from ``model``."""
    kld, same, p, base_p, nll, base_nll = [], [], [], [], [], []
    previous_end = 0
    for begin in range(0, len(ids), stride):
        end = min(begin + max_length, len(ids))
        first = max(previous_end, begin + 1)
        window = torch.tensor([ids[begin:end]])
        with torch.no_grad():
            base_logits = hf(window).logits[0].double().numpy()
            logits = model(window)[0].double().numpy()
        for t in range(first, end):  # token t, predicted at position t - 1 of the text
            lp, lq = log_softmax(logits[t - 1 - begin]), log_softmax(base_logits[t - 1 - begin])
            kld.append(float((np.exp(lq) * (lq - lp)).sum()))
            same.append(int(lp.argmax() == lq.argmax()))
            p.append(math.exp(lp[ids[t]]))
            base_p.append(math.exp(lq[ids[t]]))
            nll.append(-lp[ids[t]])
            base_nll.append(-lq[ids[t]])
        previous_end = end
        if end == len(ids):
            break
    kld, p, base_p = np.array(kld), np.array(p), np.array(base_p)
    return dict(tokens=len(kld), ppl=math.exp(np.mean(nll)), base_ppl=math.exp(np.mean(base_nll)),
                ln_ppl_ratio=np.mean(nll) - np.mean(base_nll), kld_mean=kld.mean(),
                kld_stderr=kld.std(ddof=1) / math.sqrt(len(kld)), kld=kld, same_top=np.mean(same),
                delta_p_mean=(p - base_p).mean(), delta_p_rms=math.sqrt(((p - base_p) ** 2).mean()))


@pytest.mark.slow
def test_the_default_model_against_float32_equals_numpy_on_transformers(smollm2, smollm2_default, hf_smollm2, text):
    """The 4-bit default scored against the float32 reading of its own file (the only float
    weights offline: the original model's are not in the file), held to the hand computation
    with transformers' float32 model as the base."""
    hf, _ = hf_smollm2
    ids = smollm2.tokenizer.encode(text, allowed_special=False)
    want = oracle(hf, smollm2_default, ids, MAX_LENGTH, STRIDE)
    got = kl_divergence(smollm2_default, smollm2, text, max_length=MAX_LENGTH, stride=STRIDE, batch_size=2)
    assert got.tokens == want["tokens"] == len(ids) - 1 and got.text_tokens == len(ids)
    assert (got.max_length, got.stride) == (MAX_LENGTH, STRIDE)
    assert got.ppl == pytest.approx(want["ppl"], rel=1e-4)  # float32 log-softmax (as perplexity's) vs float64
    assert got.base_ppl == pytest.approx(want["base_ppl"], rel=1e-4)  # lucidlm's float32 vs transformers'
    assert got.ln_ppl_ratio == pytest.approx(want["ln_ppl_ratio"], abs=1e-4)
    # KL divergences of ~1e-4 nats (the file's weights in float32 against their own int kernels);
    # transformers' logits differ from lucidlm's float32 ones by ~1e-5
    assert got.kld_mean == pytest.approx(want["kld_mean"], rel=2e-2, abs=2e-6)
    assert got.kld_stderr == pytest.approx(want["kld_stderr"], rel=5e-2, abs=2e-6)
    for name, q in (("max", 1.0), ("99%", 0.99), ("90%", 0.9), ("median", 0.5), ("10%", 0.1)):
        assert got.kld_quantiles[name] == pytest.approx(float(np.quantile(want["kld"], q)), rel=5e-2, abs=5e-6), name
    assert abs(got.same_top - want["same_top"]) <= 1 / got.tokens  # a near tie may fall either way
    assert got.same_top_stderr == pytest.approx(math.sqrt(got.same_top * (1 - got.same_top) / got.tokens))
    assert got.delta_p_mean == pytest.approx(want["delta_p_mean"], abs=2e-5)
    assert got.delta_p_rms == pytest.approx(want["delta_p_rms"], rel=1e-2, abs=2e-5)


@pytest.mark.slow
def test_int4_groups_against_float32_equal_numpy_on_transformers(smollm2, hf_smollm2, text):
    """A quantization that moves the distributions (int4 groups of 32 over the float32 weights):
    KL divergences of ~0.07 nats, held to the hand computation."""
    hf, _ = hf_smollm2
    int4 = lucidlm.load("smollm2-135m", quantize="int4")
    ids = smollm2.tokenizer.encode(text, allowed_special=False)
    want = oracle(hf, int4, ids, MAX_LENGTH, STRIDE)
    got = kl_divergence(int4, smollm2, ids, max_length=MAX_LENGTH, stride=STRIDE)
    assert got.tokens == want["tokens"]
    assert want["kld_mean"] > 0.01  # the case is not the near-zero one above
    assert got.kld_mean == pytest.approx(want["kld_mean"], rel=1e-3)
    assert got.kld_quantiles["99%"] == pytest.approx(float(np.quantile(want["kld"], 0.99)), rel=1e-3)
    assert got.kld_quantiles["max"] == pytest.approx(float(want["kld"].max()), rel=1e-3)
    assert abs(got.same_top - want["same_top"]) <= 1 / got.tokens
    assert got.delta_p_rms == pytest.approx(want["delta_p_rms"], rel=1e-3)
    assert got.ppl == pytest.approx(want["ppl"], rel=1e-4)


def tiny(vocab: int = 300, seed: int = 0, context: int = 64):
    from lucidlm import LanguageModel, preset
    from random_weights import randomize_

    return randomize_(LanguageModel(preset("llama", n_layers=1, d_model=32, n_heads=2, n_kv_heads=1, vocab_size=vocab,
                                           max_seq_len=context, multiple_of=32)), seed).eval()


def test_a_model_against_itself_is_zero_and_its_perplexity():
    model = tiny()
    ids = torch.randint(0, 300, (150,), generator=torch.Generator().manual_seed(1))
    got = kl_divergence(model, model, ids, max_length=40, stride=25)
    want = lucidlm.perplexity(model, ids, max_length=40, stride=25)
    assert got.tokens == want.tokens == 149
    assert got.ppl == got.base_ppl == pytest.approx(want.ppl, rel=1e-6)
    assert (got.kld_mean, got.kld_quantiles["max"], got.same_top, got.delta_p_rms) == (0.0, 0.0, 1.0, 0.0)


def test_another_model_moves_every_figure():
    """Two random models: the figures a hand computation gives (KL >= 0 in the mean, agreement
    below 1), with the model's own perplexity what ``perplexity`` gives it."""
    model, base = tiny(seed=0, context=128), tiny(seed=1, context=128)
    ids = torch.randint(0, 300, (100,), generator=torch.Generator().manual_seed(2))
    got = kl_divergence(model, base, ids, max_length=100, stride=100)  # one window: every token after the first
    with torch.no_grad():
        lp = torch.log_softmax(model(ids[None])[0, :-1].double(), -1)
        lq = torch.log_softmax(base(ids[None])[0, :-1].double(), -1)
    kld = (lq.exp() * (lq - lp)).sum(-1)
    assert got.tokens == 99 and got.kld_mean == pytest.approx(kld.mean().item(), rel=1e-5)
    assert got.same_top == pytest.approx((lp.argmax(-1) == lq.argmax(-1)).double().mean().item())
    assert got.kld_quantiles["min"] >= -1e-6 and got.kld_quantiles["max"] == pytest.approx(kld.max().item(), rel=1e-5)
    assert got.ppl == pytest.approx(lucidlm.perplexity(model, ids, max_length=100, stride=100).ppl, rel=1e-6)


def test_a_small_divergence_over_a_large_vocabulary_is_held_to_float64(monkeypatch):
    """A good quantization's KL divergences are ~1e-6..1e-4 nats, and a float32 log-softmax over
    a large vocabulary rounds log p by ~1e-6 (its log-sum-exp is ~10-20 nats): each token's
    figure is computed in float64, equal to a float64 computation on the same logits; a few
    positions at a time (the same figures), not a window's (T, V) temporaries at once."""
    import copy

    model = tiny(vocab=32768, context=128)
    base = copy.deepcopy(model)
    with torch.no_grad():  # a base a little off the model: KL divergences of ~5e-6 nats
        for p in base.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(3)) * 1e-3 * p.abs().mean())
    ids = torch.randint(0, 32768, (120,), generator=torch.Generator().manual_seed(2))
    got = kl_divergence(model, base, ids, max_length=120, stride=120)
    with torch.no_grad():
        lp = torch.log_softmax(model(ids[None])[0, :-1].double(), -1)
        lq = torch.log_softmax(base(ids[None])[0, :-1].double(), -1)
    kld = (lq.exp() * (lq - lp)).sum(-1).numpy()
    assert 1e-6 < np.quantile(kld, 0.1) < kld.mean() < 1e-5
    assert got.kld_mean == pytest.approx(kld.mean(), rel=1e-9)
    for name, q in QUANTILES:
        assert got.kld_quantiles[name] == pytest.approx(float(np.quantile(kld, q)), rel=1e-9), name
    assert got.ppl == pytest.approx(math.exp(-lp.gather(1, ids[1:, None]).mean().item()), rel=1e-12)
    import lucidlm.divergence

    monkeypatch.setattr(lucidlm.divergence, "CHUNK_ELEMENTS", 7 * 32768)  # 7 positions at a time
    assert kl_divergence(model, base, ids, max_length=120, stride=120) == got


def test_bad_inputs_are_refused_by_name():
    model = tiny()
    ids = list(range(50))
    with pytest.raises(InputError, match="vocabulary has 200 tokens and the model's 300"):
        kl_divergence(model, tiny(vocab=200), ids)
    with pytest.raises(InputError, match="max_length=64 is invalid"):
        kl_divergence(model, tiny(context=32), ids, max_length=64)  # the shorter context bounds the window
    with pytest.raises(InputError, match="1 token long"):
        kl_divergence(model, model, [5])
    with pytest.raises(InputError, match="did you mean 'stride'"):
        kl_divergence(model, model, ids, strid=3)


def test_a_base_that_reads_the_text_otherwise_is_refused(smollm2):
    import copy

    base = copy.copy(smollm2)  # the same weights, another tokenizer object

    class Shifted:
        def encode(self, text, allowed_special=False):
            return [i + 1 for i in smollm2.tokenizer.encode(text, allowed_special=allowed_special)]

    base.tokenizer = Shifted()
    with pytest.raises(InputError, match="reads the text into other tokens"):
        kl_divergence(smollm2, base, "To be, or not to be")


@pytest.mark.slow
def test_the_command_prints_what_the_api_gives(tmp_path, capsys, text, smollm2, smollm2_default):
    from lucidlm import cli

    data = tmp_path / "held_out.txt"
    data.write_text(text, encoding="utf-8")
    flags = ["--data", str(data), "--kl-base", "smollm2-135m", "--context", "96", "--stride", "64", "-q"]
    assert cli.main(["perplexity", *flags, "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    want = kl_divergence(smollm2_default, smollm2, text, max_length=96, stride=64).to_dict()
    for key, value in want.items():
        assert printed[key] == pytest.approx(value, rel=1e-9), key
    assert cli.main(["perplexity", *flags]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith(f"perplexity {want['ppl']:.4f}, base {want['base_ppl']:.4f}")
    assert lines[1].startswith(f"KL divergence from smollm2-135m: mean {want['kld_mean']:.6f}")
    assert lines[2].startswith(f"same most likely token: {100 * want['same_top']:.2f} %")
    assert cli.main(["perplexity", "--data", str(data), "--kl-base", str(tmp_path / "nowhere"), "-q"]) == 1
    assert f"--kl-base {tmp_path / 'nowhere'}: no such file or directory" in capsys.readouterr().err
