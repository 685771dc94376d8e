"""Edges of the Hugging Face round trip, with transformers as the reference: what it stops on,
what it can load, and what it computes.

- End tokens: an export names the end tokens the model declares (the ids lucidlm stops on) in
  config.json and, whenever it writes one, in generation_config.json; transformers 5 reads no
  eos_token_id from config.json once a generation_config.json exists. A declared end token that
  is not the tokenizer's eos_token role stays the declared one.
- A directory without tokenizer.json still stops where transformers stops.
- transformers' LlamaConfig refuses a hidden_size its head count does not divide, even with
  head_dim given: such a model is refused at export, and such a directory on load, by name.
- Configs that compute what LLaMA computes are not refused: hidden_act "swish" (SiLU in
  transformers' ACT2FN) and a sliding window that covers the whole context.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from torch.testing import assert_close
from transformers import AutoModelForCausalLM, GenerationConfig, LlamaConfig, LlamaForCausalLM
from test_hf_llama import VOCAB, hf_llama

import lucidlm
from lucidlm.config import ModelConfig, preset
from lucidlm.errors import ConfigError
from lucidlm.generation import generate_batch
from lucidlm.model.transformer import Transformer
from lucidlm.weights.checkpoint import save_model
from lucidlm.weights.hf import save_hf
from random_weights import randomize_

PROMPT = [5, 17, 33, 8]
NEW = 20


@pytest.fixture(scope="module")
def free_run() -> list[int]:
    """transformers' greedy continuation of PROMPT with no end token at all."""
    with torch.no_grad():
        out = hf_llama(tie=False).generate(torch.tensor([PROMPT]), max_new_tokens=NEW, do_sample=False,
                                           eos_token_id=None, pad_token_id=0)[0, len(PROMPT):].tolist()
    assert 2 not in out[:6] and out[5] not in out[:5] and out[5] > 2  # the end token below is first reached at step 5
    return out


def hf_dir(path: Path, eos: int | list[int], generation: dict | None, tokenizer_eos: str | None = "</s>") -> Path:
    """The tiny Llama as transformers saves it, config.json's eos_token_id ``eos``, this
    generation_config.json (None: none), and a word-level tokenizer whose eos_token role is
    ``tokenizer_eos`` (None: no tokenizer.json at all)."""
    model = hf_llama(tie=False)
    model.config.eos_token_id = eos
    model.generation_config = GenerationConfig(**(generation or {}))
    model.save_pretrained(path)
    if generation is None:
        (path / "generation_config.json").unlink()
    if tokenizer_eos is not None:
        vocab = {"<pad>": 0, "<s>": 1, "</s>": 2} | {f"t{i}": i for i in range(3, VOCAB)}
        tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
        tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        tokenizer.add_special_tokens(["<pad>", "<s>", tokenizer_eos])
        tokenizer.save(str(path / "tokenizer.json"))
        roles = {"bos_token": "<s>", "eos_token": tokenizer_eos, "pad_token": "<pad>", "add_bos_token": False}
        (path / "tokenizer_config.json").write_text(json.dumps(roles))
    return path


def transformers_greedy(path: Path) -> list[int]:
    """transformers' greedy ``generate``, stopping where the directory's own files say."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([PROMPT]), max_new_tokens=NEW, do_sample=False, pad_token_id=0)
    return out[0, len(PROMPT):].tolist()


# ------------------------------------------------------------------ end tokens of an export

def test_export_with_sampling_defaults_names_its_single_end_token(tmp_path, free_run):
    """The usual directory: config.json, generation_config.json (do_sample, temperature) and the
    tokenizer agree on one end token. The export's generation_config.json must name it too."""
    end = free_run[5]
    src = hf_dir(tmp_path / "src", end, {"do_sample": True, "temperature": 0.6, "eos_token_id": end, "bos_token_id": 1},
                 tokenizer_eos=f"t{end}")
    want = transformers_greedy(src)
    assert want == free_run[:6]
    save_hf(lucidlm.load(src), tmp_path / "out")
    theirs = GenerationConfig.from_pretrained(tmp_path / "out")
    assert (theirs.do_sample, theirs.temperature, theirs.eos_token_id) == (True, 0.6, end)
    assert transformers_greedy(tmp_path / "out") == want


@pytest.mark.parametrize("defaults", [{}, {"temperature": 0.2, "top_p": 0.5}])  # no generation_config.json / one
def test_export_keeps_a_declared_end_token_that_is_not_the_tokenizers_eos(tmp_path, free_run, defaults):
    """config.json declares the end token, the tokenizer's eos_token is </s> (id 2): transformers
    stops on the declared one, and so must transformers on the export."""
    end = free_run[5]
    src = hf_dir(tmp_path / "src", end, None, tokenizer_eos="</s>")
    want = transformers_greedy(src)
    assert want == free_run[:6]
    model = lucidlm.load(src)
    model.generation_defaults = defaults
    save_hf(model, tmp_path / "out")
    assert json.loads((tmp_path / "out" / "config.json").read_text())["eos_token_id"] == end
    assert transformers_greedy(tmp_path / "out") == want
    # the tokenizer's own role stays as its files set it
    assert json.loads((tmp_path / "out" / "tokenizer_config.json").read_text())["eos_token"] == "</s>"


@pytest.mark.parametrize("through_lucidlm_format", [False, True])
def test_a_written_generation_config_keeps_the_bos_and_pad_ids(tmp_path, through_lucidlm_format):
    """transformers 5 reads no bos/pad id from config.json once generation_config.json exists: an
    export that writes one (sampling defaults, several end tokens) with a tokenizer beside it
    named neither, so transformers' generate() without a prompt refused to start ("bos_token_id
    has to be defined") where the source starts from its BOS."""
    src = hf_dir(tmp_path / "src", [2, 7], {"do_sample": True, "temperature": 0.7, "top_k": 20, "eos_token_id": [2, 7],
                                             "bos_token_id": 1, "pad_token_id": 0})
    model = lucidlm.load(src)
    if through_lucidlm_format:
        save_model(model, tmp_path / "mine")
        model = lucidlm.load(tmp_path / "mine")
    save_hf(model, tmp_path / "out")

    source = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    export = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    for key in ("bos_token_id", "eos_token_id", "pad_token_id", "do_sample", "temperature", "top_k"):
        assert getattr(export.generation_config, key) == getattr(source.generation_config, key), key
    with torch.no_grad():  # no prompt: transformers starts from the BOS the files declare
        assert export.generate(max_new_tokens=4, do_sample=False).tolist() == \
            source.generate(max_new_tokens=4, do_sample=False).tolist()


@pytest.mark.parametrize("declared", ["int", "list"])
def test_a_directory_without_a_tokenizer_stops_on_its_declared_end_tokens(tmp_path, free_run, declared):
    end = free_run[5]
    eos = end if declared == "int" else [2, end]  # 2 is not reached (free_run)
    src = hf_dir(tmp_path / "src", eos, {"eos_token_id": eos, "bos_token_id": 1}, tokenizer_eos=None)
    want = transformers_greedy(src)
    assert want == free_run[:6]
    model = lucidlm.load(src)
    assert model.tokenizer is None
    result = model.generate(PROMPT, max_new_tokens=NEW, temperature=0)
    assert (result.token_ids, result.finish_reason) == (want, "eos")
    [batched] = generate_batch(model, [PROMPT], max_new_tokens=NEW, temperature=0)
    assert (batched.token_ids, batched.finish_reason) == (want, "eos")
    save_hf(model, tmp_path / "out")
    assert json.loads((tmp_path / "out" / "config.json").read_text())["eos_token_id"] == eos
    assert transformers_greedy(tmp_path / "out") == want
    again = lucidlm.load(tmp_path / "out").generate(PROMPT, max_new_tokens=NEW, temperature=0)
    assert again.token_ids == want
    # lucidlm's own format keeps them too (the tokenizer file, which would, is absent)
    save_model(model, tmp_path / "own")
    kept = lucidlm.load(tmp_path / "own").generate(PROMPT, max_new_tokens=NEW, temperature=0)
    assert (kept.token_ids, kept.finish_reason) == (want, "eos")


# ------------------------------------------------------------------ what transformers can load

def test_export_refuses_a_width_the_head_count_does_not_divide(tmp_path):
    with pytest.raises(Exception, match=r"hidden size \(36\) is not a multiple of the number of attention heads \(8\)"):
        LlamaConfig(vocab_size=53, hidden_size=36, num_attention_heads=8, head_dim=8)  # transformers refuses it
    model = Transformer(ModelConfig(vocab_size=53, d_model=36, n_heads=8, head_dim=8, n_kv_heads=2, d_mlp=40,
                                    n_layers=2, max_seq_len=32))
    with pytest.raises(ConfigError, match=r"d_model=36 is not divisible by n_heads=8.*LlamaConfig.*head_dim=8"):
        save_hf(model, tmp_path / "out")
    assert not (tmp_path / "out").exists()  # refused before anything is written


def test_export_of_an_explicit_head_dim_transformers_accepts(tmp_path):
    """n_heads x head_dim != d_model is fine for transformers when n_heads divides d_model."""
    torch.manual_seed(3)
    ours = randomize_(Transformer(ModelConfig(vocab_size=53, d_model=32, n_heads=8, head_dim=8, n_kv_heads=2,
                                              d_mlp=40, n_layers=2, max_seq_len=32)), seed=3).eval()
    save_hf(ours, tmp_path)
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    ids = torch.randint(0, 53, (1, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = theirs(ids).logits
        assert want.std() > 0.3
        assert_close(ours(ids), want)


def test_load_names_a_width_the_head_count_does_not_divide(tmp_path):
    hf_llama(tie=False).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "hidden_size": 36, "num_attention_heads": 8,
                                                      "num_key_value_heads": 2, "head_dim": 8}))
    with pytest.raises(Exception, match=r"not a multiple of the number of attention heads"):
        AutoModelForCausalLM.from_pretrained(tmp_path)
    with pytest.raises(ConfigError) as caught:
        lucidlm.load(tmp_path)
    message = str(caught.value)
    assert "hidden_size=36 is not divisible by num_attention_heads=8" in message
    assert "head_dim=8" in message and "transformers cannot load" in message and "\n" not in message


# ------------------------------------------------------------------ needless refusals

def test_swish_is_silu(tmp_path):
    hf = hf_llama(tie=False, hidden_act="swish").eval()
    hf.save_pretrained(tmp_path)
    ids = torch.randint(0, VOCAB, (1, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf(ids).logits
        assert want.std() > 0.3
        assert_close(lucidlm.load(tmp_path)(ids), want)


SIZES = dict(vocab_size=VOCAB, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_mlp=128, max_seq_len=64)


@pytest.mark.parametrize("window", [64, 100])  # = max_seq_len, > max_seq_len
def test_a_window_that_covers_the_context_exports(tmp_path, window):
    torch.manual_seed(5)
    ours = randomize_(Transformer(preset("llama", **SIZES, sliding_window=window)), seed=5).eval()
    save_hf(ours, tmp_path)
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    ids = torch.randint(0, VOCAB, (1, 64), generator=torch.Generator().manual_seed(2))  # the whole context
    with torch.no_grad():
        want = theirs(ids).logits
        assert want.std() > 0.3
        assert_close(ours(ids), want)


@pytest.mark.parametrize("changes, field", [
    (dict(sliding_window=63), r"sliding_window=63 \(2 of 2 layers attend locally\)"),
    (dict(sliding_window=64, rope_local_theta=100.0), r"rope_local_theta=100\.0 differs .*sliding_window=64"),
])
def test_a_window_that_changes_something_is_still_refused(tmp_path, changes, field):
    with pytest.raises(ConfigError, match=field):
        save_hf(Transformer(preset("llama", **SIZES, **changes)), tmp_path / "out")
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------ a model saved quantized


QUANTIZED_ATOL = {"int8": 0.15, "int4": 0.05}  # as tests/families/qwen_toys.py


@pytest.mark.parametrize("tie, quantize", [(True, "int8"), (False, "int4")])
def test_convert_to_hf_dequantizes_a_model_saved_quantized(tmp_path, capsys, tie, quantize):
    """A lucidlm directory saved with --quantize loads back quantized, with no float weights to
    go back to: --to hf writes the matrices its codes stand for (as a quantized GGUF is written),
    where it used to refuse and tell the user to load it without quantize= (which they had).
    Each exported matrix lies within one quantization step of transformers' original, and
    transformers on the export computes what lucidlm's quantized model computes (which, for
    int8 per channel read back from its file, used to crash the process: torch's int8 kernel
    on codes the file's offsets left unaligned)."""
    from lucidlm.cli import main

    original = hf_llama(tie=tie)
    original.save_pretrained(tmp_path / "float")
    assert main(["convert", str(tmp_path / "float"), str(tmp_path / "q"), "--to", "lucidlm",
                 "--quantize", quantize]) == 0
    assert main(["convert", str(tmp_path / "q"), str(tmp_path / "hf"), "--to", "hf"]) == 0
    assert f"dequantized from {quantize}" in capsys.readouterr().out

    export = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    assert export.config.tie_word_embeddings is tie
    exported, wanted = export.state_dict(), original.state_dict()
    levels = 127 if quantize == "int8" else 15  # int8: symmetric per row; int4: (max - min) / 15 per group of 32
    for name, weight in wanted.items():
        if weight.ndim == 2:
            rows = weight.reshape(weight.shape[0], -1, 32 if quantize == "int4" else weight.shape[1])
            step = (rows.abs().amax(-1) if quantize == "int8" else rows.amax(-1) - rows.amin(-1)) / levels
            assert ((exported[name] - weight).reshape(rows.shape).abs() <= step[..., None] * 1.01 + 1e-6).all(), name
        else:
            assert torch.equal(exported[name], weight), name  # norms stay float
    assert not torch.equal(exported["model.layers.0.mlp.up_proj.weight"], wanted["model.layers.0.mlp.up_proj.weight"])
    ids = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():  # lucidlm's quantized kernels round activations through bfloat16
        assert_close(export(ids).logits, lucidlm.load(tmp_path / "q")(ids), atol=QUANTIZED_ATOL[quantize], rtol=0)
