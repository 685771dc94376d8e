"""Typical-p, the epsilon and the eta cutoffs against transformers' own warpers: the kept set
and the values on random logits (banned tokens, ties, several shapes), the order in which
transformers' ``generate`` applies them with the other samplers, and the options wired through
generate, stream, the command line, chat's /set and a generation_config.json."""

from __future__ import annotations

import io
import json
import re

import pytest
import torch
from generation_toys import (assert_compiled_samples_like_eager, fresh_dynamo, model_dir,  # noqa: F401 (fixtures)
                             one_torch_thread, only_generate_and_chat, reader, toy_model)
from test_no_host_sync import reading_back_forbidden

from lucidlm import cli
from lucidlm.commands.chat import chat_loop
from lucidlm.errors import GenerationError
from lucidlm.generation import check_options, generate, generate_batch, stream
from lucidlm.generation import sampling
from lucidlm.generation.sampling import (SamplingSettings, epsilon_filter, eta_filter, process_logits, sample_next,
                                         typical_filter)

transformers = pytest.importorskip("transformers")
from transformers.generation.logits_process import (EpsilonLogitsWarper, EtaLogitsWarper,  # noqa: E402
                                                    LogitsProcessorList, TemperatureLogitsWarper,
                                                    TypicalLogitsWarper)

FILTERS = {"typical_p": (typical_filter, TypicalLogitsWarper, (1e-3, 0.2, 0.5, 0.9, 0.999)),
           "epsilon_cutoff": (epsilon_filter, EpsilonLogitsWarper, (1e-4, 3e-3, 0.05, 0.3, 0.9)),
           "eta_cutoff": (eta_filter, EtaLogitsWarper, (1e-4, 3e-3, 0.05, 0.3, 0.9))}


def random_logits(seed: int, rows: int, vocab: int) -> torch.Tensor:
    """(rows, vocab) float32 logits with banned tokens (-inf), ties and, for some seeds, values
    rounded so that many tokens share a probability."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=gen) * (0.5 + seed % 4)
    if vocab > 4:
        logits[:, ::5] = float("-inf")  # min_new_tokens' EOS ban, a previous filter's cut
        logits[:, 1] = logits[:, 2]  # a tie
        logits[0, 3] = logits[0].max()  # a tie at the top
    if seed % 2:
        logits = logits.round(decimals=1)
    return logits


@pytest.mark.parametrize("name", list(FILTERS))
@pytest.mark.parametrize("seed, rows, vocab", [(0, 1, 2), (1, 3, 3), (2, 4, 7), (3, 2, 50), (4, 3, 1000),
                                               (5, 2, 32_000), (6, 5, 257)])
def test_filters_equal_transformers_warpers(name, seed, rows, vocab):
    ours, theirs, values = FILTERS[name]
    logits = random_logits(seed, rows, vocab)
    for value in values:
        expected = theirs(value)(None, logits.clone())
        got = ours(logits, value)
        assert torch.equal(got, expected), (name, value)  # the same kept set, the same values
        assert torch.isfinite(got).any(dim=-1).all()  # every row keeps a token


def hf_tiny_llama(vocab: int = 64) -> "transformers.LlamaForCausalLM":
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                                      tie_word_embeddings=False, bos_token_id=None, eos_token_id=None,
                                      pad_token_id=0)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(60.0)  # logits spread enough for every filter to cut something
    return model


@pytest.mark.parametrize("options", [
    dict(temperature=0.7, top_k=40, top_p=0.95, min_p=0.02, typical_p=0.9, epsilon_cutoff=3e-3, eta_cutoff=2e-3,
         repetition_penalty=1.3),
    dict(temperature=1.3, typical_p=0.6, eta_cutoff=0.01),
    dict(temperature=0.9, top_p=0.8, epsilon_cutoff=0.02),
    dict(typical_p=0.3, epsilon_cutoff=0.01, eta_cutoff=0.05),
])
def test_the_order_is_transformers_generate(options):
    """transformers' generate (its GenerationMixin builds the processor list) gives each step's
    raw logits and the processed scores it sampled from: process_logits turns the one into the
    other, exactly, with the same options."""
    hf = hf_tiny_llama()
    prompt = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]])
    torch.manual_seed(1)
    out = hf.generate(prompt, do_sample=True, max_new_tokens=6, return_dict_in_generate=True, output_scores=True,
                      output_logits=True, top_k=options.get("top_k", 0), **{k: v for k, v in options.items()
                                                                           if k != "top_k"})
    settings = SamplingSettings(**options)
    cut = 0
    for step, (raw, scores) in enumerate(zip(out.logits, out.scores)):
        seen = out.sequences[:, :prompt.shape[1] + step]
        assert torch.equal(process_logits(raw.float(), settings, seen), scores), step
        cut += int(torch.isinf(scores).sum() - torch.isinf(raw).sum())
    assert cut > 0  # the filters did cut


@pytest.mark.parametrize("options", [
    dict(temperature=0.8, top_k=200, top_p=0.97, min_p=0.01, typical_p=0.95, epsilon_cutoff=0.01, eta_cutoff=0.2),
    dict(min_p=0.05, typical_p=0.5, eta_cutoff=0.3),
    dict(top_p=0.9, typical_p=0.7, epsilon_cutoff=0.005),
])
def test_the_order_is_generation_mixins_processor_list(options):
    """The list GenerationMixin builds for these options, on flatter random rows where each
    filter's cut depends on the ones before it (swapping any two of the new ones changes it)."""
    from transformers import GenerationConfig

    processors = hf_tiny_llama()._get_logits_processor(GenerationConfig(do_sample=True, **options), device="cpu")
    logits = torch.randn(64, 500, generator=torch.Generator().manual_seed(0)) * 1.5
    logits[:, 7] = float("-inf")
    expected = processors(None, logits.clone())
    assert torch.equal(process_logits(logits, SamplingSettings(**options)), expected)


def record_sampling(monkeypatch) -> list:
    """(logits (B, V), sampled ids (B,)) of every sampling step from now on."""
    steps = []
    original = sampling.sample_next

    def recorded(logits, settings, *args, **kwargs):
        ids = original(logits, settings, *args, **kwargs)
        steps.append((logits.float().clone(), ids))
        return ids

    monkeypatch.setattr(sampling, "sample_next", recorded)
    return steps


@pytest.mark.parametrize("name", list(FILTERS))
def test_generate_samples_only_tokens_transformers_keeps(name, monkeypatch):
    """generate, a batch and stream with the option and a seed: the same seed gives the same
    tokens, and each token sampled survives transformers' warper on the logits it came from."""
    model = toy_model(seed=4)
    value = {"typical_p": 0.7, "epsilon_cutoff": 0.01, "eta_cutoff": 0.02}[name]
    steps = record_sampling(monkeypatch)
    options = dict(max_new_tokens=12, temperature=1.5, seed=3, stop_on_eos=False, **{name: value})
    first = generate(model, "Hello", **options).token_ids
    assert generate(model, "Hello", **options).token_ids == first
    assert "".join(stream(model, "Hello", **options)) == generate(model, "Hello", **options).text
    batch = generate_batch(model, ["Hello", "Hi"], **options)
    assert len(batch) == 2 and all(len(r.token_ids) == 12 for r in batch)
    warpers = LogitsProcessorList([TemperatureLogitsWarper(1.5), FILTERS[name][1](value)])
    cut = 0
    for logits, ids in steps:
        kept = torch.isfinite(warpers(None, logits.clone()))  # (B, V)
        assert kept.gather(1, ids[:, None]).all()
        cut += int((~kept).sum())
    assert len(steps) >= 4 * 12 and cut > 0


@pytest.mark.parametrize("name", list(FILTERS))
def test_embedded_model_samples_with_each_option(smollm2, name, monkeypatch):
    """The embedded SmolLM2: a chat answer sampled with the option and a seed is reproducible,
    and every token comes from transformers' kept set."""
    value = {"typical_p": 0.9, "epsilon_cutoff": 3e-4, "eta_cutoff": 1e-3}[name]
    steps = record_sampling(monkeypatch)
    options = dict(max_new_tokens=8, temperature=0.8, seed=1, chat=True, **{name: value})
    first = smollm2.generate("What is the capital of France?", **options)
    assert smollm2.generate("What is the capital of France?", **options).token_ids == first.token_ids
    warpers = LogitsProcessorList([TemperatureLogitsWarper(0.8), FILTERS[name][1](value)])
    for logits, ids in steps:
        assert torch.isfinite(warpers(None, logits.clone())).gather(1, ids[:, None]).all()


def test_sampling_with_them_reads_nothing_back():
    """They run at every decode step, outside the compiled step: device-only, no .item()."""
    logits = torch.randn(3, 4096, generator=torch.Generator().manual_seed(0)) * 3
    settings = SamplingSettings(temperature=0.7, top_p=0.95, typical_p=0.9, epsilon_cutoff=1e-4, eta_cutoff=1e-3)
    with reading_back_forbidden():
        processed = process_logits(logits, settings)
        sample_next(logits, settings, generator=torch.Generator().manual_seed(0))
    warpers = LogitsProcessorList([TemperatureLogitsWarper(0.7), transformers.TopPLogitsWarper(0.95),
                                   TypicalLogitsWarper(0.9), EpsilonLogitsWarper(1e-4), EtaLogitsWarper(1e-3)])
    assert torch.equal(processed, warpers(None, logits.clone()))


def test_a_compiled_model_samples_with_them_without_recompiling():
    """They run outside the compiled decode step, so it is compiled once, and the tokens are
    the eager model's."""
    assert_compiled_samples_like_eager(typical_p=0.8, epsilon_cutoff=0.01, eta_cutoff=0.02)


@pytest.mark.parametrize("options, fragment", [
    (dict(typical_p=0.0), "typical_p=0.0 is invalid: it must be in (0, 1] (1 or None = no typical sampling)"),
    (dict(typical_p=1.5), "typical_p=1.5 is invalid: it must be in (0, 1]"),
    (dict(epsilon_cutoff=1.0), "epsilon_cutoff=1.0 is invalid: it must be in [0, 1) (0 or None = no epsilon cutoff"),
    (dict(epsilon_cutoff=-1e-4), "epsilon_cutoff=-0.0001 is invalid: it must be in [0, 1)"),
    (dict(eta_cutoff=2.0), "eta_cutoff=2.0 is invalid: it must be in [0, 1) (0 or None = no eta cutoff"),
    (dict(eta_cutoff=float("nan")), "eta_cutoff=nan is invalid: expected a finite number"),
    (dict(typical_p="0.9"), "typical_p='0.9' is invalid: expected a finite number"),
])
def test_bad_values_are_refused_by_name(options, fragment):
    with pytest.raises(GenerationError, match=re.escape(fragment)):
        check_options(**options)


def test_off_values_change_nothing():
    logits = random_logits(2, 3, 100)
    off = SamplingSettings(typical_p=1.0, epsilon_cutoff=0.0, eta_cutoff=0.0)
    assert torch.equal(process_logits(logits, off), logits)


# -- the command line and chat ---------------------------------------------------------------------

@pytest.mark.parametrize("flag, name, value", [("--typical-p", "typical_p", 0.8),
                                               ("--epsilon-cutoff", "epsilon_cutoff", 0.01),
                                               ("--eta-cutoff", "eta_cutoff", 0.02)])
def test_cli_flags_reach_the_sampler(model_dir, only_generate_and_chat, capsys, flag, name, value):
    argv = ["generate", "Hello", "--model", model_dir, "-q", "--seed", "2", "--max-new-tokens", "10",
            "--temperature", "1.5", "--json", flag, str(value)]
    assert cli.main(argv) == 0
    data = json.loads(capsys.readouterr().out)
    expected = generate(toy_model(seed=0), "Hello", max_new_tokens=10, temperature=1.5, seed=2, **{name: value})
    assert data["token_ids"] == expected.token_ids


@pytest.mark.parametrize("command", ["generate", "chat"])
@pytest.mark.parametrize("flags, fragment", [
    (["--typical-p", "0"], "--typical-p 0 is invalid: it must be in (0, 1]"),
    (["--epsilon-cutoff", "1"], "--epsilon-cutoff 1 is invalid: it must be in [0, 1)"),
    (["--eta-cutoff", "-0.5"], "--eta-cutoff -0.5 is invalid: it must be in [0, 1)"),
])
def test_cli_refuses_bad_values_in_one_line(model_dir, only_generate_and_chat, capsys, command, flags, fragment):
    argv = [command] + (["Hello"] if command == "generate" else []) + ["--model", model_dir, "-q"] + flags
    assert cli.main(argv) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith(f"lucidlm {command}: error: ")
    assert captured.err.count("\n") == 1 and "Traceback" not in captured.err
    assert fragment in captured.err


def test_chat_set_takes_them():
    model = toy_model(seed=0)
    out = io.StringIO()
    lines = ["/set typical_p 0.8", "/set epsilon-cutoff 0.01", "/set eta_cutoff 0.02", "/set typical_p 0",
             "/show", "Hi"]
    chat_loop(model, dict(temperature=1.5, max_new_tokens=6, seed=4, stop_on_eos=False), read_line=reader(lines),
              out=out)
    shown = out.getvalue().splitlines()
    assert shown[:3] == ["(typical_p = 0.8)", "(epsilon_cutoff = 0.01)", "(eta_cutoff = 0.02)"]
    assert shown[3].startswith("/set typical_p 0 is invalid: it must be in (0, 1]")
    assert "typical_p 0.8, epsilon_cutoff 0.01, eta_cutoff 0.02" in shown[4]
    from lucidlm.chat import Conversation
    convo = Conversation()
    convo.add_user("Hi")
    answer = "".join(convo.reply(model, temperature=1.5, max_new_tokens=6, seed=4, stop_on_eos=False,
                                 typical_p=0.8, epsilon_cutoff=0.01, eta_cutoff=0.02))
    assert shown[-1] == answer
