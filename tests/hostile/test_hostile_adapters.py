"""Hostile and careless adapter files: adapter_config.json (PEFT), lucidlm_adapter.json and the
adapter tensors. Each is refused with one AdapterError line naming the file, the field (or the
tensor) and the value, before the model is changed; `lucidlm merge` never writes a NaN model."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import lucidlm
from lucidlm.config import ModelConfig, preset
from lucidlm.errors import AdapterError
from lucidlm.model.transformer import Transformer
from lucidlm.peft import add_adapters, add_lora, add_prefix, save_adapter
from lucidlm.weights.hf import save_hf

from harness import api_refused, refused

TINY = dict(vocab_size=50, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_mlp=64, max_seq_len=32)
Q0 = "base_model.model.model.layers.0.self_attn.q_proj"


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    """A tiny HF base model and a LoRA, a bottleneck adapter and a prefix trained on it."""
    root = tmp_path_factory.mktemp("adapters")
    torch.manual_seed(0)
    save_hf(Transformer(preset("llama", **TINY)), root / "base")
    out = {"base": root / "base"}
    for method in ("lora", "adapter", "prefix"):
        model = lucidlm.load(root / "base")
        if method == "lora":
            add_lora(model, r=4, alpha=8, targets=("q_proj", "v_proj"))
        elif method == "adapter":
            add_adapters(model, bottleneck=8)
        else:
            add_prefix(model, length=4)
        with torch.no_grad():
            for p in model.parameters():
                if p.requires_grad:
                    p.copy_(torch.randn_like(p) * 0.1)  # non-zero: a wrong load would show
        out[method] = save_adapter(model, root / method)
    return out


def copy(files, method: str, tmp_path: Path) -> Path:
    path = tmp_path / method
    shutil.copytree(files[method], path)
    return path


def edit_json(path: Path, change) -> None:
    data = json.loads(path.read_text())
    path.write_text(json.dumps(change(data)))


def load_with(files, adapter: Path):
    return lambda: lucidlm.load(files["base"], adapter=adapter)


def test_the_templates_load_and_change_the_output(files):
    ids = torch.tensor([[1, 2, 3, 4]])
    base = lucidlm.load(files["base"])(ids)
    for method in ("lora", "adapter", "prefix"):
        assert not torch.allclose(lucidlm.load(files["base"], adapter=files[method])(ids), base)


# ----------------------------------------------------------------------------- adapter_config.json

PEFT_BAD = {
    "r": [0, -4, "4", 2.5, True, 2, 10 ** 9],
    "lora_alpha": ["abc", [8], "NaN-literal", True],
    "lora_dropout": [5, -0.1, 1.0, "0.1"],
    "alpha_pattern": [{"(": 4}, {"q_proj": "x"}, ["q_proj"], "q_proj", {"[a-": 2}],
    "rank_pattern": [{"q_proj(": 2}, {"q_proj": 0}, {"q_proj": "4"}, 7],
    "target_modules": [["qq_proj"], ["q_proj", "nothing"], 5, [5], "(", "nothing\\..*"],
    "use_rslora": ["yes", 1],
    "fan_in_fan_out": ["no"],
    "peft_type": ["LORA ", 5, None],
    "bias": [5, "all"],
}


def _peft_cases():
    return [pytest.param(f, v, id=f"{f}={v!r}"[:50]) for f, values in PEFT_BAD.items() for v in values]


@pytest.mark.parametrize("field, value", _peft_cases())
def test_adapter_config_field(files, tmp_path, field, value):
    path = copy(files, "lora", tmp_path)
    config = path / "adapter_config.json"
    if value == "NaN-literal":  # json.dumps writes NaN, which Python's json (and PEFT) reads back
        value = math.nan
    edit_json(config, lambda c: {**c, field: value})
    names = ["adapter_config\\.json", field]
    if field == "r" and value == 2:  # a valid r that contradicts the tensors (saved with r=4)
        names = ["lora_A", "r=2", "adapter_config\\.json"]
    api_refused(load_with(files, path), AdapterError, names=names, watch=[path, files["base"]])


def test_bad_pattern_regex_is_named(files, tmp_path):
    path = copy(files, "lora", tmp_path)
    edit_json(path / "adapter_config.json", lambda c: {**c, "alpha_pattern": {"q_proj": 8, "(v_proj": 4}})
    api_refused(load_with(files, path), AdapterError,
                names=["alpha_pattern", "\\(v_proj", "not a valid regular expression"])


@pytest.mark.parametrize("content, names", [
    (b"[]", ["adapter_config\\.json", "found a list"]),
    (b'"LORA"', ["adapter_config\\.json", "found a string"]),
    (b"3", ["adapter_config\\.json", "found a number"]),
    (b'{"peft_type": "LORA", "r": 4', ["adapter_config\\.json", "not valid JSON"]),
    (b'{"peft_type": "LORA\xfe"}', ["adapter_config\\.json", "not UTF-8"]),
    (b"", ["adapter_config\\.json", "not valid JSON"]),
])
def test_adapter_config_that_is_not_an_object(files, tmp_path, content, names):
    path = copy(files, "lora", tmp_path)
    (path / "lucidlm_adapter.json").unlink()  # as PEFT writes it: adapter_config.json alone says LoRA
    (path / "adapter_config.json").write_bytes(content)
    api_refused(load_with(files, path), AdapterError, names=names, watch=[path])


# ----------------------------------------------------------------------------- lucidlm_adapter.json

META_BAD = [
    ("lora", "method", "qlora"), ("lora", "method", 5), ("lora", "method", None), ("lora", "base", "x"),
    ("adapter", "bottleneck", None), ("adapter", "bottleneck", "abc"), ("adapter", "bottleneck", 0),
    ("adapter", "bottleneck", 2.5), ("adapter", "bottleneck", 10 ** 9), ("adapter", "bottleneck", 33),
    ("adapter", "nonlinearity", "swish"), ("adapter", "nonlinearity", 3), ("adapter", "train_norms", "yes"),
    ("prefix", "length", 10 ** 9), ("prefix", "length", 0), ("prefix", "length", "4"), ("prefix", "length", None),
    ("prefix", "length", 1e300), ("prefix", "hidden", 0), ("prefix", "hidden", "x"), ("prefix", "hidden", 10 ** 9),
    ("prefix", "frozen", "no"),
]


@pytest.mark.parametrize("method, field, value", [pytest.param(*c, id=f"{c[0]}-{c[1]}={c[2]!r}") for c in META_BAD])
def test_lucidlm_adapter_field(files, tmp_path, method, field, value):
    path = copy(files, method, tmp_path)
    if value is None:
        edit_json(path / "lucidlm_adapter.json", lambda m: {k: v for k, v in m.items() if k != field})
        names = [f"'{field}' is missing"]
    else:
        edit_json(path / "lucidlm_adapter.json", lambda m: {**m, field: value})
        shown = "1e\\+300" if value == 1e300 else repr(value) if isinstance(value, str) else str(value)
        names = [field, shown]
    api_refused(load_with(files, path), AdapterError, names=names + ["lucidlm_adapter\\.json"],
                watch=[path, files["base"]])


@pytest.mark.parametrize("content, names", [
    (b"[1]", ["found a list"]), (b'"lora"', ["found a string"]), (b'{"method": "lo', ["not valid JSON"]),
    (b"\xff\xfe{}", ["not UTF-8"]),
])
def test_lucidlm_adapter_file_that_is_not_an_object(files, tmp_path, content, names):
    path = copy(files, "adapter", tmp_path)
    (path / "lucidlm_adapter.json").write_bytes(content)
    api_refused(load_with(files, path), AdapterError, names=names + ["lucidlm_adapter\\.json"], watch=[path])


def test_a_prefix_too_big_for_memory_is_refused_before_allocating():
    with torch.device("meta"):  # a big base model costs nothing on the meta device
        model = Transformer(ModelConfig(vocab_size=50, d_model=8192, n_layers=64, n_heads=64, d_mlp=64))
    api_refused(lambda: add_prefix(model, length=10 ** 6), AdapterError,
                names=["length=1000000", "would need .* (GB|TB)", "shorter prefix"])
    api_refused(lambda: add_prefix(model, length=10 ** 9), AdapterError, names=["'length' is 1000000000"])


# ----------------------------------------------------------------------------- the tensors

def edit_tensors(path: Path, change) -> None:
    file = path / "adapter_model.safetensors"
    tensors = load_file(file)
    change(tensors)
    save_file(tensors, file)


def _poison(key: str, value: float):
    def change(tensors):
        t = tensors[key].clone()
        t.view(-1)[1] = value
        tensors[key] = t
    return change


@pytest.mark.parametrize("method, key, value, kind", [
    ("lora", f"{Q0}.lora_B.weight", math.nan, "NaN"),
    ("lora", f"{Q0}.lora_A.weight", math.inf, "infinite"),
    ("lora", "base_model.model.model.layers.1.self_attn.v_proj.lora_A.weight", -math.inf, "infinite"),
    ("adapter", "blocks.1.mlp.down_proj.adapter.up.weight", math.nan, "NaN"),
    ("adapter", "blocks.0.attn.o_proj.adapter.down.bias", math.inf, "infinite"),
    ("prefix", "tokens", math.nan, "NaN"),
    ("prefix", "to_kv.weight", math.inf, "infinite"),
])
def test_non_finite_adapter_tensor_is_refused_at_load(files, tmp_path, method, key, value, kind):
    path = copy(files, method, tmp_path)
    edit_tensors(path, _poison(key, value))
    api_refused(load_with(files, path), AdapterError,
                names=["adapter_model\\.safetensors", key.replace(".", "\\."), f"1 {kind} value"], watch=[path])


@pytest.mark.parametrize("method, change, names", [
    ("lora", lambda t: t.update({f"{Q0}.lora_A.weight": torch.zeros(4, 48)}), ["lora_A", "\\(4, 48\\)", "\\(4, 32\\)"]),
    ("lora", lambda t: t.update({f"{Q0}.lora_B.weight": torch.zeros(32, 4, 1)}), ["lora_B", "\\(32, 4, 1\\)"]),
    ("lora", lambda t: t.update({f"{Q0}.lora_A.weight": torch.tensor(1.0)}), ["lora_A", "shape \\(\\)"]),
    ("lora", lambda t: t.update({f"{Q0}.lora_A.weight": torch.zeros(0, 32), f"{Q0}.lora_B.weight": torch.zeros(32, 0)}),
     ["lora_A", "\\(0, 32\\)", "r=4"]),
    ("lora", lambda t: t.update({f"{Q0}.lora_A.weight": torch.zeros(6, 32), f"{Q0}.lora_B.weight": torch.zeros(32, 6)}),
     ["lora_A", "\\(6, 32\\)", "r=4"]),
    ("lora", lambda t: t.update({"base_model.model.model.layers.7.self_attn.q_proj.lora_A.weight": torch.zeros(4, 32),
                                 "base_model.model.model.layers.7.self_attn.q_proj.lora_B.weight": torch.zeros(32, 4)}),
     ["layers\\.7", "does not\\s+have|different base model"]),
    ("lora", lambda t: t.pop(f"{Q0}.lora_B.weight"), ["lora_B"]),
    ("adapter", lambda t: t.update({"blocks.0.attn.o_proj.adapter.down.weight": torch.zeros(8, 48)}),
     ["blocks\\.0\\.attn\\.o_proj\\.adapter\\.down\\.weight", "\\(8, 48\\)"]),
    ("adapter", lambda t: t.pop("blocks.1.mlp.down_proj.adapter.up.bias"), ["up\\.bias", "missing"]),
    ("prefix", lambda t: t.update({"tokens": torch.zeros(4, 48)}), ["tokens", "\\(4, 48\\)"]),
])
def test_adapter_tensor_that_does_not_fit_the_base_is_named(files, tmp_path, method, change, names):
    path = copy(files, method, tmp_path)
    edit_tensors(path, change)
    api_refused(load_with(files, path), AdapterError, names=names, watch=[path])


def test_a_refused_adapter_leaves_the_model_unchanged(files, tmp_path):
    from lucidlm.peft import load_adapter, method_of

    model = lucidlm.load(files["base"])
    ids = torch.tensor([[3, 1, 4]])
    before = model(ids)
    for method, key in (("adapter", "blocks.1.mlp.down_proj.adapter.up.weight"), ("prefix", "tokens")):
        path = copy(files, method, tmp_path / method)
        edit_tensors(path, lambda t: t.update({key: torch.zeros(1, 1)}))
        api_refused(lambda: load_adapter(model, path), AdapterError, names=[key])
    assert method_of(model) is None and torch.equal(model(ids), before)


# ----------------------------------------------------------------------------- the CLI: merge

def test_cli_merge_refuses_a_nan_adapter_and_writes_nothing(files, tmp_path):
    path = copy(files, "lora", tmp_path)
    edit_tensors(path, _poison(f"{Q0}.lora_B.weight", math.nan))
    out = tmp_path / "merged"
    refused("merge", "--model", str(files["base"]), "--adapter", str(path), "--out", str(out),
            names=["lora_B", "NaN"], watch=[path, out])
    assert not out.exists()


def test_cli_merge_refuses_an_update_that_overflows(files, tmp_path):
    """Finite adapter values whose merged weight W + alpha/r * B @ A overflows the written dtype
    (float16, max 65504: 300 * 300 * r * alpha/r). float32's 1e20 * 1e20 takes the same check."""
    scale, dtype = 300.0, "float16"
    path = copy(files, "lora", tmp_path)
    edit_tensors(path, lambda t: t.update({k: torch.full_like(v, scale) for k, v in t.items() if "q_proj" in k}))
    update = 4 * scale * scale * 8 / 4  # r entries of scale * scale, times alpha / r
    assert update > torch.finfo(getattr(torch, dtype)).max  # the premise of each case
    out = tmp_path / "merged"
    refused("merge", "--model", str(files["base"]), "--adapter", str(path), "--out", str(out), "--dtype", dtype,
            names=["q_proj", "infinite", "nothing was written"], watch=[path, out])
    assert not out.exists()
