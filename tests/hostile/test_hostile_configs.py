"""Hostile and careless model configs: HF config.json, Meta params.json, shard indexes and
ModelConfig itself. Each bad value is refused with lucidlm's one-line ConfigError naming the
file, the field (as the file spells it) and the value, before anything is built or allocated:
no hang on num_hidden_layers 1e6, no TB allocation on max_position_embeddings 4e9."""

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
from lucidlm.errors import ConfigError, MissingTensorError, ShapeMismatchError, WeightsError
from lucidlm.model.transformer import Transformer
from lucidlm.validation import MAX_CONTEXT, MAX_LAYERS, MAX_VOCAB
from lucidlm.weights.hf import save_hf
from lucidlm.weights.meta import GLOBAL_NAMES, LAYER_NAMES

from harness import api_refused, refused

TINY = dict(vocab_size=50, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_mlp=64, max_seq_len=32)


@pytest.fixture(scope="module")
def llama_template(tmp_path_factory) -> Path:
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("llama")
    save_hf(Transformer(preset("llama", **TINY)), path)
    return path


@pytest.fixture(scope="module")
def gpt2_template(tmp_path_factory) -> Path:
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("gpt2")
    save_hf(Transformer(preset("gpt2", vocab_size=50, d_model=32, n_layers=2, n_heads=4, max_seq_len=32)), path)
    return path


def copy_with(template: Path, tmp_path: Path, drop=(), **changes) -> Path:
    """A copy of the tiny model directory whose config.json has ``changes`` (and lacks ``drop``)."""
    path = tmp_path / "model"
    shutil.copytree(template, path)
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    for key in drop:
        config.pop(key, None)
    (path / "config.json").write_text(json.dumps(config))
    return path


def test_the_templates_load(llama_template, gpt2_template):
    """Every refusal below differs from these valid directories by the one field it names."""
    assert lucidlm.load(llama_template).config.n_kv_heads == 2
    assert lucidlm.load(gpt2_template).config.positions == "learned"


# config.json field -> bad values; the error must name the field and the value.
LLAMA_BAD = {
    "rope_theta": ["abc", 0, -10000.0, [1e4], True],
    "num_hidden_layers": [1000000, 0, -1, "2", 2.5, True, MAX_LAYERS + 1],
    "max_position_embeddings": [4e9, 0, -5, "2048", 1e300, MAX_CONTEXT + 1],
    "hidden_size": [0, -32, "32", 32.5, 1 << 30],
    "num_attention_heads": [0, -4, "four", 1e9],
    "num_key_value_heads": [0, 3, 5, "2"],
    "vocab_size": [-50, 0, "50", MAX_VOCAB + 1, 3.5],
    "rms_norm_eps": ["x", -1e-6, [1e-6], 1e10],
    "intermediate_size": [0, "64", -64, 1e12],
    "head_dim": [0, 7, "8", -8],
    "attention_bias": ["yes", 1, [True]],
    "mlp_bias": ["no", 0],
    "tie_word_embeddings": ["false", 0],
    "hidden_act": [5, ["silu"]],
    "architectures": ["LlamaForCausalLM", [5], {"a": 1}],
    "model_type": [5, ["llama"]],
    "rope_scaling": ["linear", [1, 2], 7, {"factor": 2.0}, {"rope_type": 4}],
    "rope_parameters": ["default", [10000.0], {"rope_type": "default", "rope_theta": "abc"},
                        {"rope_type": "default", "rope_theta": -1}],
}


def _cases(table):
    return [pytest.param(field, value, id=f"{field}={value!r}"[:60]) for field, values in table.items()
            for value in values]


def _names(field, value):
    """Regexes the error must match: the field, and the value as it is printed."""
    shown = value if not isinstance(value, float) or not value.is_integer() or abs(value) > 1e17 else int(value)
    text = repr(shown) if isinstance(shown, str) else str(shown)
    return [field.split(".")[-1], _escape(text.split(",")[0].strip("[{"))]


def _escape(text):
    import re
    return re.escape(text)


@pytest.mark.parametrize("field, value", _cases(LLAMA_BAD))
def test_llama_config_json_field(llama_template, tmp_path, field, value):
    path = copy_with(llama_template, tmp_path, **{field: value})
    if field in ("hidden_act", "architectures", "model_type", "rope_scaling", "rope_parameters"):
        names = [field]
    else:
        names = _names(field, value)
    error = api_refused(lambda: lucidlm.load(path), ConfigError, names=names + ["config\\.json"],
                        watch=[path])
    assert "Traceback" not in str(error)


def test_head_count_that_does_not_divide_the_width(llama_template, tmp_path):
    path = copy_with(llama_template, tmp_path, drop=("head_dim",), num_attention_heads=3, num_key_value_heads=3)
    api_refused(lambda: lucidlm.load(path), ConfigError,
                names=["hidden_size=32", "num_attention_heads=3", "not divisible", "config\\.json"])
    path = copy_with(llama_template, tmp_path / "b", num_key_value_heads=3)
    api_refused(lambda: lucidlm.load(path), ConfigError, names=["num_attention_heads=4", "num_key_value_heads=3"])
    path = copy_with(llama_template, tmp_path / "c", num_key_value_heads=8)
    api_refused(lambda: lucidlm.load(path), ConfigError, names=["num_key_value_heads=8", "num_attention_heads=4"])
    # as transformers writes it, with head_dim: 3 heads of 8 cannot make a width of 32
    for heads, kv in ((3, 1), (3, 3), (7, 7)):
        path = copy_with(llama_template, tmp_path / f"d{heads}{kv}", num_attention_heads=heads, num_key_value_heads=kv)
        api_refused(lambda: lucidlm.load(path), ConfigError,
                    names=["hidden_size=32", f"num_attention_heads={heads}", "head_dim=8"])


@pytest.mark.parametrize("changes, error, names", [
    (dict(num_hidden_layers=3), MissingTensorError, ["layers\.2", "num_hidden_layers=3"]),
    (dict(num_attention_heads=8), ShapeMismatchError, ["q_proj", "num_attention_heads=8", "head_dim=8"]),
    (dict(vocab_size=51), ShapeMismatchError, ["embed_tokens", "vocab_size=51"]),
    (dict(intermediate_size=96), ShapeMismatchError, ["mlp", "intermediate_size=96"]),
])
def test_a_valid_config_that_contradicts_the_weights_names_its_sizes(llama_template, tmp_path, changes, error, names):
    path = copy_with(llama_template, tmp_path, **changes)
    api_refused(lambda: lucidlm.load(path), error, names=names + ["config\\.json"], watch=[path])


def test_a_config_too_big_for_memory_is_refused_before_allocating(llama_template, tmp_path):
    # Every field in range, but 4096 layers of width 65536 is ~1e14 parameters.
    path = copy_with(llama_template, tmp_path, num_hidden_layers=4096, hidden_size=65536, intermediate_size=65536,
                     num_attention_heads=512, num_key_value_heads=512, head_dim=128)
    api_refused(lambda: lucidlm.load(path), ConfigError,
                names=["config\\.json", "num_hidden_layers=4096", "hidden_size=65536", "would need .* (TB|PB)"])


@pytest.mark.parametrize("content, names", [
    (b"[1, 2, 3]", ["config\\.json", "found a list"]),
    (b'"LlamaForCausalLM"', ["config\\.json", "found a string"]),
    (b"42", ["config\\.json", "found a number"]),
    (b"null", ["config\\.json", "found null"]),
    (b'{"architectures": ["LlamaForCausalLM"], "hidden_size": 3', ["config\\.json", "not valid JSON", "truncated"]),
    (b"", ["config\\.json", "not valid JSON"]),
    (b'{"model_type": "llama\xff"}', ["config\\.json", "not UTF-8"]),
    (b"[" * 50000 + b"]" * 50000, ["config\\.json", "nests too deeply|found a list"]),
])
def test_config_json_that_is_not_an_object(llama_template, tmp_path, content, names):
    path = copy_with(llama_template, tmp_path)
    (path / "config.json").write_bytes(content)
    api_refused(lambda: lucidlm.load(path), ConfigError, names=names, watch=[path])


def test_missing_required_field_is_named(llama_template, tmp_path):
    for i, field in enumerate(("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size",
                               "intermediate_size")):
        path = copy_with(llama_template, tmp_path / str(i), drop=(field,))
        api_refused(lambda: lucidlm.load(path), ConfigError, names=[f"'{field}' is missing"])


GPT2_BAD = {
    "n_layer": [1000000, 0, "12"],
    "n_embd": ["x", 0, -768],
    "n_head": [0, 5, "4"],
    "n_positions": [4e9, 0, "1024"],
    "n_inner": [-1, "x", 1e12],
    "layer_norm_epsilon": ["x", -1.0],
    "vocab_size": [-1, "50257"],
    "activation_function": [3],
    "scale_attn_weights": ["no"],
    "scale_attn_by_inverse_layer_idx": ["yes"],
    "tie_word_embeddings": ["true"],
}


@pytest.mark.parametrize("field, value", _cases(GPT2_BAD))
def test_gpt2_config_json_field(gpt2_template, tmp_path, field, value):
    path = copy_with(gpt2_template, tmp_path, **{field: value})
    names = [field] if field == "activation_function" else _names(field, value)
    api_refused(lambda: lucidlm.load(path), ConfigError, names=names + ["config\\.json"], watch=[path])


# ----------------------------------------------------------------------------- shard indexes

def sharded(template: Path, tmp_path: Path) -> Path:
    """The tiny model as two shards listed by model.safetensors.index.json (as save_pretrained writes)."""
    path = tmp_path / "sharded"
    shutil.copytree(template, path)
    tensors = load_file(path / "model.safetensors")
    (path / "model.safetensors").unlink()
    names = sorted(tensors)
    half = len(names) // 2
    weight_map = {}
    for i, part in enumerate((names[:half], names[half:])):
        file = f"model-0000{i + 1}-of-00002.safetensors"
        save_file({n: tensors[n] for n in part}, path / file, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, file))
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return path


def edit_index(path: Path, change) -> None:
    index_path = path / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index_path.write_text(json.dumps(change(index)))


def test_sharded_template_loads(llama_template, tmp_path):
    sharded_model = lucidlm.load(sharded(llama_template, tmp_path))
    plain = lucidlm.load(llama_template)
    ids = torch.tensor([[1, 2, 3]])
    assert torch.equal(sharded_model(ids), plain(ids))


def _first(index):
    return next(iter(index["weight_map"]))


@pytest.mark.parametrize("change, names", [
    (lambda i: [i], ["index\\.json", "found a list"]),
    (lambda i: "weights", ["index\\.json", "found a string"]),
    (lambda i: {"metadata": {}}, ["index\\.json", "'weight_map' is missing"]),
    (lambda i: {"weight_map": list(i["weight_map"].values())}, ["index\\.json", "weight_map", "expected an object"]),
    (lambda i: {"weight_map": {**i["weight_map"], _first(i): ["model-00001-of-00002.safetensors"]}},
     ["index\\.json", "weight_map", "\\['model-00001", "expected a string"]),
    (lambda i: {"weight_map": {**i["weight_map"], _first(i): 7}}, ["index\\.json", "weight_map", "is 7"]),
    (lambda i: {"weight_map": {**i["weight_map"], _first(i): None}}, ["index\\.json", "weight_map", "missing"]),
    (lambda i: {"weight_map": {}}, ["index\\.json", "lists no tensors"]),
    (lambda i: {"weight_map": {**i["weight_map"], _first(i): "../outside.safetensors"}},
     ["index\\.json", "\\.\\./outside\\.safetensors", "not a file inside the model directory"]),
    (lambda i: {"weight_map": {**i["weight_map"], _first(i): ""}}, ["index\\.json", "not a file inside"]),
    (lambda i: {"weight_map": {**i["weight_map"], _first(i): "model-00009-of-00009.safetensors"}},
     ["model-00009-of-00009\\.safetensors is missing"]),
])
def test_bad_shard_index(llama_template, tmp_path, change, names):
    path = sharded(llama_template, tmp_path)
    edit_index(path, change)
    api_refused(lambda: lucidlm.load(path), WeightsError, names=names, watch=[path])


def test_shard_index_may_not_point_outside_by_an_absolute_path(llama_template, tmp_path):
    """The outside file is a complete, valid copy of the weights: following it would load."""
    path = sharded(llama_template, tmp_path)
    outside = tmp_path / "elsewhere" / "stolen.safetensors"
    outside.parent.mkdir()
    shutil.copy(llama_template / "model.safetensors", outside)
    edit_index(path, lambda i: {"weight_map": dict.fromkeys(i["weight_map"], str(outside))})
    api_refused(lambda: lucidlm.load(path), WeightsError,
                names=[_escape(str(outside)), "not a file inside the model directory"], watch=[path, outside])
    # a symlink inside the directory that leads outside is the same escape
    (path / "link.safetensors").symlink_to(outside)
    edit_index(path, lambda i: {"weight_map": dict.fromkeys(i["weight_map"], "link.safetensors")})
    api_refused(lambda: lucidlm.load(path), WeightsError, names=["link\\.safetensors", "not a file inside"])


def test_truncated_shard_index(llama_template, tmp_path):
    path = sharded(llama_template, tmp_path)
    index = path / "model.safetensors.index.json"
    index.write_bytes(index.read_bytes()[:40])
    api_refused(lambda: lucidlm.load(path), WeightsError, names=["index\\.json", "not valid JSON"])


# ----------------------------------------------------------------------------- Meta params.json

META_PARAMS = {"dim": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "vocab_size": 50, "multiple_of": 32,
               "ffn_dim_multiplier": 1.0, "norm_eps": 1e-5, "rope_theta": 500000.0}


@pytest.fixture(scope="module")
def meta_template(tmp_path_factory) -> Path:
    """A Meta-format directory (params.json + consolidated.00.pth) of a tiny random Llama."""
    path = tmp_path_factory.mktemp("meta")
    (path / "params.json").write_text(json.dumps(META_PARAMS))
    ours = {v: k for k, v in GLOBAL_NAMES.items()}
    for meta_name, our_name in LAYER_NAMES.items():
        for i in range(META_PARAMS["n_layers"]):
            ours[f"blocks.{i}.{our_name}"] = f"layers.{i}.{meta_name}"
    torch.manual_seed(0)
    config = ModelConfig(name="llama", vocab_size=50, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                         multiple_of=32, ffn_dim_multiplier=1.0)
    state = Transformer(config).state_dict()
    torch.save({meta: state[our].to(torch.bfloat16) for our, meta in ours.items()}, path / "consolidated.00.pth")
    return path


def meta_with(template: Path, tmp_path: Path, params) -> Path:
    path = tmp_path / "meta"
    shutil.copytree(template, path)
    (path / "params.json").write_text(json.dumps(params))
    return path


def test_meta_template_loads(meta_template):
    assert lucidlm.load(meta_template).config.n_kv_heads == 2


META_BAD = {
    "dim": ["x", 0, -32, 1 << 40],
    "n_layers": [1000000, "two", 0],
    "n_heads": [0, "4", 1e9],
    "n_kv_heads": [3, 0, 8],
    "vocab_size": [-1, "50"],
    "norm_eps": ["x", -1],
    "rope_theta": ["abc", 0],
    "max_seq_len": [4e9, 0],
    "multiple_of": [0, "32"],
    "ffn_dim_multiplier": ["x", -1.0, 1e300],
    "use_scaled_rope": ["yes"],
}


@pytest.mark.parametrize("field, value", _cases(META_BAD))
def test_meta_params_field(meta_template, tmp_path, field, value):
    path = meta_with(meta_template, tmp_path, {**META_PARAMS, field: value})
    names = _names(field, value) if not (field == "n_kv_heads" and value == 3) else ["n_kv_heads=3"]
    api_refused(lambda: lucidlm.load(path), ConfigError, names=names + ["params\\.json"], watch=[path])


@pytest.mark.parametrize("params, names", [
    ([1, 2], ["params\\.json", "found a list"]),
    ("dim", ["params\\.json", "found a string"]),
    ({"model": 5}, ["params\\.json", "'model' is 5"]),
    ({"model": {**META_PARAMS, "n_layers": 10 ** 7}}, ["params\\.json", "model\\.n_layers", "10000000"]),
])
def test_meta_params_shape(meta_template, tmp_path, params, names):
    api_refused(lambda: lucidlm.load(meta_with(meta_template, tmp_path, params)), ConfigError, names=names)


# ----------------------------------------------------------------------------- ModelConfig from Python

INT_FIELDS = ("vocab_size", "d_model", "n_layers", "n_heads", "max_seq_len", "multiple_of")
OPTIONAL_INT_FIELDS = ("n_kv_heads", "head_dim", "d_mlp", "sliding_window", "global_layer_every")
FLOAT_FIELDS = ("rope_theta", "norm_eps", "dropout")
OPTIONAL_FLOAT_FIELDS = ("rope_local_theta", "query_pre_attn_scalar", "final_logit_softcap", "ffn_dim_multiplier")
BOOL_FIELDS = ("qk_norm", "post_sublayer_norm", "final_norm", "attn_bias", "attn_out_bias", "mlp_bias", "norm_bias",
               "tie_embeddings", "unembed_bias", "scale_embeddings")
CHOICE_FIELDS = ("positions", "rope_variant", "norm", "norm_position", "mlp", "init")


def _api_cases():
    cases = []
    for field in INT_FIELDS + OPTIONAL_INT_FIELDS:
        cases += [(field, v) for v in ("abc", -1, 0, 2.5, True, 10 ** 12, [4])]
    for field in FLOAT_FIELDS + OPTIONAL_FLOAT_FIELDS:
        cases += [(field, v) for v in ("abc", math.nan, math.inf, -1.0, [1.0])]
    cases += [(field, v) for field in BOOL_FIELDS for v in ("yes", 1, None if field != "attn_out_bias" else "no")]
    cases += [(field, v) for field in CHOICE_FIELDS for v in ("bogus", 3, None)]
    cases += [("name", 5), ("dropout", 1.0), ("dropout", 5), ("norm_eps", 10.0)]
    return [pytest.param(f, v, id=f"{f}={v!r}") for f, v in cases]


@pytest.mark.parametrize("field, value", _api_cases())
def test_model_config_field_from_python(field, value):
    """ModelConfig(field=value) for every field: a ConfigError naming ModelConfig, the field and the value."""
    api_refused(lambda: ModelConfig(**{**TINY, field: value}), ConfigError,
                names=["^ModelConfig: ", field, _escape(str(value)) if value is not None else "missing"])


def test_model_config_from_python_never_hangs_or_allocates():
    api_refused(lambda: ModelConfig(n_layers=10 ** 6), ConfigError, names=["n_layers", "1000000", "4096"])
    api_refused(lambda: ModelConfig(max_seq_len=4 * 10 ** 9), ConfigError, names=["max_seq_len", "4000000000"])
    api_refused(lambda: lucidlm.load("llama", random_init=True, n_layers=10 ** 6), ConfigError,
                names=["n_layers", "1000000"])
    # every field in range, too big together: refused when a model would be built, not before
    big = ModelConfig(vocab_size=MAX_VOCAB, d_model=65536, n_layers=4096, n_heads=512)
    api_refused(lambda: Transformer(big), ConfigError, names=["n_layers=4096", "d_model=65536", "would need"])
    api_refused(lambda: Transformer.empty(big), ConfigError, names=["would need"])
    with torch.device("meta"):  # shapes only: allowed (loaders use it to count and check names)
        assert Transformer(ModelConfig(n_layers=64, d_model=4096, n_heads=32)).num_parameters() > 10 ** 10


def test_rotary_tables_of_an_absurd_context_are_refused():
    """max_seq_len within bounds for a tiny model, but RoPE tables of 2**24 positions x 4096/2 pairs
    in float64 are 512 GB: refused before the table is allocated."""
    config = ModelConfig(vocab_size=50, d_model=4096, n_layers=1, n_heads=1, d_mlp=8, max_seq_len=MAX_CONTEXT)
    assert config.table_bytes() == 2 * MAX_CONTEXT * 2048 * 8  # cos and sin, float64
    api_refused(lambda: Transformer(config), ConfigError, names=["max_seq_len=16777216", "would need"])


@pytest.mark.parametrize("kw", [dict(TINY), dict(TINY, positions="learned", norm="layer", mlp="gelu", attn_bias=True,
                                                   mlp_bias=True, unembed_bias=True, tie_embeddings=True),
                                dict(TINY, qk_norm=True, post_sublayer_norm=True, attn_bias=True,
                                     attn_out_bias=False, mlp="geglu", rope_local_theta=10.0, sliding_window=4),
                                dict(TINY, norm="none", positions="sinusoidal", mlp="relu")])
def test_memory_estimate_counts_what_the_model_allocates(kw):
    """The size check counts the parameters the model really has (torch's count of its tensors)."""
    config = ModelConfig(**kw)
    model = Transformer(config)
    shared = {id(p) for p in model.parameters()}
    assert config.parameter_count() == sum(p.numel() for p in model.parameters()) and len(shared) > 0
    tables = sum(b.numel() * b.element_size() for n, b in model.named_buffers() if n.endswith(("cos", "sin", "table")))
    assert config.table_bytes() == tables


# ----------------------------------------------------------------------------- the CLI

@pytest.mark.parametrize("field, value, names", [
    ("max_position_embeddings", 4e9, ["config\\.json", "max_position_embeddings", "4000000000"]),
])
def test_cli_generate_refuses_a_bad_config_json(llama_template, tmp_path, field, value, names):
    path = copy_with(llama_template, tmp_path, **{field: value})
    refused("generate", "--model", str(path), "hi", names=names, watch=[path])


def test_cli_generate_refuses_an_escaping_shard_index(llama_template, tmp_path):
    path = sharded(llama_template, tmp_path)
    edit_index(path, lambda i: {"weight_map": dict.fromkeys(i["weight_map"], "/etc/passwd")})
    refused("generate", "--model", str(path), "hi", names=["/etc/passwd", "not a file inside"], watch=[path])


# ----------------------------------------------------------------------------- lucidlm's own lucidlm_config.json

@pytest.mark.parametrize("field, value, names", [
    ("n_layers", 1000000, ["n_layers", "1000000"]),
    ("max_seq_len", 4e9, ["max_seq_len", "4000000000"]),
    ("rope_theta", "abc", ["rope_theta", "'abc'"]),
    ("n_kv_heads", 3, ["n_heads=4", "n_kv_heads=3"]),
    ("dropout", 5, ["dropout", "5"]),
    ("positions", "alibi", ["positions", "'alibi'"]),
    ("tie_embeddings", "no", ["tie_embeddings", "'no'"]),
])
def test_lucidlm_config_json_field(tmp_path, field, value, names):
    from lucidlm.weights.checkpoint import save_model

    path = save_model(Transformer(preset("llama", **TINY)), tmp_path / "model")
    config = json.loads((path / "lucidlm_config.json").read_text())
    (path / "lucidlm_config.json").write_text(json.dumps({**config, field: value}))
    api_refused(lambda: lucidlm.load(path), ConfigError, names=names + ["lucidlm_config\\.json"], watch=[path])
