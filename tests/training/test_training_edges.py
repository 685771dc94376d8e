"""Edges of the training settings: samples longer than the context, schedule fields left None
or 0, resized presets, a passed-in base model's name, and the messages of splits and
settings that cannot work."""

import importlib.util
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from lucidlm.config import PRESETS, preset
from lucidlm.errors import ConfigError, DataError
from lucidlm.model.transformer import Transformer
from lucidlm.tokenizers import CharTokenizer
from lucidlm.training import FinetuneConfig, TrainConfig, train
from lucidlm.training.callbacks import Sampler
from lucidlm.training.data import prepare_data
from lucidlm.training.finetune import finetune
from lucidlm.training.pretrain import model_config_for
from lucidlm.training.schedule import get_lr, schedule_warning

SHARED = Path(__file__).resolve().parents[2].parent / "shared"
SHAKESPEARE = SHARED / "data" / "tinyshakespeare.txt"
NANOGPT = SHARED / "peers" / "nanoGPT" / "model.py"


def corpus(tmp_path: Path, chars: int) -> Path:
    if not SHAKESPEARE.is_file():
        pytest.skip("tinyshakespeare.txt is not in shared/data")
    path = tmp_path / "corpus.txt"
    path.write_text(SHAKESPEARE.read_text()[:chars])
    return path


# ----------------------------------------------------------------------------- --sample-tokens

def test_a_sample_has_all_its_tokens_past_the_context(tmp_path):
    block, tokens, prompt = 16, 40, "ROMEO:"
    result = train(TrainConfig(data=str(corpus(tmp_path, 20000)), out_dir=str(tmp_path / "run"), n_layer=1, n_head=2,
                               n_embd=32, block_size=block, batch_size=4, max_iters=1, eval_interval=100, eval_iters=1,
                               sample_tokens=tokens, sample_prompt=prompt, progress=False))
    sample = result.metrics[-1]["sample"]
    assert sample.startswith(prompt)
    assert len(sample) == len(prompt) + tokens  # char tokenizer: one token a character; was 10 (block - prompt)


def test_the_sample_slides_its_window_as_nanogpt_generate_does():
    """Against nanoGPT's own ``GPT.generate`` (top_k=1: greedy) with the same weights: it crops
    the context to the last block_size tokens and keeps going."""
    if not NANOGPT.is_file():
        pytest.skip("the nanoGPT peer is not in shared/peers")
    spec = importlib.util.spec_from_file_location("nanogpt_model", NANOGPT)
    nanogpt = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(nanogpt)
    tokenizer = CharTokenizer.train("abcdefghijklmnopqrstuvwxyz :\n")
    vocab, width, layers, block = tokenizer.vocab_size, 32, 2, 12
    torch.manual_seed(3)
    nano = nanogpt.GPT(nanogpt.GPTConfig(block_size=block, vocab_size=vocab, n_layer=layers, n_head=2, n_embd=width,
                                         dropout=0.0, bias=False)).eval()
    model = Transformer(preset("shakespeare-char", vocab_size=vocab, d_model=width, n_layers=layers, n_heads=2,
                               max_seq_len=block), tokenizer=tokenizer)
    theirs = nano.state_dict()
    with torch.no_grad():
        ours = dict(model.named_parameters())
        ours["embed.weight"].copy_(theirs["transformer.wte.weight"])
        ours["pos_embed.weight"].copy_(theirs["transformer.wpe.weight"])
        ours["ln_final.weight"].copy_(theirs["transformer.ln_f.weight"])
        for i in range(layers):
            h, b = f"transformer.h.{i}.", f"blocks.{i}."
            q, k, v = theirs[h + "attn.c_attn.weight"].split(width, 0)
            for name, weight in (("attn.q_proj", q), ("attn.k_proj", k), ("attn.v_proj", v),
                                 ("attn.o_proj", theirs[h + "attn.c_proj.weight"]),
                                 ("mlp.up_proj", theirs[h + "mlp.c_fc.weight"]),
                                 ("mlp.down_proj", theirs[h + "mlp.c_proj.weight"])):
                ours[b + name + ".weight"].copy_(weight)
            ours[b + "ln1.weight"].copy_(theirs[h + "ln_1.weight"])
            ours[b + "ln2.weight"].copy_(theirs[h + "ln_2.weight"])
    prompt = tokenizer.encode("to be or")
    new = 30  # 8 + 30 tokens: well past the 12-token context
    with torch.no_grad():
        expected = nano.generate(torch.tensor([prompt]), new, top_k=1)[0].tolist()
    assert len(expected) == len(prompt) + new
    assert Sampler(prompt, new, tokenizer).sample(model) == tokenizer.decode(expected)


# ----------------------------------------------------------------------------- the schedule fields

@pytest.mark.parametrize("field, flag", [("lr_decay_iters", "--lr-decay-iters"), ("min_lr", "--min-lr")])
def test_pretraining_refuses_a_schedule_field_of_none_before_any_work(tmp_path, field, flag):
    with pytest.raises(ConfigError, match=f"{field} \\({flag}\\)=None"):
        TrainConfig(data=str(tmp_path / "c.txt"), out_dir=str(tmp_path / "run"), **{field: None})
    assert not (tmp_path / "run").exists()


def test_finetuning_fills_in_none_and_keeps_an_explicit_zero_decay():
    defaults = FinetuneConfig(data="d.jsonl", out_dir="o", max_iters=10, learning_rate=1e-3).resolved()
    assert (defaults.lr_decay_iters, defaults.min_lr) == (10, pytest.approx(1e-4))
    zero = FinetuneConfig(data="d.jsonl", out_dir="o", max_iters=10, warmup_iters=0, lr_decay_iters=0,
                          learning_rate=1e-3, min_lr=1e-5).resolved()
    assert zero.lr_decay_iters == 0  # was replaced by the run length (10)
    rates = [get_lr(s, zero.learning_rate, zero.warmup_iters, zero.lr_decay_iters, zero.min_lr) for s in range(4)]
    # nanoGPT's get_lr past lr_decay_iters: min_lr; step 0 (decay ratio 0) is the peak
    assert rates == [1e-3, 1e-5, 1e-5, 1e-5]


@pytest.mark.parametrize("recipe, extra", [(TrainConfig, {}), (FinetuneConfig, {"method": "lora"})])
def test_a_min_lr_above_the_peak_is_refused(recipe, extra):
    with pytest.raises(ConfigError, match=r"--min-lr.*above.*--learning-rate"):
        recipe(data="c.txt", out_dir="o", min_lr=5e-3, **extra)  # lora's default peak is 1e-3
    assert recipe(data="c.txt", out_dir="o", min_lr=5e-3, decay_lr=False, **extra)  # unused with --constant-lr


def test_a_warmup_longer_than_the_decay_is_warned_about():
    config = TrainConfig(data="c.txt", out_dir="o", warmup_iters=50, lr_decay_iters=20, max_iters=100)
    warning = schedule_warning(config)
    assert warning is not None and "--warmup-iters 50" in warning and "--lr-decay-iters 20" in warning
    # what it describes (nanoGPT's formula): the step after the warm-up is already at min_lr
    assert get_lr(50, 1e-3, 50, 20, 1e-4) == 1e-4
    assert schedule_warning(TrainConfig(data="c.txt", out_dir="o", warmup_iters=20, lr_decay_iters=100,
                                        max_iters=100)) is None


def test_vocab_size_with_the_char_tokenizer_is_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"--vocab-size.*--tokenizer char"):
        TrainConfig(data="c.txt", out_dir=str(tmp_path / "run"), tokenizer="char", vocab_size=100)
    assert TrainConfig(data="c.txt", out_dir="o", tokenizer="bpe", vocab_size=300).vocab_size == 300


# ----------------------------------------------------------------------------- resizing a preset

@pytest.mark.parametrize("name, ratio", [("seed004-words", 2), ("seed000", 4), ("shakespeare-char", 4)])
@pytest.mark.parametrize("width", [32, 512])
def test_a_resized_preset_keeps_its_mlp_ratio(name, ratio, width):
    # seed004-words is documented as "GELU MLP widened 2x" (128 -> 256); seed000 is 4x (512 -> 2048)
    base = PRESETS[name]
    assert (base.get("d_mlp") or 4 * base["d_model"]) == ratio * base["d_model"]
    config = model_config_for(TrainConfig(data="c.txt", out_dir="o", preset=name, n_embd=width, n_head=4), 50)
    assert config.d_mlp == ratio * width


def test_a_resized_llama_preset_rounds_its_mlp_as_llama_does():
    # Meta's llama/model.py: hidden = int(2 * 4 * dim / 3), rounded up to a multiple of multiple_of (256)
    def llama_hidden(dim, multiple_of=256):
        hidden = int(2 * 4 * dim / 3)
        return multiple_of * ((hidden + multiple_of - 1) // multiple_of)

    assert llama_hidden(576) == PRESETS["smollm2-135m"]["d_mlp"]  # SmolLM2's own intermediate_size, 1536
    config = model_config_for(TrainConfig(data="c.txt", out_dir="o", preset="smollm2-135m", n_embd=384, n_head=6), 50)
    assert config.d_mlp == llama_hidden(384) == 1024


def test_n_head_on_a_grouped_query_preset_keeps_its_heads_per_key_value_head(tmp_path):
    config = model_config_for(TrainConfig(data="c.txt", out_dir="o", preset="smollm2-135m", n_head=6), 50)
    assert (config.n_heads, config.n_kv_heads) == (6, 2)  # SmolLM2: 9 query heads over 3 key/value heads
    refused = TrainConfig(data=str(corpus(tmp_path, 5000)), out_dir=str(tmp_path / "run"), preset="smollm2-135m",
                          n_head=4, progress=False)
    with pytest.raises(ConfigError, match=r"--n-head.* 4 .*multiple of 3"):
        train(refused)
    assert not (tmp_path / "run").exists()  # refused before the data was prepared


# ----------------------------------------------------------------------------- a passed-in base model

def test_an_adapter_of_a_passed_in_model_does_not_name_the_default_model(tmp_path):
    from peft import LoraConfig

    tokenizer = CharTokenizer.train("abcdefghijklmnopqrstuvwxyz ?.:\n")
    torch.manual_seed(0)
    base = Transformer(preset("llama", vocab_size=tokenizer.vocab_size, d_model=32, n_layers=1, n_heads=4,
                              n_kv_heads=2, d_mlp=64, max_seq_len=48), tokenizer=tokenizer)
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"prompt": "q?", "completion": " ab" * (1 + i % 3)}) + "\n" for i in range(8)))
    finetune(FinetuneConfig(data=str(data), out_dir=str(tmp_path / "out"), method="lora", batch_size=2, max_iters=1,
                            warmup_iters=0, eval_interval=10, eval_iters=1, sample_tokens=0, progress=False),
             model=base)
    # PEFT reads the file; its base is unknown (None, PEFT's own default), not "smollm2-135m"
    assert LoraConfig.from_pretrained(str(tmp_path / "out")).base_model_name_or_path is None


# ----------------------------------------------------------------------------- the interleaved split

def test_an_interleaved_split_too_short_names_its_chunk_rule_and_the_fixes(tmp_path):
    path = corpus(tmp_path, 9000)
    tail = prepare_data(path, tmp_path / "tail", "char", split="tail")
    assert (len(tail.train), len(tail.val)) == (8100, 900)  # nanoGPT: int(n * 0.9)
    with pytest.raises(DataError) as refused:
        prepare_data(path, tmp_path / "inter", "char", split="interleaved")
    message = str(refused.value)
    # every 10th chunk of 1024 tokens validates: chunk 9 (tokens 9216..) first, and val needs 2 tokens
    needed = 9 * 1024 + 2
    for part in ("interleaved", "1024", str(needed), "--split tail", "--val-fraction"):
        assert part in message


def test_the_interleaved_minimum_is_exact(tmp_path):
    text = SHAKESPEARE.read_text() if SHAKESPEARE.is_file() else pytest.skip("no tinyshakespeare.txt")
    needed = 9 * 1024 + 2
    (tmp_path / "short.txt").write_text(text[: needed - 1])
    with pytest.raises(DataError, match=str(needed)):
        prepare_data(tmp_path / "short.txt", tmp_path / "a", "char", split="interleaved")
    (tmp_path / "enough.txt").write_text(text[:needed])
    data = prepare_data(tmp_path / "enough.txt", tmp_path / "b", "char", split="interleaved")
    # NumPy's view of the rule: chunk c validates when floor((c+1) f) > floor(c f)
    chunk = np.arange(needed) // 1024
    assert len(data.val) == int((np.floor((chunk + 1) * 0.1) > np.floor(chunk * 0.1)).sum()) == 2
    assert math.isclose(len(data.train) + len(data.val), needed)
