"""Writing a model over an earlier one and reading it back, with transformers as the reference.

- A save over a transformers-saved model removes that model's chat template files
  (``chat_template.jinja``, ``additional_chat_templates/``), which transformers and lucidlm read
  before tokenizer_config.json's ``chat_template``, and its other tokenizer files.
- A directory named like a model file (``config.json/``) stops a save before it writes anything.
- A Hugging Face directory with ``model.safetensors`` and a stale shard index (what transformers'
  own save_pretrained leaves after a sharded save and an unsharded one) is read as transformers
  reads it: ``model.safetensors`` first.
- A full fine-tune keeps the base model's sampling defaults (generation_config.json) in its
  checkpoint, and ``lucidlm.load(RUN)`` reads them where it reads the weights, RUN/checkpoint.
- A directory without tokenizer.json keeps config.json's bos and pad ids through an export.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (AutoModelForCausalLM, AutoTokenizer, GenerationConfig, LlamaConfig, LlamaForCausalLM,
                          PreTrainedTokenizerFast)

import lucidlm
from lucidlm.weights.checkpoint import save_model
from lucidlm.weights.hf import save_hf
from random_weights import randomize_

VOCAB = 48
NEW = "{% for m in messages %}NEW {{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
OLD = "{% for m in messages %}OLD {{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
MESSAGES = [{"role": "user", "content": "t5 t6"}]


def tiny_llama(seed: int, **overrides) -> LlamaForCausalLM:
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=64, max_position_embeddings=64, **overrides)
    torch.manual_seed(seed)
    return randomize_(LlamaForCausalLM(config), seed).eval()


def word_tokenizer(template: str | dict | None) -> PreTrainedTokenizerFast:
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2} | {f"t{i}": i for i in range(3, VOCAB)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.add_special_tokens(["<pad>", "<s>", "</s>"])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>",
                                        pad_token="<pad>")
    tokenizer.chat_template = template
    return tokenizer


def transformers_saved(path: Path, seed: int, template: str | dict | None) -> Path:
    """A model and tokenizer as transformers 5 saves them (its template in chat_template.jinja,
    named ones in additional_chat_templates/)."""
    tiny_llama(seed).save_pretrained(path)
    word_tokenizer(template).save_pretrained(path)
    return path


# ------------------------------------------------------------ a save over a transformers model

@pytest.mark.parametrize("template", [NEW, None])
def test_a_save_over_a_transformers_model_drops_its_chat_templates(tmp_path, template):
    old = transformers_saved(tmp_path / "out", 1, {"default": OLD, "tool_use": OLD + "tools"})
    (old / "vocab.json").write_text(json.dumps({"t3": 0}))  # a slow tokenizer's leftovers
    (old / "merges.txt").write_text("#version: 0.2\n")
    (old / "notes.txt").write_text("mine")  # the user's own file
    assert (old / "chat_template.jinja").is_file() and (old / "additional_chat_templates").is_dir()
    source = transformers_saved(tmp_path / "src", 0, template)

    save_hf(lucidlm.load(source), old)
    save_hf(lucidlm.load(source), tmp_path / "fresh")  # the same save into an empty directory

    assert sorted(p.name for p in old.iterdir()) == sorted(["notes.txt", *(p.name for p in (tmp_path / "fresh")
                                                                           .iterdir())])
    theirs, exported = AutoTokenizer.from_pretrained(source), AutoTokenizer.from_pretrained(old)
    assert exported.chat_template == theirs.chat_template
    if template is not None:
        assert exported.apply_chat_template(MESSAGES, tokenize=False) == \
            theirs.apply_chat_template(MESSAGES, tokenize=False) == "NEW user: t5 t6\n"
    assert lucidlm.load(old).tokenizer.chat_template == template


# ------------------------------------------------------------ a directory in a file's place

@pytest.mark.parametrize("name", ["config.json", "tokenizer.json"])
def test_a_directory_named_like_a_model_file_stops_the_save_before_it_writes(tmp_path, name):
    out = tmp_path / "out"
    tiny_llama(1).save_pretrained(out)  # the earlier model, as transformers wrote it
    (out / name).unlink(missing_ok=True)
    (out / name).mkdir()
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    model = lucidlm.load(transformers_saved(tmp_path / "src", 0, None))

    with pytest.raises(IsADirectoryError, match=name):
        save_hf(model, out)
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before  # nothing new beside the old
    assert not any(p.name.startswith(".") for p in out.iterdir())  # no staging files left either


# ------------------------------------------------------------ model.safetensors beside a stale index

def test_model_safetensors_wins_over_a_stale_shard_index_as_in_transformers(tmp_path):
    first, second = tiny_llama(0), tiny_llama(1)
    first.save_pretrained(tmp_path, max_shard_size="20KB")  # an earlier save in shards
    second.save_pretrained(tmp_path)  # then one file: transformers removes the shards, not the index
    assert (tmp_path / "model.safetensors.index.json").is_file()
    ids = torch.randint(0, VOCAB, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        theirs = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()(ids).logits
        ours = lucidlm.load(tmp_path)(ids)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


def test_a_stale_index_with_its_old_shards_present_is_not_read(tmp_path):
    """The worse case: the old shards still there. transformers reads model.safetensors."""
    tiny_llama(0).save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    tiny_llama(1).save_pretrained(tmp_path / "both")
    for shard in (tmp_path / "sharded").glob("model*"):
        (tmp_path / "both" / shard.name).write_bytes(shard.read_bytes())
    ids = torch.arange(3, 15)[None]
    with torch.no_grad():
        theirs = AutoModelForCausalLM.from_pretrained(tmp_path / "both", dtype=torch.float32).eval()(ids).logits
        ours = lucidlm.load(tmp_path / "both")(ids)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------ sampling defaults through a fine-tune

SAMPLING = {"do_sample": True, "temperature": 0.3, "top_p": 0.7}


def with_sampling(path: Path) -> Path:
    GenerationConfig(**SAMPLING, bos_token_id=1, eos_token_id=2).save_pretrained(path)
    return path


def test_a_full_fine_tune_keeps_the_base_models_sampling_defaults(tmp_path):
    from lucidlm.training.config import FinetuneConfig
    from lucidlm.training.finetune import finetune

    base = with_sampling(transformers_saved(tmp_path / "base", 0, None))
    (tmp_path / "data.jsonl").write_text("".join(json.dumps({"text": f"t{3 + i} t{4 + i} t{5 + i} t9"}) + "\n"
                                                 for i in range(8)))
    finetune(FinetuneConfig(model=str(base), data=str(tmp_path / "data.jsonl"), out_dir=str(tmp_path / "run"),
                            method="full", max_iters=1, batch_size=2, eval_interval=1, eval_iters=1,
                            sample_tokens=0, warmup_iters=0, progress=False, max_length=8))
    save_hf(lucidlm.load(tmp_path / "run"), tmp_path / "hf")  # what `lucidlm convert RUN OUT --to hf` does

    theirs = GenerationConfig.from_pretrained(base)
    exported = GenerationConfig.from_pretrained(tmp_path / "hf")
    for key in SAMPLING:
        assert getattr(exported, key) == getattr(theirs, key), key
    assert lucidlm.load(tmp_path / "run").generation_defaults == {"temperature": theirs.temperature,
                                                                  "top_p": theirs.top_p}


def test_a_runs_sampling_defaults_are_read_from_its_checkpoint(tmp_path):
    model = lucidlm.load(with_sampling(transformers_saved(tmp_path / "base", 0, None)))
    save_model(model, tmp_path / "run" / "checkpoint")  # what a finished run holds
    theirs = GenerationConfig.from_pretrained(tmp_path / "run" / "checkpoint")
    assert (theirs.do_sample, theirs.temperature, theirs.top_p) == (True, 0.3, 0.7)
    assert lucidlm.load(tmp_path / "run").generation_defaults == {"temperature": theirs.temperature,
                                                                  "top_p": theirs.top_p}


# ------------------------------------------------------------ bos and pad without a tokenizer

@pytest.mark.parametrize("through_lucidlm_format", [False, True])
def test_bos_and_pad_ids_survive_an_export_without_a_tokenizer(tmp_path, through_lucidlm_format):
    tiny_llama(0, bos_token_id=1, eos_token_id=2, pad_token_id=0).save_pretrained(tmp_path / "src")
    model = lucidlm.load(tmp_path / "src")
    if through_lucidlm_format:
        save_model(model, tmp_path / "mine")
        model = lucidlm.load(tmp_path / "mine")
    save_hf(model, tmp_path / "out")

    source = AutoModelForCausalLM.from_pretrained(tmp_path / "src", dtype=torch.float32).eval()
    export = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        assert getattr(export.config, key) == getattr(source.config, key), key
        assert getattr(export.generation_config, key) == getattr(source.generation_config, key), key
    with torch.no_grad():  # no prompt: transformers starts from the BOS the files declare
        assert export.generate(max_new_tokens=4, do_sample=False).tolist() == \
            source.generate(max_new_tokens=4, do_sample=False).tolist()
