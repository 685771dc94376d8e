"""A Hugging Face directory's generation_config.json (and config.json) decide where generation
stops and how it decodes by default, as they do for transformers' ``generate``: the same tiny
random Llama, saved with ``save_pretrained``, read by both, greedy outputs compared token for
token (transformers reading its own files is the reference).

transformers' rules: ``generate`` stops on every id of ``generation_config.eos_token_id`` (an int
or a list), whatever the tokenizer's eos_token; it decodes greedily unless the file says
``"do_sample": true`` (a temperature or top_p alone does not make it sample), and applies
``repetition_penalty`` either way. With no generation_config.json it takes config.json's ids.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_hf_llama import hf_llama
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoModelForCausalLM

import lucidlm
from lucidlm import cli
from lucidlm.errors import ConfigError
from lucidlm.generation import generate
from lucidlm.weights.checkpoint import save_model

PROMPT = [5, 17, 33, 8]
NEW = 20


@pytest.fixture(scope="module")
def free_run() -> list[int]:
    """The model's greedy continuation of PROMPT with no end token at all."""
    out = hf_llama(tie=False).generate(torch.tensor([PROMPT]), max_new_tokens=NEW, do_sample=False,
                                       eos_token_id=None, pad_token_id=0)[0, len(PROMPT):].tolist()
    assert 2 not in out[:6] and out[5] not in out[:5]  # the end token chosen below is first reached at step 5
    return out


def save_dir(path: Path, generation: dict | None, config_eos: int | None = 2, tokenizer_eos: bool = True) -> Path:
    """The tiny Llama as transformers saves it, with this generation_config.json (None: none),
    config.json's eos_token_id, and a word-level tokenizer whose eos_token is </s> (id 2) or unset."""
    model = hf_llama(tie=False)
    model.config.eos_token_id = config_eos
    model.save_pretrained(path)
    if generation is None:
        (path / "generation_config.json").unlink()
    else:
        (path / "generation_config.json").write_text(json.dumps(generation))
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2} | {f"t{i}": i for i in range(3, 101)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens(["<pad>", "<s>", "</s>"])
    tokenizer.save(str(path / "tokenizer.json"))
    roles = {"bos_token": "<s>", "pad_token": "<pad>", "add_bos_token": False}
    if tokenizer_eos:
        roles["eos_token"] = "</s>"
    (path / "tokenizer_config.json").write_text(json.dumps(roles))
    return path


def transformers_generate(path: Path) -> list[int]:
    """transformers' ``generate`` with everything from the directory's own files."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    out = model.generate(torch.tensor([PROMPT]), max_new_tokens=NEW, pad_token_id=0)
    return out[0, len(PROMPT):].tolist()


@pytest.mark.parametrize("tokenizer_eos", [True, False])
def test_generation_stops_on_every_eos_id_of_generation_config(tmp_path, free_run, tokenizer_eos):
    """Llama-3-Instruct style: generation_config.json lists two end tokens, the tokenizer knows
    one or none; greedy by default (no do_sample), as transformers."""
    end = free_run[5]
    path = save_dir(tmp_path, {"eos_token_id": [2, end], "bos_token_id": 1}, tokenizer_eos=tokenizer_eos)
    expected = transformers_generate(path)
    assert expected == free_run[:6]  # transformers stops at the second id
    model = lucidlm.load(path)
    assert model.tokenizer.eos_ids == [2, end]
    assert model.generation_defaults == {"temperature": 0.0}
    result = model.generate(PROMPT, max_new_tokens=NEW)  # no options: the file's greedy decoding
    assert result.token_ids == expected and result.finish_reason == "eos"


def test_config_json_eos_without_a_generation_config(tmp_path, free_run):
    path = save_dir(tmp_path, None, config_eos=free_run[5], tokenizer_eos=True)
    expected = transformers_generate(path)
    assert expected == free_run[:6]
    model = lucidlm.load(path)
    assert model.tokenizer.eos_ids == [free_run[5]]  # config.json's, not the tokenizer's </s>
    assert generate(model, PROMPT, temperature=0, max_new_tokens=NEW).token_ids == expected


def test_end_ids_survive_saving_the_model(tmp_path, free_run):
    model = lucidlm.load(save_dir(tmp_path / "hf", {"eos_token_id": [2, free_run[5]]}))
    save_model(model, tmp_path / "saved")
    reloaded = lucidlm.load(tmp_path / "saved")
    assert reloaded.tokenizer.eos_ids == [2, free_run[5]]
    assert generate(reloaded, PROMPT, temperature=0, max_new_tokens=NEW).token_ids == free_run[:6]


@pytest.mark.parametrize("generation", [
    {"temperature": 0.6, "top_p": 0.9},  # sampling values without do_sample: transformers is greedy
    {"do_sample": False, "temperature": 0.6, "top_k": 20},
    {"repetition_penalty": 1.8},  # greedy, with the penalty
])
def test_greedy_unless_do_sample_as_in_transformers(tmp_path, capsys, free_run, generation):
    path = save_dir(tmp_path, {**generation, "eos_token_id": 2})
    expected = transformers_generate(path)
    greedy = free_run[:free_run.index(2) + 1]  # to the eos, id 2
    if "repetition_penalty" in generation:
        assert expected != greedy  # the penalty changed the greedy tokens
    else:
        assert expected == greedy
    model = lucidlm.load(path)
    penalty = {"repetition_penalty": 1.8} if "repetition_penalty" in generation else {}
    assert model.generation_defaults == {"temperature": 0.0, **penalty}
    assert model.generate(PROMPT, max_new_tokens=NEW, seed=3).token_ids == expected
    assert generate(model, PROMPT, max_new_tokens=NEW, temperature=0, **penalty).token_ids == expected
    assert model.tokenizer.encode("t5 t17 t33 t8") == PROMPT
    assert cli.main(["generate", "t5 t17 t33 t8", "--model", str(path), "--max-new-tokens", str(NEW), "--seed", "3",
                     "--json", "-q"]) == 0
    assert json.loads(capsys.readouterr().out)["token_ids"] == expected  # the command line decodes the same


def test_do_sample_true_takes_the_files_sampling_values(tmp_path):
    path = save_dir(tmp_path, {"do_sample": True, "temperature": 0.6, "top_p": 0.9, "top_k": 20, "min_p": 0.05,
                               "eos_token_id": 2})
    assert AutoModelForCausalLM.from_pretrained(path).generation_config.do_sample is True
    model = lucidlm.load(path)
    assert model.generation_defaults == {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "min_p": 0.05}
    implicit = model.generate(PROMPT, max_new_tokens=NEW, seed=5).token_ids
    assert implicit == generate(model, PROMPT, max_new_tokens=NEW, seed=5, temperature=0.6, top_p=0.9, top_k=20,
                                min_p=0.05).token_ids


def test_do_sample_true_takes_the_files_typical_p_and_cutoffs(tmp_path):
    values = {"typical_p": 0.9, "epsilon_cutoff": 3e-4, "eta_cutoff": 2e-3}
    path = save_dir(tmp_path, {"do_sample": True, "temperature": 0.8, **values, "eos_token_id": 2})
    config = AutoModelForCausalLM.from_pretrained(path).generation_config
    assert {name: getattr(config, name) for name in values} == values  # what transformers' generate applies
    model = lucidlm.load(path)
    assert model.generation_defaults == {"temperature": 0.8, **values}
    implicit = model.generate(PROMPT, max_new_tokens=NEW, seed=5).token_ids
    assert implicit == generate(model, PROMPT, max_new_tokens=NEW, seed=5, temperature=0.8, **values).token_ids
    greedy = save_dir(tmp_path / "greedy", dict(values, eos_token_id=2))  # no do_sample: transformers ignores them
    assert lucidlm.load(greedy).generation_defaults == {"temperature": 0.0}


@pytest.mark.parametrize("file, content, problem", [
    ("generation_config.json", {"eos_token_id": "2"}, "field 'eos_token_id' is '2'; expected an integer"),
    ("generation_config.json", {"eos_token_id": [2, "x"]}, "field 'eos_token_id' is [2, 'x']; expected a list of ints"),
    ("generation_config.json", {"eos_token_id": [2, 500]},
     "field 'eos_token_id[1]' is 500, outside the model's vocabulary of 101 tokens"),
    ("generation_config.json", {"do_sample": "yes"}, "field 'do_sample' is 'yes'; expected true or false"),
    ("generation_config.json", {"do_sample": True, "top_p": 1.5}, "field 'top_p' is 1.5"),
    ("generation_config.json", {"do_sample": True, "typical_p": 0}, "field 'typical_p' is 0.0; expected a number > 0"),
    ("generation_config.json", {"do_sample": True, "eta_cutoff": 1}, "field 'eta_cutoff' is 1.0; expected a number < 1"),
    ("generation_config.json", "{", "generation config is not valid JSON"),
    ("config.json", {"eos_token_id": -1}, "field 'eos_token_id' is -1, outside the model's vocabulary"),
])
def test_a_damaged_value_is_one_line_naming_file_and_field(tmp_path, file, content, problem):
    path = save_dir(tmp_path, None if file == "config.json" else {})
    target = path / file
    if file == "config.json":
        config = json.loads(target.read_text())
        target.write_text(json.dumps({**config, **content}))
    else:
        target.write_text(content if isinstance(content, str) else json.dumps(content))
    with pytest.raises(ConfigError) as caught:
        lucidlm.load(path)
    message = str(caught.value)
    assert message.startswith(f"{target}: ") and problem in message and "\n" not in message
    assert f"original {file}" in message  # the fix


@pytest.mark.parametrize("to", ["hf", "lucidlm"])
def test_a_saved_model_keeps_its_sampling_defaults_and_end_tokens(tmp_path, free_run, to):
    """A converted or merged model samples as the model it came from: its defaults (the embedded
    SmolLM2's temperature 0.2 / top-p 0.5 come from lucidlm's table, not its file) and its end
    tokens go into generation_config.json, which transformers reads as its own."""
    from transformers import GenerationConfig

    from lucidlm.weights.hf import save_hf

    model = lucidlm.load(save_dir(tmp_path / "src", {"eos_token_id": [2, free_run[5]]}))
    model.generation_defaults = {"temperature": 0.2, "top_p": 0.5}
    (save_hf if to == "hf" else save_model)(model, tmp_path / "out")
    theirs = GenerationConfig.from_pretrained(tmp_path / "out")
    assert (theirs.do_sample, theirs.temperature, theirs.top_p, theirs.eos_token_id) == (True, 0.2, 0.5,
                                                                                       [2, free_run[5]])
    again = lucidlm.load(tmp_path / "out")
    assert again.generation_defaults == {"temperature": 0.2, "top_p": 0.5}
    assert again.tokenizer.eos_ids == [2, free_run[5]]
    model.generation_defaults = {}
    (save_hf if to == "hf" else save_model)(model, tmp_path / "out")  # nothing to say on sampling: the ids stay
    assert json.loads((tmp_path / "out" / "generation_config.json").read_text()) == {
        "eos_token_id": [2, free_run[5]], "bos_token_id": 1, "pad_token_id": 0}  # the tokenizer's <s> and <pad>


@pytest.mark.parametrize("to", ["hf", "lucidlm"])
def test_logits_processors_of_a_greedy_file_survive_saving(tmp_path, free_run, to):
    """A greedy generation_config.json's processors (transformers applies them when greedy
    too) are read, applied, and written back when the model is saved: transformers generates
    the same from the saved directory as from the original, and so does lucidlm."""
    from transformers import GenerationConfig

    from lucidlm.weights.hf import save_hf

    processors = {"no_repeat_ngram_size": 2, "suppress_tokens": [free_run[1]], "bad_words_ids": [free_run[3:5]],
                  "sequence_bias": [[[free_run[6]], -4.0]]}
    source = save_dir(tmp_path / "src", {"eos_token_id": 2, **processors})
    expected = transformers_generate(source)
    assert expected != free_run  # the processors changed the greedy output
    model = lucidlm.load(source)
    assert generate(model, PROMPT, max_new_tokens=NEW).token_ids == expected
    (save_hf if to == "hf" else save_model)(model, tmp_path / "out")
    theirs = GenerationConfig.from_pretrained(tmp_path / "out")
    assert {name: getattr(theirs, name) for name in processors} == processors
    if to == "hf":  # (transformers reads the generation config of lucidlm's own format, not its weights)
        assert transformers_generate(tmp_path / "out") == expected
    assert generate(lucidlm.load(tmp_path / "out"), PROMPT, max_new_tokens=NEW).token_ids == expected


def test_openais_options_in_the_defaults_survive_saving(tmp_path):
    """logit_bias and the presence and frequency penalties, which transformers lacks, are kept in
    generation_config.json as lucidlm's own fields (transformers reads the file regardless)."""
    from transformers import GenerationConfig

    model = lucidlm.load(save_dir(tmp_path / "src", None))
    defaults = {"temperature": 0.0, "logit_bias": {7: -100.0}, "presence_penalty": 0.5, "frequency_penalty": 1.5}
    model.generation_defaults = dict(defaults)
    save_model(model, tmp_path / "out")
    GenerationConfig.from_pretrained(tmp_path / "out")  # still a file transformers reads
    again = lucidlm.load(tmp_path / "out").generation_defaults
    assert {**again, "logit_bias": dict(again["logit_bias"])} == defaults


@pytest.mark.parametrize("to", ["hf", "lucidlm"])
def test_defaults_in_any_form_generate_takes_survive_saving(tmp_path, free_run, to):
    """Sets, ranges, tensors, NumPy numbers and sequence_bias's {(ids): bias}, which generate()
    takes, are written as JSON lists and numbers (json.dumps refused them, after the weights
    were written), and read back to the same generation."""
    import numpy as np
    from transformers import GenerationConfig

    from lucidlm.weights.hf import save_hf

    model = lucidlm.load(save_dir(tmp_path / "src", None))
    model.generation_defaults = {"temperature": 0.0, "suppress_tokens": {free_run[1], free_run[4]},
                                 "bad_words_ids": (tuple(np.array(free_run[2:4])),),
                                 "sequence_bias": {(free_run[5],): -4.0, tuple(free_run[6:8]): np.float32(-2.5)},
                                 "logit_bias": {np.int64(free_run[9]): -100.0}, "no_repeat_ngram_size": np.int64(3)}
    expected = generate(model, PROMPT, max_new_tokens=NEW).token_ids
    assert expected != free_run
    (save_hf if to == "hf" else save_model)(model, tmp_path / "out")
    theirs = GenerationConfig.from_pretrained(tmp_path / "out")
    assert theirs.sequence_bias == [[[free_run[5]], -4.0], [free_run[6:8], -2.5]]
    assert generate(lucidlm.load(tmp_path / "out"), PROMPT, max_new_tokens=NEW).token_ids == expected
