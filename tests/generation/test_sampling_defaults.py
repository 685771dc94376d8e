"""Sampling defaults come from the model, and are the same in Python and on the command line."""

from __future__ import annotations

import json

import pytest
from generation_toys import one_torch_thread, toy_model  # noqa: F401 (autouse fixture)

from lucidlm import cli
from lucidlm.generation import generate
from lucidlm.generation.defaults import FALLBACK, apply_sampling_defaults, sampling_defaults_for


def test_unset_options_take_the_model_defaults_and_explicit_ones_win():
    model = toy_model(seed=0)
    model.generation_defaults = {"temperature": 0.3, "top_k": 5}
    filled = apply_sampling_defaults(model, {"temperature": None, "top_k": None, "top_p": 0.9, "seed": 1})
    assert filled == {"temperature": 0.3, "top_k": 5, "top_p": 0.9, "seed": 1}
    assert apply_sampling_defaults(model, {"temperature": 0.0})["temperature"] == 0.0  # greedy stays greedy
    model.generation_defaults = {}
    assert apply_sampling_defaults(model, {"temperature": None})["temperature"] == FALLBACK["temperature"] == 1.0


def test_every_language_model_shows_its_defaults():
    """generate's docstring and the README point at ``model.generation_defaults``: a model
    whose file carries none (random_init, or built by hand) shows {} (it samples at FALLBACK's
    temperature 1), not an AttributeError."""
    import lucidlm

    model = lucidlm.load("gpt2", random_init=True, n_layers=1, d_model=32, n_heads=2)
    assert model.generation_defaults == {}
    assert apply_sampling_defaults(model, {"temperature": None})["temperature"] == 1.0


def test_generate_uses_the_model_defaults():
    model = toy_model(seed=0)
    model.generation_defaults = {"temperature": 4.0, "top_k": 50}
    implicit = generate(model, "Hello", max_new_tokens=20, seed=7)
    explicit = generate(model, "Hello", max_new_tokens=20, seed=7, temperature=4.0, top_k=50)
    plain = generate(model, "Hello", max_new_tokens=20, seed=7, temperature=1.0)
    assert implicit.token_ids == explicit.token_ids
    assert implicit.token_ids != plain.token_ids  # the defaults really changed the sampling


def test_cli_and_python_agree_through_generation_config(tmp_path, capsys):
    """A model directory's generation_config.json (transformers' format) sets the defaults
    of both ``lucidlm generate`` and ``model.generate``."""
    import lucidlm
    from lucidlm.weights.checkpoint import save_model

    save_model(toy_model(seed=1), tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"do_sample": True, "temperature": 0.4,
                                                                 "top_p": 0.8, "eos_token_id": 2}))
    assert sampling_defaults_for(tmp_path) == {"temperature": 0.4, "top_p": 0.8}
    model = lucidlm.load(tmp_path)
    assert model.generation_defaults == {"temperature": 0.4, "top_p": 0.8}
    assert cli.main(["generate", "Hello", "--model", str(tmp_path), "--seed", "11", "--max-new-tokens", "15",
                     "--json", "-q"]) == 0
    data = json.loads(capsys.readouterr().out)
    python = model.generate("Hello", seed=11, max_new_tokens=15)
    assert data["token_ids"] == python.token_ids
    assert python.token_ids == generate(model, "Hello", seed=11, max_new_tokens=15, temperature=0.4,
                                        top_p=0.8).token_ids
    (tmp_path / "generation_config.json").write_text(json.dumps({"do_sample": False, "temperature": 0.4}))
    assert sampling_defaults_for(tmp_path) == {"temperature": 0.0}  # transformers would decode greedily
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.4, "top_p": 0.8}))
    assert sampling_defaults_for(tmp_path) == {"temperature": 0.0}  # no do_sample: greedy too, as transformers
    # (tests/weights/test_hf_generation_config.py compares with transformers' generate)


def test_table_names_the_embedded_model():
    assert sampling_defaults_for("smollm2-135m") == {"temperature": 0.2, "top_p": 0.5}
    assert sampling_defaults_for("no-such-model") == {}


QUESTION = "What is the capital of France?"


@pytest.mark.slow
def test_readme_main_command_names_paris(smollm2_default, monkeypatch, capsys):
    """The README's `lucidlm generate --chat --stream "What is the capital of France?"`, over
    20 seeds, through cli.main with the default model the command loads (``lucidlm.load()``'s,
    quantized layers included), loaded once for the session: 20 loads would add nothing."""
    import lucidlm

    def load(source, **kwargs):
        assert source == "smollm2-135m" and kwargs.get("dtype") is None and kwargs.get("quantize") is None
        return smollm2_default

    monkeypatch.setattr(lucidlm, "load", load)
    answers = []
    for seed in range(20):
        assert cli.main(["generate", "--chat", "--stream", QUESTION, "--seed", str(seed), "-q"]) == 0
        answers.append(capsys.readouterr().out)
    named = sum("paris" in answer.lower() for answer in answers)
    assert named >= 18, answers


def test_gguf_sampling_keys_are_read(tmp_path):
    """llama.cpp's general.sampling.* keys, written by the gguf library itself."""
    import gguf

    path = tmp_path / "sampled.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_string(gguf.Keys.General.NAME, "SmolLM2 135M Instruct")
    writer.add_float32(gguf.Keys.General.SAMPLING_TEMP, 0.6)
    writer.add_int32(gguf.Keys.General.SAMPLING_TOP_K, 20)
    writer.add_float32(gguf.Keys.General.SAMPLING_TOP_P, 0.95)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    found = sampling_defaults_for(path)
    assert found == {"temperature": pytest.approx(0.6), "top_k": 20, "top_p": pytest.approx(0.95)}

    bare = tmp_path / "named.gguf"  # no sampling keys: the table, by the model's own name
    _gguf_named(bare, "SmolLM2 135M Instruct")
    assert sampling_defaults_for(bare) == {"temperature": 0.2, "top_p": 0.5}
    renamed = tmp_path / "SmolLM2-135M-Instruct.Q8_0.gguf"  # an unhelpful general.name: the file's name
    _gguf_named(renamed, "Smollm2 135M 8k Lc100K Mix1 Ep2")
    assert sampling_defaults_for(renamed) == {"temperature": 0.2, "top_p": 0.5}


def _gguf_named(path, name):
    """A GGUF file with only ``general.name``: no tensors, no sampling keys."""
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_string(gguf.Keys.General.NAME, name)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
