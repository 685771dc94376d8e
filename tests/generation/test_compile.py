"""Compiled decoding (``LanguageModel.compile``, ``load(compile=True)``, ``--compile``) gives
the tokens eager decoding gives."""

from __future__ import annotations

import time

import pytest
import torch
from generation_toys import fresh_dynamo, one_torch_thread, toy_model  # noqa: F401 (autouse fixtures)

import lucidlm
from lucidlm import LanguageModel
from lucidlm.cli import build_parser

SMOLLM2_PROMPTS = ["The capital of France is", "Once upon a time, in a small village,", "def fibonacci(n):"]


def greedy(model, prompt, n=24):
    return model.generate(prompt, max_new_tokens=n, temperature=0, stop_on_eos=False).token_ids


def test_compiled_greedy_equals_eager_on_a_tiny_model():
    """Prefill (dynamic shapes) and decode both go through torch.compile's graph capture
    (the aot_eager backend: dynamo + AOTAutograd, no code generation, so it is quick)."""
    model = toy_model(seed=3, max_seq_len=512, model_cls=LanguageModel)
    prompts = [[5, 6, 7, 8], [9, 10], list(range(20, 37))]
    eager = [greedy(model, p) for p in prompts] + [[r.token_ids for r in model.generate(
        prompts, max_new_tokens=24, temperature=0, stop_on_eos=False)]]
    assert model.compile(backend="aot_eager") is model and model.compiled
    compiled = [greedy(model, p) for p in prompts] + [[r.token_ids for r in model.generate(
        prompts, max_new_tokens=24, temperature=0, stop_on_eos=False)]]
    assert compiled == eager
    assert model(torch.tensor([prompts[0]])).shape == (1, 4, model.config.vocab_size)  # forward stays eager


@pytest.mark.parametrize("command", ["generate", "chat"])
def test_compile_flag_reaches_load(command, monkeypatch):
    seen = {}

    def fake_load(source, **kwargs):
        seen.update(kwargs)
        raise SystemExit(0)  # stop before any model is built

    monkeypatch.setattr(lucidlm, "load", fake_load)
    argv = [command, "Hi", "--compile", "-q"] if command == "generate" else [command, "--compile", "-q"]
    args = build_parser().parse_args(argv)
    with pytest.raises(SystemExit):
        args.handler(args)
    assert seen["compile"] is True
    assert build_parser().parse_args(argv[:-2] + ["-q"]).compile is False


def test_load_compile_true_returns_a_compiled_model():
    model = lucidlm.load("llama", random_init=True, compile=True, n_layers=1, d_model=32, n_heads=2,
                         vocab_size=50, max_seq_len=64)
    assert isinstance(model, LanguageModel) and model.compiled  # compiles lazily, at the first generate


@pytest.mark.slow
def test_compiled_smollm2_greedy_equals_eager_fp32(smollm2):
    """The embedded model, fp32 on the CPU, decode step compiled by inductor: the same greedy
    tokens as eager. (The prompt pass is left eager here: compiling it too doubles the
    minutes this takes on 2 cores; the tiny-model test above covers it.)"""
    eager = [greedy(smollm2, p) for p in SMOLLM2_PROMPTS]
    compiled_model = lucidlm.load(dtype=torch.float32).compile(prefill=False)
    start = time.perf_counter()
    first = greedy(compiled_model, SMOLLM2_PROMPTS[0])
    print(f"compile warm-up (first generate): {time.perf_counter() - start:.1f} s")
    assert [first] + [greedy(compiled_model, p) for p in SMOLLM2_PROMPTS[1:]] == eager
