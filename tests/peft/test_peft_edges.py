"""PEFT edge cases, with transformers + peft as the oracle where values are involved: inits that
rewrite the base weights (PiSSA, OLoRA, ...) are refused and PEFT's plain-LoRA conversion of them
reads right; one fine-tuning method at a time; norms trained with bottleneck adapters survive a
load -> save round trip; new LoRA layers follow the model's eval mode; clear messages for a
quantized model and for LoRA on the output head or embeddings."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from lucidlm import load  # noqa: E402
from lucidlm.config import preset  # noqa: E402
from lucidlm.errors import AdapterError, QuantizationError  # noqa: E402
from lucidlm.model.transformer import Transformer  # noqa: E402
from lucidlm.peft import (add_adapters, add_lora, add_prefix, load_adapter, lora_layers, merge_and_unload,  # noqa: E402
                          method_of, save_adapter)
from lucidlm.peft.adapters import NORMS  # noqa: E402
from lucidlm.weights.hf import save_hf  # noqa: E402

CONFIG = dict(vocab_size=101, d_model=48, n_layers=2, n_heads=6, n_kv_heads=2, d_mlp=96, max_seq_len=64,
              rope_theta=10000.0)


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    """Our tiny model exported as an HF dir: the one base both libraries load."""
    torch.manual_seed(0)
    return save_hf(Transformer(preset("llama", **CONFIG)), tmp_path_factory.mktemp("base"))


def hf_model(base_dir):
    return transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()


def tiny(seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(preset("llama", **CONFIG)).eval()


def ids() -> torch.Tensor:
    return torch.randint(0, CONFIG["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(3))


def perturb(model: torch.nn.Module, names: tuple[str, ...], std: float = 0.3, seed: int = 5) -> None:
    """Give the parameters whose name contains one of ``names`` random values, as training would."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if any(part in name for part in names):
                param.copy_(torch.randn(param.shape, generator=generator) * std)


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


# -- 1. init_lora_weights that rewrite the base weights ----------------------------------------

@pytest.mark.parametrize("init,named", [("pissa", "PiSSA"), ("pissa_niter_4", "PiSSA"), ("olora", "OLoRA")])
def test_base_rewriting_init_is_refused_by_name(base_dir, tmp_path, init, named):
    """PEFT subtracts B0 @ A0 from the base when it creates (and reloads) such an adapter: read as
    plain LoRA on the unchanged base, even an untrained one gives other logits than PEFT's."""
    tuned = peft.get_peft_model(hf_model(base_dir), peft.LoraConfig(
        r=4, lora_alpha=4, target_modules=["q_proj", "v_proj"], init_lora_weights=init, task_type="CAUSAL_LM"))
    tuned.save_pretrained(tmp_path)
    with pytest.raises(AdapterError, match=rf"init_lora_weights='{init}' \({named}\)") as caught:
        load(base_dir, adapter=tmp_path)
    assert "path_initial_model_for_weight_conversion" in str(caught.value)  # the fix PEFT offers


@pytest.mark.parametrize("init", ["loftq", "lora_ga", "corda"])
def test_other_base_rewriting_inits_are_refused(base_dir, tmp_path, init):
    """Configs only (PEFT needs quantization / gradients / data to create these)."""
    shutil.copytree(_plain_lora(base_dir, tmp_path / "plain"), tmp_path / init)
    config = tmp_path / init / "adapter_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "init_lora_weights": init}))
    with pytest.raises(AdapterError, match=rf"init_lora_weights='{init}'.*merge_and_unload"):
        load_adapter(tiny(), tmp_path / init)


def _plain_lora(base_dir, path):
    model = load(base_dir)
    add_lora(model, r=4, alpha=8, targets=("q", "v"))
    perturb(model, ("lora_B",))
    return save_adapter(model, path)


def test_pissa_converted_by_peft_reads_like_peft(base_dir, tmp_path):
    """PEFT's conversion (save_pretrained(path_initial_model_for_weight_conversion=...)) writes a
    plain LoRA for the original base: lucidlm's logits equal the trained PiSSA model's in PEFT."""
    tuned = peft.get_peft_model(hf_model(base_dir), peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights="pissa", task_type="CAUSAL_LM"))
    tuned.peft_config["default"].init_lora_weights = True  # as PEFT's PiSSA example saves the initial adapter
    tuned.save_pretrained(tmp_path / "initial")
    tuned.peft_config["default"].init_lora_weights = "pissa"
    with torch.no_grad():
        for name, param in tuned.named_parameters():
            if "lora_" in name:
                param.add_(torch.randn(param.shape, generator=torch.Generator().manual_seed(7)) * 0.2)
    tuned.save_pretrained(tmp_path / "converted", path_initial_model_for_weight_conversion=str(tmp_path / "initial"))
    with torch.no_grad():
        expected = tuned.eval()(ids()).logits
        assert max_diff(expected, hf_model(base_dir)(ids()).logits) > 1e-2  # the adapter does something
        ours = load(base_dir, adapter=tmp_path / "converted")(ids())
    assert max_diff(ours, expected) <= 1e-4


@pytest.mark.parametrize("init", ["gaussian", "orthogonal", "eva", "mica"])
def test_inits_that_leave_the_base_alone_read_as_plain_lora(base_dir, tmp_path, init):
    torch.manual_seed(2)
    tuned = peft.get_peft_model(hf_model(base_dir), peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=init, task_type="CAUSAL_LM"))
    perturb(tuned, ("lora_A",), std=0.2)  # MiCA and EVA start with a zero A or B
    tuned.save_pretrained(tmp_path)
    reloaded = peft.PeftModel.from_pretrained(hf_model(base_dir), tmp_path).eval()
    with torch.no_grad():
        assert max_diff(load(base_dir, adapter=tmp_path)(ids()), reloaded(ids()).logits) <= 1e-4


# -- 2. one fine-tuning method at a time --------------------------------------------------------

ADD = {"lora": lambda m: add_lora(m, r=2, targets="o_proj"), "adapter": lambda m: add_adapters(m, bottleneck=8),
       "prefix": lambda m: add_prefix(m, length=3)}
NAMED = {"lora": "a LoRA adapter", "adapter": "bottleneck adapters", "prefix": "a prefix"}


@pytest.mark.parametrize("first,second", [(a, b) for a in ADD for b in ADD if a != b])
def test_a_second_method_is_refused_and_changes_nothing(first, second):
    model = tiny()
    ADD[first](model)
    perturb(model, ("lora_B", "adapter.up", "to_kv"), std=0.3)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    modules = [type(m) for m in model.modules()]
    with torch.no_grad():
        before = model(ids())
    with pytest.raises(AdapterError, match=f"already has {NAMED[first]}, so {NAMED[second]} cannot be added"):
        ADD[second](model)
    with torch.no_grad():
        assert torch.equal(model(ids()), before)
    assert [type(m) for m in model.modules()] == modules
    assert {n for n, p in model.named_parameters() if p.requires_grad} == trainable  # the first still trains
    assert method_of(model) == first


def test_all_linear_after_adapters_is_refused_not_a_crash():
    model = tiny()
    add_adapters(model, bottleneck=8)
    with pytest.raises(AdapterError, match="merged into the weights: save them"):
        add_lora(model, r=2, targets="all-linear")


def test_loading_a_second_method_is_refused(base_dir, tmp_path):
    lora_dir = _plain_lora(base_dir, tmp_path / "lora")
    model = tiny()
    add_prefix(model, length=3)
    with pytest.raises(AdapterError, match="already has a prefix, so a LoRA adapter cannot be added"):
        load_adapter(model, lora_dir)
    assert method_of(model) == "prefix"


def test_after_merge_and_unload_adapters_go_on_the_merged_model(base_dir, tmp_path):
    """The way the message points: merge the LoRA (as PEFT's merge_and_unload), then add adapters;
    a fresh adapter is the identity, so the output is PEFT's merged model's."""
    model = load(base_dir)
    add_lora(model, r=4, alpha=8, targets=("o", "down"))
    perturb(model, ("lora_B",))
    save_adapter(model, tmp_path)
    merge_and_unload(model)
    add_adapters(model, bottleneck=8)
    expected = peft.PeftModel.from_pretrained(hf_model(base_dir), tmp_path).merge_and_unload().eval()
    with torch.no_grad():
        assert max_diff(model(ids()), expected(ids()).logits) <= 1e-4
    assert method_of(model) == "adapter" and not list(lora_layers(model))


# -- 3. bottleneck adapters with train_norms: load -> save keeps the norms ----------------------

def test_trained_norms_survive_load_and_save(tmp_path):
    model = tiny()
    add_adapters(model, bottleneck=6, train_norms=True)
    with torch.no_grad():
        for param in model.parameters():
            if param.requires_grad:
                param.add_(torch.randn_like(param) * 0.2)  # "trained": adapters and norms
    save_adapter(model, tmp_path / "first")
    loaded = load_adapter(tiny(), tmp_path / "first")  # frozen: an inference load
    save_adapter(loaded, tmp_path / "second")
    first = load_file(tmp_path / "first" / "adapter_model.safetensors")
    second = load_file(tmp_path / "second" / "adapter_model.safetensors")
    assert any(key.startswith("norms.") for key in first)
    assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)
    assert json.loads((tmp_path / "second" / "lucidlm_adapter.json").read_text())["train_norms"] is True

    resumed = load_adapter(tiny(), tmp_path / "first", trainable=True)
    norms = {n for n, p in resumed.named_parameters() if p.requires_grad and n.rsplit(".", 2)[-2] in NORMS}
    assert norms == {k[len("norms."):] for k in first if k.startswith("norms.")}


def test_adapters_without_train_norms_save_no_norms(tmp_path):
    model = tiny()
    add_adapters(model, bottleneck=6)
    for param in model.parameters():
        param.requires_grad_(True)  # a user unfreezing everything does not make the norms the adapter's
    save_adapter(model, tmp_path)
    assert not any(k.startswith("norms.") for k in load_file(tmp_path / "adapter_model.safetensors"))


# -- 4. new LoRA layers follow the model's train/eval mode --------------------------------------

def test_lora_dropout_is_off_in_an_eval_model_as_in_peft(base_dir, tmp_path):
    model = load(base_dir)
    assert not model.training
    add_lora(model, r=2, alpha=4, dropout=0.3, targets=("q", "v"))
    perturb(model, ("lora_B",), std=0.2)
    assert all(not layer.training for _, layer in lora_layers(model))
    save_adapter(model, tmp_path)
    theirs = peft.PeftModel.from_pretrained(hf_model(base_dir), tmp_path).eval()
    with torch.no_grad():
        assert max_diff(model(ids()), theirs(ids()).logits) <= 1e-4
    model.train()
    assert all(layer.training for _, layer in lora_layers(model))


def test_adapters_and_prefix_follow_the_model_mode():
    for add in (ADD["adapter"], ADD["prefix"]):
        model = tiny()
        add(model)
        assert not any(module.training for module in model.modules())


# -- 5. load_adapter on a quantized model -------------------------------------------------------

def test_load_adapter_on_a_quantized_model_names_quantization(base_dir, tmp_path):
    from lucidlm.quantization import quantize

    lora_dir = _plain_lora(base_dir, tmp_path / "lora")
    model = tiny()
    quantize(model, "int8")
    with pytest.raises(QuantizationError, match="needs a float model.*dtype='float32'"):
        load_adapter(model, lora_dir)
    assert method_of(model) is None


def test_a_model_saved_quantized_takes_an_adapter_once_dequantized(base_dir, tmp_path):
    """A directory saved with quantize= has no float weights to load as float: the error names
    dequantize(), and the dequantized model with the adapter computes what PEFT computes with it
    on a Hugging Face export of that dequantized model."""
    from lucidlm.quantization import dequantize, quantize
    from lucidlm.weights.checkpoint import save_model

    lora_dir = _plain_lora(base_dir, tmp_path / "lora")
    saved = save_model(quantize(tiny(), "int8"), tmp_path / "int8")
    model = load(saved)
    with pytest.raises(QuantizationError, match=r"saved quantized.*dequantize\(model\)"):
        load_adapter(model, lora_dir)
    dequantize(model)
    load_adapter(model, lora_dir)
    reference = peft.PeftModel.from_pretrained(hf_model(save_hf(dequantize(load(saved)), tmp_path / "hf")), lora_dir)
    with torch.no_grad():
        torch.testing.assert_close(model(ids()), reference(ids()).logits, rtol=1e-4, atol=1e-4)


# -- 6. PEFT LoRA on the output head or the embeddings ------------------------------------------

@pytest.mark.parametrize("target,named", [("lm_head", "output head"), ("embed_tokens", "token embedding")])
@pytest.mark.parametrize("save_embedding_layers", [False, "auto"])
def test_lora_outside_the_blocks_is_refused_by_name(base_dir, tmp_path, target, named, save_embedding_layers):
    tuned = peft.get_peft_model(hf_model(base_dir), peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", target], task_type="CAUSAL_LM"))
    tuned.save_pretrained(tmp_path, save_embedding_layers=save_embedding_layers)
    with pytest.raises(AdapterError, match=rf"LoRA on the {named} \({target}\).*inside the blocks") as caught:
        load(base_dir, adapter=tmp_path)
    assert "different base model" not in str(caught.value)


def test_head_in_target_modules_without_its_tensors_is_named(base_dir, tmp_path):
    lora_dir = _plain_lora(base_dir, tmp_path / "lora")
    config = lora_dir / "adapter_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "target_modules": ["q_proj", "v_proj", "lm_head"]}))
    with pytest.raises(AdapterError, match=r"'lm_head' is the output head \(lm_head\)"):
        load_adapter(tiny(), lora_dir)
