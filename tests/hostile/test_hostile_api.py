"""Careless and hostile calls to the Python API: each is refused with one of lucidlm's own
errors (never a bare ValueError/TypeError/KeyError/IndexError/RuntimeError from deep inside),
one line naming the value and the fix. The model is a tiny random GPT-2 (GPT-2's real BPE)."""

from __future__ import annotations

import math

import pytest
import torch

import lucidlm
from lucidlm import cli
from lucidlm import inspect as lens
from lucidlm.errors import (AdapterError, ConfigError, DeviceError, GenerationError, HookError, InputError,
                            OutputError, QuantizationError, TokenIdError, TokenizerError)
from lucidlm.inspect import patching
from lucidlm.peft import add_lora
from lucidlm.training.config import FinetuneConfig, TrainConfig

from harness import api_refused, filling_disk  # tests/hostile is on sys.path


@pytest.fixture(scope="module")
def model():
    return lucidlm.load("gpt2", random_init=True, n_layers=2, d_model=32, n_heads=2, max_seq_len=32)


def tiny(**overrides):
    return lucidlm.load("gpt2", random_init=True, n_layers=1, d_model=32, n_heads=2, max_seq_len=8, **overrides)


GENERATE_CASES = [  # (keyword arguments of model.generate, error type, what the message must name)
    (dict(prompt="\udcff"), TokenizerError, [r"surrogate", r"character 0"]),
    (dict(prompt="ok \udc80 there"), TokenizerError, [r"character 3", "UTF-8"]),
    (dict(prompt=None), GenerationError, [r"prompt=None", "token ids"]),
    (dict(prompt=[1.5, 2]), GenerationError, [r"prompt=\[1\.5, 2\]"]),
    (dict(prompt=[[[1]]]), GenerationError, [r"prompt=\[\[1\]\]"]),
    (dict(prompt={"a": 1}), GenerationError, [r"prompt=\{'a': 1\}"]),
    (dict(prompt=torch.tensor([1.5, 2.0])), GenerationError, ["integer dtype", "float32"]),
    (dict(seed=2 ** 64), GenerationError, [r"seed=18446744073709551616", r"2\*\*64 - 1"]),
    (dict(seed=-1), GenerationError, [r"seed=-1"]),
    (dict(seed="x"), GenerationError, [r"seed='x'"]),
    (dict(temperature=math.inf), GenerationError, [r"temperature=inf", "finite"]),
    (dict(temperature="hot"), GenerationError, [r"temperature='hot'"]),
    (dict(top_p="x"), GenerationError, [r"top_p='x'"]),
    (dict(top_k="x"), GenerationError, [r"top_k='x'"]),
    (dict(top_k=math.inf), GenerationError, [r"top_k=inf"]),
    (dict(top_k=math.nan), GenerationError, [r"top_k=nan"]),
    (dict(repetition_penalty="x"), GenerationError, [r"repetition_penalty='x'"]),
    (dict(repetition_penalty=math.inf), GenerationError, [r"repetition_penalty=inf"]),
    (dict(max_new_tokens=True), GenerationError, [r"max_new_tokens=True"]),
    (dict(num_beams=2, length_penalty="x"), GenerationError, [r"length_penalty='x'"]),
    (dict(num_beams=2, length_penalty=math.nan), GenerationError, [r"length_penalty=nan"]),
    (dict(num_beams=100_000), GenerationError, [r"num_beams=100000", "50257 tokens"]),
    (dict(stop=5), GenerationError, [r"stop=5", "non-empty string"]),
    (dict(stop=[5]), GenerationError, [r"stop=\[5\]"]),
    (dict(stop=[""]), GenerationError, [r"stop=\[''\]"]),
    (dict(context_overflow=5), GenerationError, [r"context_overflow=5"]),
]


@pytest.mark.parametrize("kwargs, error, names", GENERATE_CASES, ids=[str(c[0])[:40] for c in GENERATE_CASES])
def test_generate_refuses(model, kwargs, error, names):
    kwargs = {"prompt": "Hello", "max_new_tokens": 2, **kwargs}
    api_refused(lambda: model.generate(**kwargs), error, names)


def test_stream_refuses_before_the_first_piece(model):
    api_refused(lambda: model.stream(None), GenerationError, ["prompt=None"])
    api_refused(lambda: model.stream("\udcff"), TokenizerError, ["surrogate"])


def test_a_huge_max_new_tokens_stops_at_the_context(model):
    prompt = model.tokenizer.encode("Hello there")
    result = model.generate(prompt, max_new_tokens=10 ** 18, temperature=0, stop_on_eos=False)
    assert len(prompt) + len(result.token_ids) == model.config.max_seq_len and result.finish_reason == "length"


def test_a_denormal_temperature_is_greedy_not_nan(model):
    # T -> 0 is the argmax in the limit; 1e-45 would overflow float32 logits / T to inf (NaN softmax).
    greedy = model.generate("Hello there", max_new_tokens=6, temperature=0).token_ids
    for temperature in (1e-45, 5e-324, 1e-30):
        assert model.generate("Hello there", max_new_tokens=6, temperature=temperature, seed=1).token_ids == greedy


TOKENIZER_CASES = [
    (lambda t: t.encode("ab\udcffc"), TokenizerError, ["character 2", "surrogate"]),
    (lambda t: t.decode("abc"), TokenizerError, ["token ids", "str"]),
    (lambda t: t.decode([1.5]), TokenizerError, [r"1\.5", "float"]),
    (lambda t: t.decode([None]), TokenizerError, ["None"]),
    (lambda t: t.encode(None), TokenizerError, ["NoneType"]),
]


@pytest.mark.parametrize("call, error, names", TOKENIZER_CASES)
def test_tokenizer_refuses(model, call, error, names):
    api_refused(lambda: call(model.tokenizer), error, names)


INSPECT_CASES = [
    (lambda m: m.run_with_cache(None), InputError, ["NoneType"]),
    (lambda m: m.run_with_cache([1, "a"]), InputError, ["list of ints"]),
    (lambda m: m.run_with_cache([[1, 2], [3]]), InputError, ["list of ints"]),
    (lambda m: m.run_with_cache("ab", names_filter=5), HookError, ["names_filter=5"]),
    (lambda m: m.run_with_cache("ab", names_filter=[5]), HookError, ["5", "not a hook name"]),
    (lambda m: m.run_with_cache("ab", atention_mask=None), InputError, ["atention_mask", "attention_mask"]),
    (lambda m: m.run_with_hooks("ab", fwd_hooks=[], lats_token_only=True), InputError, ["lats_token_only"]),
    (lambda m: m(None), InputError, ["NoneType"]),
    (lambda m: m.to_tokens(None), InputError, ["None"]),
    (lambda m: m.to_tokens(5), InputError, ["5"]),
    (lambda m: m.to_tokens(["a", 5]), InputError, [r"\['a', 5\]"]),
    (lambda m: m.to_tokens("\udcff"), TokenizerError, ["surrogate"]),
    (lambda m: m.to_str_tokens(None), InputError, ["None"]),
    (lambda m: m.to_str_tokens([1.5]), InputError, [r"1\.5"]),
    (lambda m: m.to_string("abc"), InputError, ["'abc'"]),
    (lambda m: m.to_string(torch.tensor([0.5])), InputError, ["float32"]),
    (lambda m: lens.logit_lens(m, None), InputError, ["NoneType"]),
    (lambda m: m.setup_kv_cache(-1), InputError, ["batch_size=-1"]),
    (lambda m: m.setup_kv_cache(10 ** 9), InputError, ["KV cache", "memory"]),
    (lambda m: m.setup_kv_cache(1, max_seq_len="x"), InputError, ["max_seq_len='x'"]),
    (lambda m: m.to_tokens("Hi", prepend_bos="yes"), InputError, ["prepend_bos='yes'"]),
    (lambda m: m.set_use_attn_result("no"), ConfigError, ["attn_result='no'"]),
]


@pytest.mark.parametrize("call, error, names", INSPECT_CASES)
def test_inspection_refuses(model, call, error, names):
    try:
        api_refused(lambda: call(model), error, names)
    finally:
        model.clear_kv_cache()


LOAD_CASES = [
    (lambda: lucidlm.load(5), ConfigError, ["source", "int"]),
    (lambda: tiny(seed=2 ** 64), ConfigError, ["seed=18446744073709551616"]),
    (lambda: tiny(seed=-3), ConfigError, ["seed=-3"]),
    (lambda: tiny(seed="x"), ConfigError, ["seed='x'"]),
    (lambda: tiny(device="foo"), DeviceError, ["'foo'"]),
    (lambda: tiny(device="gpu"), DeviceError, ["'gpu'", "cuda"]),
    (lambda: lucidlm.quantize(None, "int8"), QuantizationError, ["NoneType"]),
]


@pytest.mark.parametrize("call, error, names", LOAD_CASES)
def test_load_and_quantize_refuse(call, error, names):
    api_refused(call, error, names)


@pytest.mark.parametrize("device", ["cuda", "cuda:7", "mps"])
def test_a_device_this_machine_lacks(monkeypatch, device):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a CPU-only machine, even on a GPU host
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    api_refused(lambda: tiny(device=device), DeviceError, [repr(device), "--device cpu"])


CONFIG_CASES = [  # the same checks for pretrain(TrainConfig(...)), finetune(FinetuneConfig(...)) and the CLI
    (dict(learning_rate=math.nan), [r"learning_rate \(--learning-rate\)=nan", "> 0"]),
    (dict(learning_rate=math.inf), [r"learning_rate", "finite"]),
    (dict(learning_rate=-1.0), [r"learning_rate \(--learning-rate\)=-1\.0"]),
    (dict(beta1=2.0), [r"beta1 \(--beta1\)=2\.0", r"\[0\.0, 1\.0\)"]),
    (dict(beta2=-0.1), [r"beta2 \(--beta2\)=-0\.1"]),
    (dict(weight_decay=math.nan), [r"weight_decay \(--weight-decay\)=nan"]),
    (dict(grad_clip=math.nan), [r"grad_clip \(--grad-clip\)=nan"]),
    (dict(batch_size=0), [r"batch_size \(--batch-size\)=0", ">= 1"]),
    (dict(batch_size=2.5), [r"batch_size \(--batch-size\)=2\.5", "whole number"]),
    (dict(max_iters=-5), [r"max_iters \(--max-iters\)=-5"]),
    (dict(block_size=-1), [r"block_size \(--block-size\)=-1"]),
    (dict(block_size=0), [r"block_size \(--block-size\)=0"]),
    (dict(seed=2 ** 64), [r"seed \(--seed\)=18446744073709551616"]),
    (dict(seed=-1), [r"seed \(--seed\)=-1"]),
    (dict(sample_seed=2 ** 70), [r"sample_seed \(--sample-seed\)"]),
    (dict(sample_top_p=0.0), [r"sample_top_p \(--sample-top-p\)=0\.0"]),
    (dict(sample_temperature=-1.0), [r"sample_temperature"]),
    (dict(sample_prompt="ROMEO\udcff"), [r"sample_prompt \(--sample-prompt\)", "UTF-8", "character 5"]),
    (dict(val_fraction=1.0), [r"val_fraction \(--val-fraction\)=1\.0"]),
    (dict(dtype="float64"), [r"dtype \(--dtype\)='float64'", "float32"]),
    (dict(out_dir=""), [r"out_dir \(--out\)"]),
    (dict(decay_lr="no"), [r"decay_lr \(--constant-lr\)='no'"]),
]


@pytest.mark.parametrize("recipe", [TrainConfig, FinetuneConfig])
@pytest.mark.parametrize("overrides, names", CONFIG_CASES, ids=[str(c[0])[:30] for c in CONFIG_CASES])
def test_training_configs_refuse(tmp_path, recipe, overrides, names):
    api_refused(lambda: recipe(**{"data": "corpus.txt", "out_dir": str(tmp_path / "run"), **overrides}),
                ConfigError, names)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("overrides, names", [
    (dict(preset="gpt3"), [r"preset \(--preset\)='gpt3'", "gpt2"]),
    (dict(n_layer=0), [r"n_layer \(--n-layer\)=0"]),
    (dict(n_layer=10 ** 9), [r"n_layer \(--n-layer\)=1000000000"]),
    (dict(dropout=1.0), [r"dropout \(--dropout\)=1\.0"]),
    (dict(tokenizer="sentencepiece"), [r"tokenizer \(--tokenizer\)='sentencepiece'"]),
])
def test_pretraining_config_refuses(overrides, names):
    api_refused(lambda: TrainConfig(data="c.txt", out_dir="o", **overrides), ConfigError, names)


@pytest.mark.parametrize("overrides, names", [
    (dict(rank=0), [r"rank \(--rank\)=0"]),
    (dict(alpha=math.inf), [r"alpha \(--alpha\)=inf"]),
    (dict(lora_dropout=1.5), [r"lora_dropout \(--dropout\)=1\.5"]),
    (dict(epochs=0.0), [r"epochs \(--epochs\)=0\.0"]),
    (dict(method="qlora"), [r"method \(--method\)='qlora'", "lora"]),
    (dict(prefix_length=-2), [r"prefix_length \(--prefix-length\)=-2"]),
])
def test_finetuning_config_refuses(overrides, names):
    api_refused(lambda: FinetuneConfig(data="c.txt", out_dir="o", **overrides), ConfigError, names)


def _disk_full(*args, **kwargs):
    import errno

    raise OSError(errno.ENOSPC, "No space left on device")


def test_a_full_disk_while_training_is_one_line_naming_out(tmp_path, monkeypatch):
    from lucidlm.training import checkpointer, pretrain

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("to be or not to be, that is the question\n" * 40)
    monkeypatch.setattr(checkpointer, "save_file", _disk_full)  # the first checkpoint write finds the disk full
    config = TrainConfig(data=str(corpus), out_dir=str(tmp_path / "run"), preset="seed000", n_layer=1, n_embd=16,
                         n_head=2, block_size=8, batch_size=2, max_iters=1, eval_interval=1, eval_iters=1,
                         sample_tokens=0, progress=False, warmup_iters=0, lr_decay_iters=1)
    error = api_refused(lambda: pretrain(config), OutputError, ["no space left on device", "run", "--out"])
    assert isinstance(error, OSError)  # still an OSError for generic handlers


def test_a_full_disk_while_writing_a_report(model, tmp_path, monkeypatch, capsys):
    import lucidlm.staging as staging

    kept = tmp_path / "report.html"
    kept.write_text("the previous report\n")
    real = staging.staging_file

    full_disk = filling_disk(real)  # the staging file (the one atomic writer's) finds the disk full
    monkeypatch.setattr(staging, "staging_file", full_disk)
    monkeypatch.setattr("lucidlm.loading.load", lambda *a, **k: model)
    assert cli.main(["inspect", "Hello", "-q", "--out", str(kept)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"No space left on device while writing {kept}" in err and "--out" in err
    monkeypatch.undo()
    assert kept.read_text() == "the previous report\n"  # the old report is intact
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.html"]  # and no staging file is left


def _patch_metric(logits):
    return logits[0, -1, 0] - logits[0, -1, 1]


MORE_INSPECT_CASES = [  # patching, residual decomposition, plots, steps: layer / head / position / type mistakes
    (lambda m, c: patching.get_act_patch_resid_pre(m, None, c, _patch_metric), InputError, ["corrupted_tokens"]),
    (lambda m, c: patching.get_act_patch_resid_pre(m, [[0.5, 1.0]], c, _patch_metric), InputError, [r"0\.5"]),
    (lambda m, c: patching.get_act_patch_resid_pre(m, "Hello there", c, lambda logits: logits), InputError,
     ["one number", "shape"]),
    (lambda m, c: c["pattern", 9], HookError, ["9"]),
    (lambda m, c: c.accumulated_resid("x"), HookError, ["layer='x'|layer=x"]),
    (lambda m, c: c.accumulated_resid(9), HookError, ["layer=9"]),
    (lambda m, c: c.stack_head_results(layer=9), HookError, ["9"]),
    (lambda m, c: c.logit_attrs(c.accumulated_resid(), tokens=10 ** 9), TokenIdError, ["1000000000", "50256"]),
    (lambda m, c: c.logit_attrs(c.accumulated_resid(), tokens=[1.5]), InputError, ["float"]),
    (lambda m, c: c.apply_ln_final("x"), InputError, ["str"]),
    (lambda m, c: c.to("foo"), DeviceError, ["'foo'"]),
    (lambda m, c: m.run_with_cache("Hi", device="foo"), DeviceError, ["'foo'"]),
    (lambda m, c: lens.logit_lens(m, "Hello", top_k=0), InputError, ["top_k=0"]),
    (lambda m, c: lens.logit_lens(m, "Hello", top_k=10 ** 9), InputError, ["top_k=1000000000", "50257"]),
    (lambda m, c: lens.logit_lens(m, "Hello", top_k="x"), InputError, ["top_k='x'"]),
    (lambda m, c: lens.generation_steps(m, None), InputError, ["generation_steps", "None"]),
    (lambda m, c: lens.generation_steps(m, "Hi", temperature="x"), GenerationError, ["temperature='x'"]),
    (lambda m, c: lens.generation_steps(m, "Hi", temperature=1.0, seed=2 ** 64), GenerationError, ["seed="]),
    (lambda m, c: lens.generation_steps(m, "Hi", max_new_tokens=-1), GenerationError, ["max_new_tokens=-1"]),
    (lambda m, c: lens.plot_attention(c, layer=0, head="x"), HookError, ["head='x'|head=x"]),
    (lambda m, c: lens.plot_attention(c, layer=5, head=0), HookError, ["layer=5", "2 layers"]),
    (lambda m, c: lens.plot_logit_lens(None), InputError, ["NoneType"]),
    (lambda m, c: lens.plot_position_encodings(max_seq_len=-1), InputError, ["max_seq_len=-1"]),
    (lambda m, c: lens.plot_rope_angles(head_dim=3), InputError, ["head_dim=3", "even"]),
    (lambda m, c: lens.attention_view(m, None), InputError, ["attention_view"]),
    (lambda m, c: lens.build_report(m, "Hi", top_k="x"), InputError, ["top_k='x'"]),
    (lambda m, c: m.compile(mode="fastest"), ConfigError, ["mode='fastest'", "reduce-overhead"]),
    (lambda m, c: tiny(adapter=5), AdapterError, ["adapter=5"]),
    (lambda m, c: add_lora(tiny(), alpha=math.nan), AdapterError, ["alpha=nan"]),
]


@pytest.mark.parametrize("call, error, names", MORE_INSPECT_CASES)
def test_inspection_tools_refuse(model, call, error, names):
    _, cache = model.run_with_cache("Hello there")
    api_refused(lambda: call(model, cache), error, names)


def test_a_report_path_that_is_a_directory(model, tmp_path):
    api_refused(lambda: lens.write_report(model, "Hi", tmp_path), OutputError, [str(tmp_path), "is a directory"],
                watch=[tmp_path])


def test_group_size_without_an_int_scheme_is_refused_not_ignored():
    import lucidlm
    from lucidlm.errors import QuantizationError

    for quantize in (None, "gguf"):
        api_refused(lambda: lucidlm.load(group_size=64, quantize=quantize), QuantizationError,
                    names=["group_size=64", "quantize='int4'"])


def test_input_pos_without_a_cache_or_not_slots_is_refused():
    from lucidlm.errors import InputError

    model = lucidlm.load("shakespeare-char", random_init=True, seed=0)
    ids = torch.tensor([[1, 2, 3]])
    api_refused(lambda: model.run_with_cache(ids, input_pos=torch.arange(3)), InputError, names=["setup_kv_cache"])
    model.setup_kv_cache(1, 16)
    for bad in ("x", torch.arange(2), torch.tensor([0.0, 1.0, 2.0]), torch.tensor([-1, 0, 1])):
        api_refused(lambda: model.run_with_cache(ids, input_pos=bad), InputError, names=["input_pos|slot"])
