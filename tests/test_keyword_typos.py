"""A misspelt keyword is a lucidlm error with "did you mean", everywhere in the public API
(suggest.keywords_checked), while help() and inspect.signature still show the real
parameters; and every public name has a docstring of its own."""

import inspect

import pytest
import torch

import lucidlm
from lucidlm import peft
from lucidlm import inspect as li
from lucidlm.errors import AdapterError, ConfigError, GenerationError, InputError, QuantizationError
from lucidlm.chat import Conversation
from lucidlm.generation import beam_search, generate_batch
from lucidlm.inspect import patching
from lucidlm.training.config import FinetuneConfig, LoopConfig, TrainConfig

pytestmark = pytest.mark.usefixtures("one_thread")


def tiny():
    return lucidlm.load("gpt2", random_init=True, n_layers=1, d_model=32, n_heads=2, max_seq_len=16)


@pytest.fixture(scope="module")
def model():
    return tiny()


@pytest.fixture(scope="module")
def clean_cache(model):
    return model.run_with_cache([1, 2, 3])[1]


@pytest.fixture(scope="module")
def adapter_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("adapter")
    m = tiny()
    peft.add_lora(m, r=2)
    peft.save_adapter(m, directory)
    return directory


def metric(logits):
    return logits[0, -1, 0]


# (label, the public function whose signature must survive, call, error class, typo, suggestion)
CASES = [
    ("quantize", lambda: lucidlm.quantize, lambda m, c, d: lucidlm.quantize(tiny(), "int8", grup_size=32),
     QuantizationError, "grup_size", "group_size"),
    ("beam_search", lambda: beam_search, lambda m, c, d: beam_search(m, [1, 2], num_beam=2, max_new_tokens=2),
     GenerationError, "num_beam", "num_beams"),
    ("logit_lens", lambda: li.logit_lens, lambda m, c, d: li.logit_lens(m, [1, 2], topk=3),
     InputError, "topk", "top_k"),
    ("build_report", lambda: li.build_report, lambda m, c, d: li.build_report(m, [1, 2], topk=3),
     InputError, "topk", "top_k"),
    ("write_report", lambda: li.write_report, lambda m, c, d: li.write_report(m, [1, 2], d / "r.html", topk=3),
     InputError, "topk", "top_k"),
    ("to_tokens", lambda: li.to_tokens, lambda m, c, d: li.to_tokens(m, "hi", prepend_bo=True),
     InputError, "prepend_bo", "prepend_bos"),
    ("to_str_tokens", lambda: li.to_str_tokens, lambda m, c, d: li.to_str_tokens(m, "hi", prepend_bo=True),
     InputError, "prepend_bo", "prepend_bos"),
    ("generation_steps", lambda: li.generation_steps,
     lambda m, c, d: li.generation_steps(m, [1, 2], temperatur=0.5), GenerationError, "temperatur", "temperature"),
    ("print_steps", lambda: li.print_steps, lambda m, c, d: li.print_steps(m, [1, 2], stop_on_eo=False),
     GenerationError, "stop_on_eo", "stop_on_eos"),
    ("get_act_patch_resid_pre", lambda: patching.get_act_patch_resid_pre,
     lambda m, c, d: patching.get_act_patch_resid_pre(m, [1, 2, 3], c, patching_metrc=metric),
     InputError, "patching_metrc", "patching_metric"),
    ("get_act_patch_block_every", lambda: patching.get_act_patch_block_every,
     lambda m, c, d: patching.get_act_patch_block_every(m, [1, 2, 3], c, metrc=metric), InputError, "metrc", "metric"),
    ("attribution_patch", lambda: patching.attribution_patch,
     lambda m, c, d: patching.attribution_patch(m, c, [1, 2, 3], metric, activation_nme="resid_pre"),
     InputError, "activation_nme", "activation_name"),
    ("attr_patch_resid_pre", lambda: patching.attr_patch_resid_pre,
     lambda m, c, d: patching.attr_patch_resid_pre(m, c, [1, 2, 3], metrc=metric), InputError, "metrc", "metric"),
    ("add_lora", lambda: peft.add_lora, lambda m, c, d: peft.add_lora(tiny(), alph=4), AdapterError, "alph", "alpha"),
    ("add_prefix", lambda: peft.add_prefix, lambda m, c, d: peft.add_prefix(tiny(), lenght=4),
     AdapterError, "lenght", "length"),
    ("add_adapters", lambda: peft.add_adapters, lambda m, c, d: peft.add_adapters(tiny(), bottle_neck=8),
     AdapterError, "bottle_neck", "bottleneck"),
    ("save_adapter", lambda: peft.save_adapter, lambda m, c, d: peft.save_adapter(m, d, nme="x"),
     AdapterError, "nme", "name"),
    ("load_adapter", lambda: peft.load_adapter, lambda m, c, d: peft.load_adapter(tiny(), d, nme="x"),
     AdapterError, "nme", "name"),
    ("ModelConfig", lambda: lucidlm.ModelConfig, lambda m, c, d: lucidlm.ModelConfig(n_layer=2),
     ConfigError, "n_layer", "n_layers"),
    ("TrainConfig", lambda: TrainConfig, lambda m, c, d: TrainConfig(data="x", out_dir="y", max_iter=5),
     ConfigError, "max_iter", "max_iters"),
    ("FinetuneConfig", lambda: FinetuneConfig, lambda m, c, d: FinetuneConfig(modle="x"),
     ConfigError, "modle", "model"),
    ("LoopConfig", lambda: LoopConfig, lambda m, c, d: LoopConfig(batch_sise=2),
     ConfigError, "batch_sise", "batch_size"),
    ("attention_view", lambda: li.attention_view, lambda m, c, d: li.attention_view(m, [1, 2], cach=None),
     InputError, "cach", "cache"),
    ("generate_batch", lambda: generate_batch, lambda m, c, d: generate_batch(m, [[1], [2]], topk=3),
     GenerationError, "topk", "top_k"),
    ("Conversation", lambda: Conversation, lambda m, c, d: Conversation(sytem="x"), GenerationError, "sytem", "system"),
    ("to_tokens", lambda: lucidlm.LanguageModel.to_tokens, lambda m, c, d: m.to_tokens("hi", prepend_bo=True),
     InputError, "prepend_bo", "prepend_bos"),
]


@pytest.mark.parametrize("label,fn,call,error,typo,suggestion", CASES, ids=[c[0] for c in CASES])
def test_a_misspelt_keyword_is_a_lucidlm_error_with_the_closest_option(model, clean_cache, adapter_dir, label, fn,
                                                                        call, error, typo, suggestion):
    with pytest.raises(error) as caught:
        call(model, clean_cache, adapter_dir)
    text = str(caught.value)
    assert label in text and repr(typo) in text
    assert f"did you mean {suggestion!r}?" in text
    params = inspect.signature(fn()).parameters  # the real parameters, not (*args, **kwargs)
    assert suggestion in params and not any(p.kind is p.VAR_KEYWORD for p in params.values())


def test_config_fields_are_refused_in_from_dicts_words():
    with pytest.raises(ConfigError, match=r"^ModelConfig: unknown config field\(s\) \['n_layer'\]; valid fields are: "):
        lucidlm.ModelConfig(n_layer=2)
    with pytest.raises(ConfigError, match=r"unknown config field\(s\) \['n_layer'\]") as caught:
        lucidlm.ModelConfig.from_dict({"n_layer": 2})
    assert "did you mean 'n_layers'?" in str(caught.value)


def test_configs_still_build_and_replace():
    assert lucidlm.ModelConfig(n_layers=2, d_model=64, n_heads=2).n_layers == 2
    assert TrainConfig(data="x", out_dir="y", max_iters=5).max_iters == 5
    assert FinetuneConfig(method="lora").resolved(max_iters=3).max_iters == 3  # dataclasses.replace


def test_the_wrapper_costs_nothing_but_a_frame_and_keeps_inner_type_errors():
    from lucidlm.suggest import keywords_checked

    @keywords_checked(InputError)
    def f(a, b=1):
        """Doc."""
        return a + b

    assert f(1, b=2) == 3 and f.__doc__ == "Doc." and f.__name__ == "f"
    assert list(inspect.signature(f).parameters) == ["a", "b"]
    with pytest.raises(TypeError, match="concatenate"):  # raised inside: not a keyword problem
        f("x", b=1)
    with pytest.raises(TypeError, match="missing"):  # a missing argument stays Python's own error
        f()
    with pytest.raises(InputError, match=r"f\(\) has no option 'c'; its options are a, b"):
        f(1, c=2)


def test_generation_steps_takes_generates_name_for_the_eos_switch(model):
    off = list(li.generation_steps(model, [1, 2], max_new_tokens=3, stop_on_eos=False))
    old = list(li.generation_steps(model, [1, 2], max_new_tokens=3, stop_at_eos=False))  # the older name
    assert [s.new_id for s in off] == [s.new_id for s in old] and len(off) == 3
    with pytest.raises(GenerationError, match="stop_on_eos"):
        li.generation_steps(model, [1, 2], stop_on_eos="no")


def test_patching_sweeps_carry_their_public_names():
    for name in dir(patching):
        if name.startswith(("get_act_patch_", "attr_patch_")):
            fn = getattr(patching, name)
            assert fn.__name__ == fn.__qualname__ == name
            assert inspect.unwrap(fn).__qualname__ == name


@pytest.mark.parametrize("call,own,suggestion", [
    (lambda m: m.run_with_cache([1, 2], name_filter="hook_embed"), "run_with_cache", "names_filter"),
    (lambda m: m.run_with_cache([1, 2], remove_batch=True), "run_with_cache", "remove_batch_dim"),
    (lambda m: m.run_with_hooks([1, 2], fwd_hook=[]), "run_with_hooks", "fwd_hooks"),
    (lambda m: m.run_with_hooks([1, 2], reset_hook_end=False), "run_with_hooks", "reset_hooks_end"),
])
def test_run_with_cache_names_its_own_options(model, call, own, suggestion):
    with pytest.raises(InputError) as caught:
        call(model)
    text = str(caught.value)
    assert f"{own}()" in text and suggestion in text.split("the forward pass")[0]
    assert f"did you mean {suggestion!r}?" in text


# -- docstrings ---------------------------------------------------------------------------------
def _public():
    from lucidlm import generation, quantization, training
    from lucidlm.inspect import LogitLens
    from lucidlm.training import PaddedBatch, Trainer, TrainResult
    names = {
        "peft.merge_and_unload": peft.merge_and_unload, "peft.adapter_names": peft.adapter_names,
        "peft.lora_layers": peft.lora_layers, "peft.freeze_prefix": peft.freeze_prefix,
        "peft.method_of": peft.method_of, "peft.BottleneckAdapter": peft.BottleneckAdapter,
        "peft.PrefixEncoder": peft.PrefixEncoder,
        "training.Trainer": Trainer, "Trainer.fit": Trainer.fit, "Trainer.save_checkpoint": Trainer.save_checkpoint,
        "Trainer.load_state_dict": Trainer.load_state_dict, "Trainer.lr_at": Trainer.lr_at,
        "training.TrainResult": TrainResult, "training.PaddedBatch": PaddedBatch,
        "training.TrainConfig": training.TrainConfig,
        "quantization.is_quantized": quantization.is_quantized, "quantization.scheme_class": quantization.scheme_class,
        "quantization.Int8Linear": quantization.Int8Linear, "quantization.Int4Linear": quantization.Int4Linear,
        "ModelConfig": lucidlm.ModelConfig, "ModelConfig.save": lucidlm.ModelConfig.save,
        "ModelConfig.load": lucidlm.ModelConfig.load, "ModelConfig.to_dict": lucidlm.ModelConfig.to_dict,
        "inspect.LogitLens": LogitLens, "generation.check_options": generation.check_options,
    }
    for name in dir(patching):
        if name.startswith("layer_") and name.endswith("_patch_setter"):
            names[f"patching.{name}"] = getattr(patching, name)
    return names


@pytest.mark.parametrize("name", sorted(_public()))
def test_every_public_name_has_its_own_docstring(name):
    obj = _public()[name]
    doc = obj.__doc__ or ""
    assert doc.strip(), f"{name} has no docstring"
    if inspect.isclass(obj):
        assert not doc.startswith(obj.__name__ + "("), f"{name} has only the dataclass-generated docstring"
        assert doc != (obj.__mro__[1].__doc__ or ""), f"{name} only inherits its base's docstring"


def test_check_options_lists_the_options():
    from lucidlm.generation import check_options
    for option in ("max_new_tokens", "temperature", "top_k", "top_p", "min_p", "repetition_penalty", "typical_p",
                   "epsilon_cutoff", "eta_cutoff", "no_repeat_ngram_size", "suppress_tokens", "bad_words_ids",
                   "sequence_bias", "logit_bias", "presence_penalty", "frequency_penalty", "seed",
                   "stop", "stop_on_eos", "num_beams",
                   "length_penalty",
                   "min_new_tokens", "context_overflow"):
        assert option in check_options.__doc__


def test_training_configs_take_the_dtype_names_load_takes():
    assert TrainConfig(data="x", out_dir="y", dtype="bf16").dtype == "bfloat16"
    assert FinetuneConfig(dtype="torch.float32").dtype == "float32"



@pytest.mark.parametrize("method", ["generate", "stream"])
def test_the_model_methods_name_every_generation_option_for_shift_tab(method):
    """model.stream showed only (prompt, *, steady, **options) in Jupyter's shift-tab, and
    model.generate hid min_new_tokens, context_overflow, logprobs and reuse_cache in **options:
    each method names every option the functional generate takes, with its default."""
    import inspect

    from lucidlm.generation import generate
    from lucidlm.language_model import LanguageModel

    def keywords(fn):
        return {name: p.default for name, p in inspect.signature(fn).parameters.items()
                if p.kind is inspect.Parameter.KEYWORD_ONLY}

    assert keywords(getattr(LanguageModel, method)).items() >= keywords(generate).items()
