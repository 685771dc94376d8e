"""`lucidlm finetune` and `lucidlm merge` end to end on a tiny character-level model."""

from __future__ import annotations

import argparse
import json

import pytest
import torch
from random_weights import small_llama

from lucidlm import load
from lucidlm.commands import finetune, merge
from lucidlm.errors import AdapterError, CheckpointError
from lucidlm.peft import LoRALinear
from lucidlm.tokenizers import CharTokenizer
from lucidlm.weights.checkpoint import save_model


def run_command(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="lucidlm")
    sub = parser.add_subparsers(dest="command", required=True)
    finetune.register(sub)
    merge.register(sub)
    args = parser.parse_args(argv)
    return args.handler(args)


@pytest.fixture(scope="module")
def tiny_setup(tmp_path_factory, shared_dir):
    root = tmp_path_factory.mktemp("ft")
    text = (shared_dir / "data" / "tinyshakespeare.txt").read_text()[:60_000]
    (root / "corpus.txt").write_text(text)
    tokenizer = CharTokenizer.train(text)
    model = small_llama(tokenizer, n_layers=2, max_seq_len=64)
    save_model(model, root / "base")
    return root


def finetune_args(root, out, *extra):
    return ["finetune", "--model", str(root / "base"), "--data", str(root / "corpus.txt"), "--out", str(out),
            "--max-iters", "30", "--eval-interval", "15", "--eval-iters", "4", "--batch-size", "8",
            "--block-size", "32", "--sample-tokens", "12", "--no-progress", "--learning-rate", "1e-2",
            "--warmup-iters", "2", *extra]


def test_finetune_lora_then_merge(tiny_setup, tmp_path, capsys):
    out = tmp_path / "lora"
    assert run_command(finetune_args(tiny_setup, out, "--targets", "q,v,down", "--rank", "4", "--alpha", "8",
                                     "--dropout", "0")) == 0
    printed = capsys.readouterr().out
    assert "trainable params:" in printed and "base model (adapter off):" in printed and "sample:" in printed
    config = json.loads((out / "adapter_config.json").read_text())
    assert (config["peft_type"], config["r"], config["lora_alpha"]) == ("LORA", 4, 8)
    assert config["target_modules"] == ["down_proj", "q_proj", "v_proj"]
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [0, 15, 30]
    assert metrics[-1]["val_loss"] < metrics[0]["val_loss"] - 0.1  # step 0 is the base model
    assert (out / "loss.png").stat().st_size > 0

    tuned = load(tiny_setup / "base", adapter=out)
    assert any(isinstance(m, LoRALinear) for m in tuned.modules())
    merged_dir = tmp_path / "merged"
    assert run_command(["merge", "--model", str(tiny_setup / "base"), "--adapter", str(out),
                        "--out", str(merged_dir)]) == 0
    merged = load(merged_dir)
    assert not any(isinstance(m, LoRALinear) for m in merged.modules())
    ids = torch.tensor([tuned.tokenizer.encode("ROMEO:\nWhat light")])
    with torch.no_grad():
        assert (merged(ids) - tuned(ids)).abs().max() <= 1e-5
        assert (merged(ids) - load(tiny_setup / "base")(ids)).abs().max() > 1e-3


def test_finetune_prefix_and_merge_refuses_it(tiny_setup, tmp_path):
    out = tmp_path / "prefix"
    assert run_command(finetune_args(tiny_setup, out, "--method", "prefix", "--prefix-length", "4",
                                     "--prefix-hidden", "16")) == 0
    meta = json.loads((out / "lucidlm_adapter.json").read_text())
    assert meta["method"] == "prefix" and meta["frozen"] is True
    model = load(tiny_setup / "base", adapter=out)
    assert model.prefix_encoder.kv.shape[-2] == 4
    with pytest.raises(AdapterError, match="cannot be merged"):
        run_command(["merge", "--model", str(tiny_setup / "base"), "--adapter", str(out), "--out", str(tmp_path / "m")])
    with pytest.raises(CheckpointError, match="already holds a training checkpoint"):
        run_command(finetune_args(tiny_setup, out))


def test_finetune_bad_target_is_one_clear_error(tiny_setup, tmp_path):
    with pytest.raises(AdapterError, match="'qq' matches no linear layer"):
        run_command(finetune_args(tiny_setup, tmp_path / "x", "--targets", "qq"))


def test_merge_of_a_model_whose_tokenizer_cannot_spell_the_check_text(tmp_path):
    """A character model trained on text without 'T' (any corpus but Shakespeare's): merge
    stopped on the sentence it runs through model + adapter and merged model to compare them."""
    from safetensors.torch import load_file

    from lucidlm.peft import add_lora, save_adapter

    tokenizer = CharTokenizer.train("hello world, all of it lower case\n")
    model = small_llama(tokenizer, n_layers=1, max_seq_len=64)
    save_model(model, tmp_path / "base")
    add_lora(model, r=4, alpha=8, targets=("q_proj",))
    with torch.no_grad():  # B starts at zero: a nonzero update to merge
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    save_adapter(model, tmp_path / "lora")
    assert run_command(["merge", "--model", str(tmp_path / "base"), "--adapter", str(tmp_path / "lora"),
                        "--out", str(tmp_path / "merged")]) == 0
    # PEFT's merge: W + (alpha / r) B @ A, from the files alone
    adapter = load_file(tmp_path / "lora" / "adapter_model.safetensors")
    prefix = "base_model.model.model.layers.0.self_attn.q_proj"
    A, B = adapter[f"{prefix}.lora_A.weight"], adapter[f"{prefix}.lora_B.weight"]
    W = load_file(tmp_path / "base" / "model.safetensors")["blocks.0.attn.q_proj.weight"]
    merged = load_file(tmp_path / "merged" / "model.safetensors")["blocks.0.attn.q_proj.weight"]
    torch.testing.assert_close(merged, W + (8 / 4) * B @ A)
