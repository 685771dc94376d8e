"""Compiled decoding (``LanguageModel.compile``, ``load(compile=True)``, ``--compile``) gives
the tokens eager decoding gives."""

from __future__ import annotations

import copy
import re
import time

import pytest
import torch
from torch._inductor import list_mode_options
from generation_toys import byte_tokenizer, fresh_dynamo, one_torch_thread, toy_model  # noqa: F401 (autouse fixtures)

import lucidlm
from lucidlm import LanguageModel, preset
from lucidlm.cli import build_parser
from lucidlm.errors import ConfigError
from lucidlm.generation.compiled import keep_input_guards

SMOLLM2_PROMPTS = ["The capital of France is", "Once upon a time, in a small village,", "def fibonacci(n):"]


def greedy(model, prompt, n=24):
    return model.generate(prompt, max_new_tokens=n, temperature=0, stop_on_eos=False).token_ids


def test_compiled_greedy_equals_eager_on_a_tiny_model():
    """Prefill (dynamic shapes) and decode both go through torch.compile's graph capture
    (the aot_eager backend: dynamo + AOTAutograd, no code generation, so it is quick). Each
    graph traces its blocks once (model/traced_once.py): prompt and decode step at batch 1,
    then at batch 3 (padded), whose prompt graph once made dynamo fail and fall back to
    tracing block by block while its batch size was dynamic (``with_fixed_batch``)."""
    from torch._dynamo.utils import compilation_time_metrics

    model = toy_model(seed=3, max_seq_len=512, model_cls=LanguageModel)
    prompts = [[5, 6, 7, 8], [9, 10], list(range(20, 37))]
    eager = [greedy(model, p) for p in prompts] + [[r.token_ids for r in model.generate(
        prompts, max_new_tokens=24, temperature=0, stop_on_eos=False)]]
    compilation_time_metrics.clear()
    assert model.compile(backend="aot_eager") is model and model.compiled
    compiled = [greedy(model, p) for p in prompts] + [[r.token_ids for r in model.generate(
        prompts, max_new_tokens=24, temperature=0, stop_on_eos=False)]]
    assert compiled == eager
    assert len(compilation_time_metrics["invoke_subgraph_trace"]) == 4
    assert len(compilation_time_metrics["_compile.compile_inner"]) == 4  # no graph traced twice
    assert model(torch.tensor([prompts[0]])).shape == (1, 4, model.config.vocab_size)  # forward stays eager


def test_the_prompt_graph_is_traced_once():
    """With dynamic shapes dynamo would make each norm's eps and attention's scale a symbol,
    give up on them after tracing and trace the whole prompt graph again (the embedded model:
    a first ``generate --compile`` of 76 s instead of 34). The floats are constants instead:
    one attempt per graph, the same tokens."""
    from torch._dynamo.utils import compilation_time_metrics

    model = toy_model(seed=3, max_seq_len=512, model_cls=LanguageModel)
    eager = greedy(model, [5, 6, 7, 8], n=4)
    compilation_time_metrics.clear()
    model.compile(backend="aot_eager")
    assert greedy(model, [5, 6, 7, 8], n=4) == eager
    attempts = sorted(name for name in compilation_time_metrics if name.startswith("compile_attempt"))
    assert attempts == ["compile_attempt_0"], attempts


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


def _recorded_compile_kwargs(monkeypatch, model, **compile_args):
    calls = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: calls.append(kwargs) or fn)
    model.compile(**compile_args)
    return calls  # [decode step's kwargs, prefill's kwargs]


def test_cpu_compile_uses_the_chosen_inductor_options_unless_told_otherwise(monkeypatch):
    """The decode step gets the inductor options (a mode becomes torch's own options for it),
    the decode-only defaults and the guard filter; the prefill gets the options alone. Every
    step is isolated."""
    model = toy_model(seed=1, model_cls=LanguageModel)
    assert LanguageModel.CPU_DECODE_OPTIONS == {"cpp_wrapper": True}  # the C++ wrapper for the decode step only
    monkeypatch.setattr(LanguageModel, "CPU_INDUCTOR_OPTIONS", {"freezing": True})
    monkeypatch.setattr(LanguageModel, "CPU_DECODE_OPTIONS", {"cpp_wrapper": True, "freezing": False})
    slim = {"guard_filter_fn": keep_input_guards}
    decode, prefill = _recorded_compile_kwargs(monkeypatch, model)
    assert decode["options"] == {"freezing": False, "cpp_wrapper": True, **slim}
    assert prefill["options"] == {"freezing": True}
    assert "mode" not in decode and decode["dynamic"] is False and prefill["dynamic"] is True
    assert decode["isolate_recompiles"] and prefill["isolate_recompiles"]
    decode, prefill = _recorded_compile_kwargs(monkeypatch, model, mode="max-autotune-no-cudagraphs")
    assert decode["options"] == {**list_mode_options("max-autotune-no-cudagraphs", False), **slim}
    assert decode["options"]["max_autotune"] and "options" not in prefill and "mode" not in prefill
    decode, _ = _recorded_compile_kwargs(monkeypatch, model, options={})  # torch's own defaults
    assert decode["options"] == slim and "mode" not in decode
    decode, _ = _recorded_compile_kwargs(monkeypatch, model, options={"cpp_wrapper": True})
    assert decode["options"] == {"cpp_wrapper": True, **slim}
    decode, _ = _recorded_compile_kwargs(monkeypatch, model, backend="aot_eager")  # options are inductor's only
    assert decode["options"] == slim and decode["backend"] == "aot_eager"


def test_cuda_compile_adds_coordinate_descent_tuning_to_the_decode_step_only(monkeypatch):
    """On CUDA the default is reduce-overhead (CUDA graphs) for the decode step, plus the
    tuning that turns batch-1 matmuls into inductor's own reduction kernels; the prefill gets
    neither, and a mode or options given by the caller replace the default."""
    model = toy_model(seed=1, model_cls=LanguageModel)
    monkeypatch.setattr(LanguageModel, "device", property(lambda self: torch.device("cuda")))
    slim = {"guard_filter_fn": keep_input_guards}
    decode, prefill = _recorded_compile_kwargs(monkeypatch, model)
    assert decode["options"] == {**list_mode_options("reduce-overhead", False), "coordinate_descent_tuning": True,
                                 **slim}
    assert decode["options"]["triton.cudagraphs"] and "options" not in prefill
    assert model._compiled.cuda_graphs
    decode, _ = _recorded_compile_kwargs(monkeypatch, model, options={})  # CUDA graphs, cuBLAS matmuls
    assert decode["options"] == {**list_mode_options("reduce-overhead", False), **slim}
    decode, _ = _recorded_compile_kwargs(monkeypatch, model, mode="reduce-overhead")
    assert "coordinate_descent_tuning" not in decode["options"]


def test_guard_filter_drops_module_guards_and_keeps_inputs_and_cache():
    """What the filter keeps, on the guards dynamo really produced for a tiny model's decode step."""
    model = toy_model(seed=2, model_cls=LanguageModel, n_layers=1)
    entries = []

    def record(found):
        entries.extend(found)
        return keep_input_guards(found)

    model.compile(backend="aot_eager", prefill=False)
    model._compiled.decode = torch.compile(model.step, backend="aot_eager", fullgraph=True, dynamic=False,
                                           options={"guard_filter_fn": record})
    greedy(model, [5, 6, 7], 3)
    kept = {e.name for e, keep in zip(entries, keep_input_guards(entries)) if keep}
    dropped = {e.name for e, keep in zip(entries, keep_input_guards(entries)) if not keep}
    assert {"ids", "input_pos"} <= kept and any("kv_caches" in name for name in kept)
    assert any("blocks" in name for name in dropped) and not any(name.startswith("self._modules['kv_caches']") for name in dropped)


def test_compiled_decoding_follows_hooks_and_adapters():
    """The decode step keeps no guards on the model's modules, so lucidlm checks the model
    itself: hooks attached (through a hook point or torch) run, and run live, a hook removed
    stops running, and an adapter added after compile() is compiled in, never skipped."""
    from torch._dynamo.testing import CompileCounter

    from lucidlm.peft import add_lora

    model = toy_model(seed=4, max_seq_len=128, model_cls=LanguageModel)
    prompt = [5, 6, 7, 8]
    plain = greedy(model, prompt, 12)
    hook_point = model.blocks[0].hook_resid_post

    def flip(x, hook):
        return -x
    hook_point.add_hook(flip)
    flipped = greedy(model, prompt, 12)
    hook_point.remove_hooks()
    assert flipped != plain

    counter = CompileCounter()
    model.compile(backend=counter, prefill=False)
    assert greedy(model, prompt, 12) == plain and counter.frame_count == 1
    hook_point.add_hook(flip)
    assert greedy(model, prompt, 12) == flipped
    hook_point.remove_hooks()
    assert greedy(model, prompt, 12) == plain and counter.frame_count == 1  # the same graph again
    handle = model.blocks[0].register_forward_hook(lambda module, args, out: -out)
    assert greedy(model, prompt, 12) == flipped
    handle.remove()
    assert greedy(model, prompt, 12) == plain and counter.frame_count == 1

    # A hook attached between two steps of one stream takes effect from the next step on.
    pieces = model.stream(prompt, max_new_tokens=12, temperature=0, stop_on_eos=False)
    next(iter(pieces))
    hook_point.add_hook(flip)
    list(pieces)
    hook_point.remove_hooks()
    assert pieces.result.token_ids[0] == plain[0] and pieces.result.token_ids != plain

    eager = copy.deepcopy(model)
    eager._compiled = None
    for m in (model, eager):
        torch.manual_seed(9)
        add_lora(m, r=4, targets=("o_proj", "down_proj"))
        with torch.no_grad():
            for name, param in m.named_parameters():
                if "lora_B" in name:
                    param.normal_(std=0.5, generator=torch.Generator().manual_seed(len(name)))
    adapted = greedy(eager, prompt, 12)
    assert adapted != plain and not eager.compiled
    assert greedy(model, prompt, 12) == adapted and counter.frame_count == 2  # compiled again, with the adapter


def test_a_weight_laid_out_anew_compiles_the_steps_again():
    """The compiled steps skip inductor's layout checks of their inputs and keep no guards on
    the model's weights, so a weight swapped for one of the same shape and values but other
    strides (a transposed view) must be caught by lucidlm's own check, and the steps built
    again, rather than read in the traced order."""
    from torch._dynamo.testing import CompileCounter

    model = toy_model(seed=4, max_seq_len=128, model_cls=LanguageModel)
    prompt = [5, 6, 7, 8]
    plain = greedy(model, prompt, 12)
    counter = CompileCounter()
    model.compile(backend=counter, prefill=False)
    assert greedy(model, prompt, 12) == plain and counter.frame_count == 1
    o_proj = model.blocks[0].attn.o_proj
    weight = o_proj.weight.detach()
    o_proj.weight = torch.nn.Parameter(weight.t().contiguous().t())  # same shape and values, column-major
    assert torch.equal(o_proj.weight, weight) and o_proj.weight.stride() != weight.stride()
    assert greedy(model, prompt, 12) == plain and counter.frame_count == 2
    assert greedy(model, prompt, 12) == plain and counter.frame_count == 2  # and only once


@pytest.mark.parametrize("kwargs, names", [
    (dict(mode="default", options={"freezing": True}), ["mode='default'", "not both"]),
    (dict(options=["freezing"]), [r"\['freezing'\]", "dict"]),
])
def test_compile_refuses_bad_options(kwargs, names):
    model = toy_model(model_cls=LanguageModel)
    with pytest.raises(ConfigError) as error:
        model.compile(**kwargs)
    assert all(re.search(name, str(error.value)) for name in names) and not model.compiled


@pytest.mark.slow
def test_frozen_inductor_step_follows_new_caches_and_batches():
    """Inductor with weights frozen into the step (``options={"freezing": True}``), on a tiny
    model: greedy tokens
    equal eager ones while the KV cache is replaced between calls (batch 1, batch 2, batch 1
    again with a new prompt): the cache, written every step, must stay an input of the frozen
    graph, not a constant. The prompt pass stays eager, so a decode step that read a stale
    cache would continue the wrong prompt."""
    model = toy_model(seed=5, max_seq_len=256, model_cls=LanguageModel, n_layers=1)
    prompts = [[5, 6, 7, 8], list(range(40, 51))]

    def calls():
        return [greedy(model, prompts[0], 12),
                [r.token_ids for r in model.generate(prompts, max_new_tokens=12, temperature=0, stop_on_eos=False)],
                greedy(model, prompts[1], 12)]
    eager = calls()
    model.compile(prefill=False, options={"freezing": True})
    assert calls() == eager


@pytest.mark.parametrize("wanted, max_seq_len, expected", [(1, 512, 64), (64, 512, 64), (65, 512, 128), (80, 512, 128),
                                                           (300, 512, 512), (300, 400, 400), (None, 400, 400)])
def test_compiled_cache_length_is_a_power_of_two_from_64_up_to_the_context(wanted, max_seq_len, expected):
    """Every step attends over the whole cache: a short generation gets a short cache, and a
    growing conversation reuses each size until it doubles."""
    model = toy_model(seed=6, max_seq_len=max_seq_len, model_cls=LanguageModel)
    model.setup_kv_cache(2, wanted)
    assert model.kv_caches[0].max_seq_len == (wanted or max_seq_len)  # eager: exactly what was asked
    model.clear_kv_cache()
    model.compile(backend="aot_eager")
    model.setup_kv_cache(2, wanted)
    assert [cache.max_seq_len for cache in model.kv_caches] == [expected] * model.config.n_layers
    kept = model.kv_caches
    model.clear_kv_cache()
    model.setup_kv_cache(2, expected)  # rounds to the same size: the same cache, reused
    assert model.kv_caches is kept


def test_without_isolate_recompiles_each_model_keeps_its_own_compiled_steps(monkeypatch):
    """torch 2.11 (what GPU images ship) has no ``isolate_recompiles``: every compile of
    ``step`` then files its entries under the one code object, and a float model's slim-guarded
    entries were run against an int8 model (KeyError 'weight', seen on the H200, 2026-11-26).
    Without it, each compiled step gets its own copy of the code: both models decode right."""
    from lucidlm.generation import compiled

    monkeypatch.setattr(compiled, "HAS_ISOLATE", False)
    make = lambda: toy_model(seed=4, max_seq_len=128, model_cls=LanguageModel)  # noqa: E731
    models = [make(), lucidlm.quantize(make(), "int8")]
    eager = [greedy(m, [5, 6, 7, 8], 12) for m in models]
    for model in models:
        model.compile(backend="aot_eager")
    for _ in range(2):  # interleaved: each model meets the other's compiled entries in between
        assert [greedy(m, [5, 6, 7, 8], 12) for m in models] == eager


def block_traces(model, prompt, **compile_kwargs):
    """The tokens of a compiled greedy run, and how many block regions dynamo traced anew
    (``model/traced_once.py``; the rest were stamped out from an earlier trace)."""
    from torch._dynamo.utils import compilation_time_metrics

    compilation_time_metrics.clear()
    model.compile(backend="aot_eager", **compile_kwargs)
    tokens = greedy(model, prompt)
    return tokens, len(compilation_time_metrics.get("invoke_subgraph_trace", []))


def test_alike_blocks_are_traced_once_and_a_block_that_differs_on_its_own():
    """One trace for the four blocks alike; the block whose norm has another eps (a constant
    in the trace, guarded) must not reuse it. Both give eager's tokens; eps 0.5 against 1e-5
    changes that layer's output far beyond the logit margins, so a wrongly reused trace shows."""
    model = toy_model(seed=3, max_seq_len=512, model_cls=LanguageModel, n_layers=5)
    model.blocks[3].ln1.eps = 0.5
    prompt = [5, 6, 7, 8]
    eager = greedy(model, prompt)
    reference = copy.deepcopy(model)
    reference.blocks[3].ln1.eps = 1e-5
    assert greedy(reference, prompt) != eager  # the odd block matters to the tokens
    tokens, traces = block_traces(model, prompt, prefill=False)
    assert tokens == eager
    assert traces == 2  # the decode graph: the alike blocks once, the odd one once


def test_a_block_quantized_apart_is_traced_apart():
    """One block's layers int8 (a mixed GGUF file has such blocks), the others float: another
    module type behind the same names, so that block gets its own trace in each graph."""
    model = toy_model(seed=3, max_seq_len=512, model_cls=LanguageModel, n_layers=4, d_model=128)
    lucidlm.quantize(model.blocks[2], "int8")
    prompt = [5, 6, 7, 8]
    eager = greedy(model, prompt)
    tokens, traces = block_traces(model, prompt)
    assert tokens == eager
    assert traces == 2 + 2  # prefill and decode: the float blocks once, the int8 block once


def test_sliding_window_and_global_blocks_compile_apart_and_match_eager():
    """Gemma 3's pattern at toy size: local blocks (a 6-token window, their own rope base)
    and every third block global (here: local, local, global). A block learns which it is from its inputs (mask, rope
    tables). One prompt: its prefill traces two blocks, a global block's mask being None there
    (SDPA's own causal mask), its decode step one (both kinds get tensors of one shape). A
    padded batch of three: one trace each for prefill and decode (a padding mask for every
    block), none lost to the fallback. Every run gives eager's tokens."""
    from torch._dynamo.utils import compilation_time_metrics

    torch.manual_seed(5)
    tokenizer = byte_tokenizer()
    config = preset("gemma3-270m", vocab_size=tokenizer.vocab_size, d_model=64, n_layers=3, n_heads=4,
                    n_kv_heads=1, head_dim=16, d_mlp=128, max_seq_len=512, sliding_window=6,
                    global_layer_every=3, query_pre_attn_scalar=16.0)
    model = LanguageModel(config, tokenizer).eval()
    with torch.no_grad():
        model.unembed.weight.mul_(40.0)
    prompt, batch = list(range(30, 45)), [[7, 8], list(range(50, 71)), [9, 10, 11]]  # shorter and longer than the window

    def batch_tokens() -> list[list[int]]:
        return [r.token_ids for r in model.generate(batch, max_new_tokens=12, temperature=0, stop_on_eos=False)]

    eager = (greedy(model, prompt, n=12), batch_tokens())
    compilation_time_metrics.clear()
    model.compile(backend="aot_eager")
    assert (greedy(model, prompt, n=12), batch_tokens()) == eager
    assert len(compilation_time_metrics["invoke_subgraph_trace"]) == 2 + 1 + 1 + 1


def test_without_the_inlining_switch_the_blocks_are_traced_one_by_one(monkeypatch):
    """torch before the ``inline_invoke_subgraph`` switch (GPU images ship 2.11): no region,
    the blocks are traced in line as before, the same tokens."""
    from lucidlm.model import traced_once

    monkeypatch.setattr(traced_once, "supported", lambda: False)
    model = toy_model(seed=3, max_seq_len=512, model_cls=LanguageModel, n_layers=3)
    eager = greedy(model, [5, 6, 7, 8])
    tokens, traces = block_traces(model, [5, 6, 7, 8])
    assert tokens == eager and traces == 0
