"""LLaMA <-> Hugging Face: tiny random LlamaForCausalLM models (no download) give the same
logits as ours after loading, and what we export loads back into transformers unchanged."""

from __future__ import annotations

import argparse
import json

import pytest
import torch
from torch.testing import assert_close
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

import lucidlm
from lucidlm.commands import convert
from lucidlm.config import preset
from lucidlm.model.transformer import Transformer
from lucidlm.weights.checkpoint import save_model
from lucidlm.weights.hf import is_hf_dir, load_hf, save_hf
from random_weights import randomize_

VOCAB = 101



def hf_llama(tie: bool, seed: int = 0, **overrides) -> LlamaForCausalLM:
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=128, max_position_embeddings=128,
                         rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=tie, **overrides)
    torch.manual_seed(seed)
    return randomize_(LlamaForCausalLM(config), seed)


def padded_batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Two sequences of 24 tokens; the second is left-padded by 7 (pad id 0)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (2, 24), generator=g)
    mask = torch.ones(2, 24, dtype=torch.long)
    mask[1, :7] = 0
    ids[1, :7] = 0
    return ids, mask


def hf_logits(model, ids, mask=None) -> torch.Tensor:
    # HF's forward does not derive positions from the mask: pass them as generate() does.
    kwargs = {}
    if mask is not None:
        kwargs = dict(attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0))
    with torch.no_grad():
        return model(ids, **kwargs).logits


def assert_same_real_logits(ours: torch.Tensor, theirs: torch.Tensor, mask: torch.Tensor) -> None:
    real = mask.bool()
    assert theirs.std() > 0.3  # the comparison means something
    assert_close(ours[real], theirs[real])


@pytest.mark.parametrize("tie", [True, False])
def test_load_matches_hf_with_left_padding(tmp_path, tie):
    hf = hf_llama(tie)
    hf.save_pretrained(tmp_path)
    assert is_hf_dir(tmp_path)
    ours = lucidlm.load(tmp_path)
    assert ours.config.tie_embeddings == tie and ours.config.n_kv_heads == 2 and ours.config.rope_variant == "half"
    ids, mask = padded_batch()
    want = hf_logits(hf, ids, mask)
    with torch.no_grad():
        explicit = ours(ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0))
        derived = ours(ids, attention_mask=mask)  # our default: positions counted from the first real token
        unpadded = ours(ids[:1])
    assert_same_real_logits(explicit, want, mask)
    assert_same_real_logits(derived, want, mask)
    assert_close(unpadded, hf_logits(hf, ids[:1]))


def test_load_with_attention_and_mlp_bias(tmp_path):
    hf = hf_llama(tie=False, attention_bias=True, mlp_bias=True, seed=1)
    hf.save_pretrained(tmp_path)
    ours = load_hf(tmp_path)
    assert ours.config.attn_bias and ours.config.mlp_bias
    ids, mask = padded_batch(seed=1)
    with torch.no_grad():
        assert_same_real_logits(ours(ids, attention_mask=mask), hf_logits(hf, ids, mask), mask)


def test_sharded_checkpoint(tmp_path):
    hf = hf_llama(tie=False, seed=2)
    hf.save_pretrained(tmp_path, max_shard_size="40KB")
    shards = sorted(p.name for p in tmp_path.glob("model-*.safetensors"))
    assert len(shards) > 1 and (tmp_path / "model.safetensors.index.json").is_file()
    ours = load_hf(tmp_path)
    ids, mask = padded_batch(seed=2)
    with torch.no_grad():
        assert_same_real_logits(ours(ids, attention_mask=mask), hf_logits(hf, ids, mask), mask)


@pytest.mark.parametrize("tie", [True, False])
def test_hf_to_ours_to_hf(tmp_path, tie):
    hf = hf_llama(tie, seed=3)
    hf.save_pretrained(tmp_path / "hf")
    save_hf(load_hf(tmp_path / "hf"), tmp_path / "back")
    config = json.loads((tmp_path / "back" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["tie_word_embeddings"] == tie
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()
    assert type(back).__name__ == "LlamaForCausalLM"
    ids, mask = padded_batch(seed=3)
    assert_same_real_logits(hf_logits(back, ids, mask), hf_logits(hf, ids, mask), mask)


def run_convert(source, out_dir, to: str) -> int:
    parser = argparse.ArgumentParser()
    convert.register(parser.add_subparsers())
    args = parser.parse_args(["convert", str(source), str(out_dir), "--to", to])
    return args.handler(args)


@pytest.mark.parametrize("rope_variant", ["half", "interleaved"])
def test_ours_to_hf_via_convert(tmp_path, capsys, rope_variant):
    """A lucidlm-format LLaMA (GQA, tied, either RoPE layout) -> `lucidlm convert --to hf` ->
    transformers. Interleaved weights must be permuted back to rotate_half on the way."""
    config = preset("llama", vocab_size=VOCAB, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, multiple_of=32,
                    max_seq_len=128, tie_embeddings=True, rope_variant=rope_variant)
    torch.manual_seed(4)
    ours = randomize_(Transformer(config), seed=4)
    save_model(ours, tmp_path / "ours")
    assert run_convert(tmp_path / "ours", tmp_path / "hf", "hf") == 0
    assert "LlamaForCausalLM" in capsys.readouterr().out
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    ids, mask = padded_batch(seed=4)
    with torch.no_grad():
        assert_same_real_logits(ours(ids, attention_mask=mask), hf_logits(hf, ids, mask), mask)


def test_hf_to_lucidlm_via_convert(tmp_path):
    hf = hf_llama(tie=True, seed=5)
    hf.save_pretrained(tmp_path / "hf")
    assert run_convert(tmp_path / "hf", tmp_path / "ours", "lucidlm") == 0
    assert (tmp_path / "ours" / "lucidlm_config.json").is_file()
    ours = lucidlm.load(tmp_path / "ours")
    ids, mask = padded_batch(seed=5)
    with torch.no_grad():
        assert_same_real_logits(ours(ids, attention_mask=mask), hf_logits(hf, ids, mask), mask)


def word_level_tokenizer_json(path) -> None:
    """A tiny Hugging Face tokenizer.json built locally (no download): 100 words + specials."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i + 3 for i in range(VOCAB - 3)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.add_special_tokens(["<unk>", "<s>", "</s>"])
    backend.save(str(path))


def test_tokenizer_travels_both_ways(tmp_path):
    """tokenizer.json beside the weights is attached on load and written again on export,
    with the bos/eos roles from tokenizer_config.json."""
    from transformers import AutoTokenizer

    hf_llama(tie=True, seed=6).save_pretrained(tmp_path / "hf")
    word_level_tokenizer_json(tmp_path / "hf" / "tokenizer.json")
    (tmp_path / "hf" / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>",
                                                                      "add_bos_token": True}))
    text = "w5 w17 w3 </s> w96"
    want = [1] + AutoTokenizer.from_pretrained(tmp_path / "hf")(text, add_special_tokens=False)["input_ids"]
    assert want == [1, 8, 20, 6, 2, 99]
    ours = load_hf(tmp_path / "hf")
    assert ours.tokenizer is not None and ours.tokenizer.encode(text) == want
    assert (ours.tokenizer.bos_id, ours.tokenizer.eos_id) == (1, 2)
    save_hf(ours, tmp_path / "back")
    back = AutoTokenizer.from_pretrained(tmp_path / "back")
    assert back(text, add_special_tokens=False)["input_ids"] == want[1:]
    assert (back.bos_token, back.eos_token) == ("<s>", "</s>")
    assert load_hf(tmp_path / "back").tokenizer.encode(text) == want
