"""``lucidlm.load`` refuses what it cannot honour, by name, and takes dtype/device as strings."""

from __future__ import annotations

import pytest
import torch

import lucidlm
from lucidlm.devices import resolve_device, resolve_dtype
from lucidlm.errors import ConfigError, DeviceError, LucidLMError

TINY = dict(n_layers=1, d_model=32, n_heads=2, vocab_size=50, max_seq_len=16)


@pytest.mark.parametrize("call, fragments", [
    (lambda: lucidlm.load("gpt2"), ["'gpt2' is an architecture preset, not a pretrained model", "random_init=True"]),
    (lambda: lucidlm.load("smollm2-135"), ["cannot load 'smollm2-135'", "did you mean 'smollm2-135m'?",
                                           "Pretrained models: gemma3-270m, smollm2-135m.", "Architectures (untrained"]),
    (lambda: lucidlm.load("smollm2-135m", quantise="int4"), ["unknown keyword argument 'quantise'",
                                                               "did you mean 'quantize'?"]),
    (lambda: lucidlm.load("smollm2-135m", n_layers=2), ["unknown keyword argument 'n_layers'", "random_init=True"]),
    (lambda: lucidlm.load("llama", random_init=True, n_layer=2), ["'n_layer'", "did you mean 'n_layers'?"]),
    (lambda: lucidlm.load("llamma", random_init=True), ["needs an architecture preset", "did you mean 'llama'?"]),
    (lambda: lucidlm.load(dtype="bfloat61"), ["dtype 'bfloat61'", "did you mean 'bfloat16'?"]),
    (lambda: lucidlm.load(device="gpu"), ["device 'gpu'", "did you mean 'cuda'?"]),
    (lambda: lucidlm.load(device="cdua"), ["device 'cdua'", "did you mean 'cuda'?"]),
    (lambda: lucidlm.load(dtype="bfloat"), ["dtype 'bfloat'", "did you mean 'bfloat16'?"]),
    (lambda: lucidlm.load(device="meta"), ["device 'meta' is a torch device type lucidlm does not run models on"]),
])
def test_load_refuses_by_name(call, fragments):
    with pytest.raises(LucidLMError) as info:
        call()
    for fragment in fragments:
        assert fragment in str(info.value)


def test_random_init_builds_the_preset_with_overrides():
    model = lucidlm.load("llama", random_init=True, seed=3, **TINY)
    assert isinstance(model, lucidlm.LanguageModel)
    assert (model.config.n_layers, model.config.d_model, model.config.vocab_size) == (1, 32, 50)
    again = lucidlm.load("llama", random_init=True, seed=3, **TINY)
    assert torch.equal(model.embed.weight, again.embed.weight)  # the seed makes it reproducible


@pytest.mark.parametrize("name, dtype", [("bfloat16", torch.bfloat16), ("bf16", torch.bfloat16),
                                         ("torch.float16", torch.float16), ("float32", torch.float32),
                                         (torch.bfloat16, torch.bfloat16), ("float64", torch.float64),
                                         (torch.float64, torch.float64)])
def test_dtype_names(name, dtype):
    assert resolve_dtype(name) is dtype
    assert lucidlm.load("llama", random_init=True, dtype=name, **TINY).embed.weight.dtype is dtype


def test_dtype_must_be_floating():
    with pytest.raises(DeviceError, match="not a floating-point dtype"):
        resolve_dtype(torch.int8)


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_a_float8_dtype_is_refused_before_the_load(dtype):
    # floating, so it passed the check above, and the first forward pass raised torch's own error
    with pytest.raises(DeviceError, match=r"not one lucidlm computes in .*quantize='int8'"):
        lucidlm.load("llama", random_init=True, dtype=dtype, **TINY)


def test_device_names():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device(torch.device("cpu")) == torch.device("cpu")
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolve_device("auto").type in (expected, "mps")
    if not torch.cuda.is_available():
        with pytest.raises(DeviceError, match="asked for CUDA"):
            resolve_device("cuda:0")
    with pytest.raises(ConfigError):  # DeviceError is a ConfigError, so existing handlers catch it
        resolve_device("tpu")


def test_preset_names_and_fields_get_did_you_mean():
    with pytest.raises(ConfigError, match=r"unknown preset 'shakespear-char'; .*did you mean 'shakespeare-char'\?$"):
        lucidlm.preset("shakespear-char")
    with pytest.raises(ConfigError, match=r"\['n_layer'\]; .*did you mean 'n_layers'\?$"):
        lucidlm.preset("llama", n_layer=2)


def test_model_to_takes_the_same_names_and_errors_as_load():
    model = lucidlm.load("llama", random_init=True, **TINY)
    assert model.to("bf16").embed.weight.dtype is torch.bfloat16
    assert model.to(device="cpu", dtype="half").embed.weight.dtype is torch.float16
    assert model.to(torch.float32).embed.weight.dtype is torch.float32
    with pytest.raises(DeviceError, match="did you mean 'cuda'"):
        model.to("gpu")
    if not torch.cuda.is_available():
        with pytest.raises(DeviceError, match="asked for CUDA"):
            model.to("cuda")


@pytest.mark.parametrize("name", ["SmolLM2-135M-Instruct", "HuggingFaceTB/SmolLM2-135M-Instruct", "SMOLLM2-135M"])
def test_pretrained_models_by_the_names_people_know(name, smollm2_default):
    """The Hugging Face repository id and the model's own name, any case, load the embedded model."""
    model = lucidlm.load(name)
    assert model.generation_defaults == smollm2_default.generation_defaults
    assert torch.equal(model.embed.dequantize(), smollm2_default.embed.dequantize())



def test_gemma3_in_float16_is_warned_about(gemma3):
    """Gemma 3's residual stream outgrows float16 (the float32 model's own activations say so),
    and a float16 load gives NaN logits: load says so and names bfloat16; bfloat16 loads quietly."""
    _, cache = gemma3.run_with_cache("The capital of France is", names_filter=lambda name: name.endswith("hook_resid_post"))
    assert max(t.abs().max().item() for t in cache.values()) > torch.finfo(torch.float16).max
    with pytest.warns(UserWarning, match="dtype='bfloat16'"):
        half = lucidlm.load("gemma3-270m", dtype="float16")
    with torch.no_grad():
        assert not torch.isfinite(half("The capital of France is")).all()
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        lucidlm.load("gemma3-270m", dtype="bfloat16")
