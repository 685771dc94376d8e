"""GPT-2 <-> Hugging Face: Conv1D weights (transposed) and the fused c_attn (split into q, k, v)
map onto our Linear layers; tiny random GPT2LMHeadModel models give the same logits as ours."""

from __future__ import annotations

import argparse
import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch.testing import assert_close
from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel

import lucidlm
from lucidlm.commands import convert
from lucidlm.config import preset
from lucidlm.model.transformer import Transformer
from lucidlm.weights.checkpoint import save_model
from lucidlm.weights.hf import load_hf, save_hf
from random_weights import randomize_

VOCAB = 101



def hf_gpt2(tie: bool = True, seed: int = 0, **overrides) -> GPT2LMHeadModel:
    config = GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=64, tie_word_embeddings=tie,
                        bos_token_id=0, eos_token_id=0, **overrides)
    torch.manual_seed(seed)
    return randomize_(GPT2LMHeadModel(config), seed)


def padded_batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (2, 20), generator=g)
    mask = torch.ones(2, 20, dtype=torch.long)
    mask[1, :5] = 0
    ids[1, :5] = 0
    return ids, mask


def hf_logits(model, ids, mask) -> torch.Tensor:
    with torch.no_grad():  # HF's forward takes positions as given, not from the mask
        return model(ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits


def assert_same_real_logits(ours: torch.Tensor, theirs: torch.Tensor, mask: torch.Tensor) -> None:
    real = mask.bool()
    assert theirs.std() > 0.3
    assert_close(ours[real], theirs[real])


@pytest.mark.parametrize("tie", [True, False])
def test_load_matches_hf_with_left_padding(tmp_path, tie):
    hf = hf_gpt2(tie)
    hf.save_pretrained(tmp_path)
    ours = lucidlm.load(tmp_path)
    cfg = ours.config
    assert (cfg.positions, cfg.norm, cfg.mlp, cfg.tie_embeddings) == ("learned", "layer", "gelu_tanh", tie)
    ids, mask = padded_batch()
    want = hf_logits(hf, ids, mask)
    with torch.no_grad():
        assert_same_real_logits(ours(ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)),
                                want, mask)
        assert_same_real_logits(ours(ids, attention_mask=mask), want, mask)


def test_original_checkpoint_names_without_prefix(tmp_path):
    """OpenAI's converted GPT-2 files say ``h.0.attn.c_attn.weight`` (no ``transformer.``) and
    carry ``attn.bias`` mask buffers; both spellings load."""
    hf = hf_gpt2(seed=1, activation_function="gelu", n_inner=96)
    hf.save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    renamed = {k.removeprefix("transformer."): v for k, v in tensors.items()}
    renamed["h.0.attn.bias"] = torch.tril(torch.ones(1, 1, 64, 64))
    save_file(renamed, tmp_path / "model.safetensors", metadata={"format": "pt"})
    ours = load_hf(tmp_path)
    assert ours.config.mlp == "gelu" and ours.config.d_mlp == 96
    ids, mask = padded_batch(seed=1)
    with torch.no_grad():
        assert_same_real_logits(ours(ids, attention_mask=mask), hf_logits(hf, ids, mask), mask)


def test_hf_to_ours_to_hf(tmp_path):
    hf = hf_gpt2(seed=2)
    hf.save_pretrained(tmp_path / "hf")
    save_hf(load_hf(tmp_path / "hf"), tmp_path / "back")
    config = json.loads((tmp_path / "back" / "config.json").read_text())
    assert config["architectures"] == ["GPT2LMHeadModel"] and config["activation_function"] == "gelu_new"
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()
    ids, mask = padded_batch(seed=2)
    assert_same_real_logits(hf_logits(back, ids, mask), hf_logits(hf, ids, mask), mask)


def run_convert(source, out_dir, to: str) -> int:
    parser = argparse.ArgumentParser()
    convert.register(parser.add_subparsers())
    args = parser.parse_args(["convert", str(source), str(out_dir), "--to", to])
    return args.handler(args)


@pytest.mark.parametrize("preset_name", ["gpt2", "shakespeare-char"])
def test_ours_to_hf_via_convert(tmp_path, preset_name):
    """gpt2: biases + GELU(tanh). shakespeare-char: no biases (written as exact zeros, GPT-2
    always has them) and exact GELU."""
    config = preset(preset_name, vocab_size=VOCAB, d_model=64, n_layers=2, n_heads=4, max_seq_len=64)
    torch.manual_seed(3)
    ours = randomize_(Transformer(config), seed=3)
    save_model(ours, tmp_path / "ours")
    assert run_convert(tmp_path / "ours", tmp_path / "hf", "hf") == 0
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert type(hf).__name__ == "GPT2LMHeadModel"
    ids, mask = padded_batch(seed=3)
    with torch.no_grad():
        assert_same_real_logits(ours(ids, attention_mask=mask), hf_logits(hf, ids, mask), mask)
