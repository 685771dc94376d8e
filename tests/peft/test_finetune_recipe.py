"""The fine-tuning recipe as a Python API: JSONL examples (prompt masking, padding,
truncation, chat template), the token-length report, exact resume, sampling settings,
and clear errors for bad input."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from random_weights import small_llama
from safetensors.torch import load_file

from lucidlm import load
from lucidlm.errors import CheckpointError, DataError
from lucidlm.generation import generate
from lucidlm.tokenizers import CharTokenizer
from lucidlm.training.config import FinetuneConfig
from lucidlm.training.examples import load_examples
from lucidlm.training.finetune import finetune
from lucidlm.training.loss import IGNORE_INDEX
from lucidlm.weights.checkpoint import save_model

ALPHABET = "abcdefghijklmnopqrstuvwxyz ?.:\n"


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py: tiny runs on one torch thread


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    root = tmp_path_factory.mktemp("base")
    tokenizer = CharTokenizer.train(ALPHABET)
    model = small_llama(tokenizer, n_layers=2, max_seq_len=48)
    save_model(model, root / "model")
    rng = np.random.default_rng(0)
    lines = []
    for i in range(40):
        a, b = rng.integers(0, 9, size=2)
        lines.append({"prompt": f"what is {'x' * a}?", "completion": f" {'y' * b}."})
    (root / "qa.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    return root


def config(base, out, **overrides) -> FinetuneConfig:
    settings = dict(model=str(base / "model"), data=str(base / "qa.jsonl"), out_dir=str(out), method="lora",
                    rank=4, alpha=8.0, lora_dropout=0.1, targets="q,v", batch_size=4, learning_rate=1e-2,
                    warmup_iters=2, max_iters=8, lr_decay_iters=8, eval_interval=4, eval_iters=2, sample_tokens=6, progress=False,
                    mask_prompt=True, max_length=24, log_interval=3)
    return FinetuneConfig(**{**settings, **overrides})


def test_prompt_completion_examples_are_padded_and_masked(base):
    tokenizer = CharTokenizer.train(ALPHABET)
    examples = load_examples(base / "qa.jsonl", tokenizer, 24, 48, mask_prompt=True)
    record = json.loads((base / "qa.jsonl").read_text().splitlines()[3])
    prompt = [ALPHABET.index(c) for c in record["prompt"]]  # the char ids, by hand
    completion = [ALPHABET.index(c) for c in record["completion"]]
    full = tokenizer.encode(record["prompt"]) + tokenizer.encode(record["completion"]) + [tokenizer.eos_id]
    assert [tokenizer.decode([i]) for i in full[:-1]] == list(record["prompt"] + record["completion"])
    assert len(full) == len(prompt) + len(completion) + 1
    assert examples.lengths[3] == len(full) and examples.prompt_lengths[3] == len(prompt)
    ids, targets = examples.ids[3], examples.targets[3]
    assert ids.shape == (24,) and ids[: len(full)].tolist() == full
    counted = [(t, int(targets[t])) for t in range(24) if targets[t] != IGNORE_INDEX]
    # Exactly the completion and the end token are predicted, each from the position before it.
    assert counted == [(t - 1, full[t]) for t in range(len(prompt), len(full))]
    unmasked = load_examples(base / "qa.jsonl", tokenizer, 24, 48, mask_prompt=False)
    assert (unmasked.targets[3] != IGNORE_INDEX).sum() == len(full) - 1


def test_bad_jsonl_lines_name_file_line_and_field(base, tmp_path):
    tokenizer = CharTokenizer.train(ALPHABET)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a", "completion": "b"}\n[1, 2]\n')
    with pytest.raises(DataError, match=r"bad\.jsonl:2: expected a JSON object"):
        load_examples(bad, tokenizer, 8, 48)
    bad.write_text('{"prompt": "a", "completion": "b"}\n\n{"prompt": "a"}\n')
    with pytest.raises(DataError, match=r"bad\.jsonl:3: field \"completion\" is missing"):
        load_examples(bad, tokenizer, 8, 48)
    bad.write_text('{"text": "ab"}\n{"text": "abcdefghijklmnop"}\n')
    with pytest.raises(DataError, match=r"bad\.jsonl:2: the example has 17 tokens, more than the length of 8"):
        load_examples(bad, tokenizer, 8, 48, truncate=False)
    cut = load_examples(bad, tokenizer, 8, 48)  # truncation on: cut to 8 tokens
    assert cut.ids.shape == (2, 8) and cut.ids[1].tolist() == tokenizer.encode("abcdefgh")


def test_chat_messages_use_the_template_and_mask_all_but_the_answer(smollm2, tmp_path):
    path = tmp_path / "chat.jsonl"
    messages = [{"role": "user", "content": "Capital of France?"}, {"role": "assistant", "content": "Paris."}]
    path.write_text(json.dumps({"messages": messages}) + "\n")
    tok = smollm2.tokenizer
    examples = load_examples(path, tok, None, 2048, mask_prompt=True)
    assert examples.format == "messages"
    ids, targets = examples.ids[0], examples.targets[0]
    text = tok.decode(ids[: examples.lengths[0]].tolist())
    assert text.endswith("<|im_start|>user\nCapital of France?<|im_end|>\n<|im_start|>assistant\nParis.<|im_end|>\n")
    learned = [int(t) for t in targets if t != IGNORE_INDEX]
    assert tok.decode(learned) == "Paris.<|im_end|>\n"


def test_lora_finetune_resumes_bit_identically_and_reports_lengths(base, tmp_path):
    full = finetune(config(base, tmp_path / "full"))
    first = finetune(config(base, tmp_path / "split", max_iters=5))
    assert first.train_losses == full.train_losses[:5]
    resumed = finetune(config(base, tmp_path / "split", resume=True))
    assert resumed.step == 8 and resumed.train_losses == full.train_losses  # exact, with LoRA dropout
    a = load_file(str(tmp_path / "full" / "checkpoint" / "trainable.safetensors"))
    b = load_file(str(tmp_path / "split" / "checkpoint" / "trainable.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert full.metrics[-1]["val_loss"] < full.metrics[0]["val_loss"]
    # The adapter files load onto the base model.
    tuned = load(str(base / "model"), adapter=str(tmp_path / "full"))
    # Per layer: q 32 -> 32 and v 32 -> 16 (2 KV heads of 8); A is r x in, B is out x r.
    assert sum(p.numel() for n, p in tuned.named_parameters() if "lora_" in n) == 2 * ((4 * 32 + 32 * 4) +
                                                                                      (4 * 32 + 16 * 4))
    # The token-length report matches numpy on the lengths counted independently.
    lines = [json.loads(x) for x in (base / "qa.jsonl").read_text().splitlines()]
    lengths = np.array([len(x["prompt"]) + len(x["completion"]) + 1 for x in lines])
    stats = json.loads((tmp_path / "full" / "token_lengths.json").read_text())
    assert stats["count"] == 40 and stats["mean"] == pytest.approx(lengths.mean())
    assert stats["p90"] == pytest.approx(np.percentile(lengths, 90)) and stats["max"] == lengths.max()
    assert (tmp_path / "full" / "token_lengths.png").read_bytes()[:4] == b"\x89PNG"


def test_samples_use_the_settings_and_show_the_base_model(base, tmp_path):
    settings = dict(sample_temperature=0.9, sample_top_p=0.8, sample_seed=5, sample_prompt="what is xx?")
    result = finetune(config(base, tmp_path / "run", max_iters=4, **settings))
    reference = load(str(base / "model"))
    ids = reference.tokenizer.encode("what is xx?")
    expected = generate(reference, ids, max_new_tokens=6, temperature=0.9, top_p=0.8, seed=5)
    assert result.metrics[0]["base_sample"] == reference.tokenizer.decode(ids + list(expected.token_ids))
    assert all(m["base_sample"] == result.metrics[0]["base_sample"] for m in result.metrics)


def test_resume_with_other_settings_is_refused_and_keeps_the_checkpoint(base, tmp_path):
    finetune(config(base, tmp_path, max_iters=4))
    before = {p.name: p.read_bytes() for p in (tmp_path / "checkpoint").iterdir()}
    with pytest.raises(CheckpointError, match=r"rank: 4 -> 8"):
        finetune(config(base, tmp_path, max_iters=6, rank=8, resume=True))
    assert {p.name: p.read_bytes() for p in (tmp_path / "checkpoint").iterdir()} == before


def test_epochs_set_the_number_of_steps(base, tmp_path):
    # 40 examples, 10% validate -> 36 train; batch 4 -> 9 steps per epoch; 2 epochs -> 18 steps.
    result = finetune(config(base, tmp_path, epochs=2, lr_decay_iters=None, eval_interval=100, sample_tokens=0))
    assert result.step == 18 and len(result.train_losses) == 18


def test_ctrl_c_names_the_command_that_continues_the_run(base, tmp_path, monkeypatch, capsys, ctrl_c_after_step):
    """The interrupt message's command, run as printed, resumes the run and finishes it."""
    import argparse
    import shlex

    from lucidlm.commands import finetune as finetune_command

    ctrl_c_after_step(3)
    stopped = finetune(config(base, tmp_path / "run dir"))
    assert stopped.interrupted and stopped.step == 3
    lines = capsys.readouterr().out.splitlines()
    told = lines.index(next(line for line in lines if line.startswith("interrupted: saved a checkpoint at step 3")))
    command = shlex.split(lines[told + 1])
    assert command[:2] == ["lucidlm", "finetune"] and command.count("--resume") == 1
    monkeypatch.undo()

    parser = argparse.ArgumentParser()
    finetune_command.register(parser.add_subparsers())
    args = parser.parse_args(command[1:])
    assert args.handler(args) == 0
    printed = capsys.readouterr().out
    assert ", resuming at step 3" in printed and "done in" in printed and "step 8," in printed


def test_ctrl_c_summary_says_stopped_and_whose_val_loss_it_shows(base, tmp_path, capsys, ctrl_c_after_step):
    """Ctrl-C skips the last evaluation, so the CLI's summary may not say "done" with an older
    evaluation's loss as the stopped step's: it names the step metrics.jsonl's record is from."""
    import argparse

    from lucidlm.commands import finetune as finetune_command

    parser = argparse.ArgumentParser()
    finetune_command.register(parser.add_subparsers())
    args = parser.parse_args(["finetune", "--model", str(base / "model"), "--data", str(base / "qa.jsonl"),
                              "--out", str(tmp_path), "--rank", "4", "--batch-size", "4", "--max-iters", "8",
                              "--eval-interval", "100", "--eval-iters", "2", "--sample-tokens", "0",
                              "--max-length", "24", "--no-progress"])
    ctrl_c_after_step(3)
    assert args.handler(args) == 130
    summary = next(line for line in capsys.readouterr().out.splitlines() if " in " in line and "val loss" in line)
    record = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])
    assert record["step"] == 0
    assert summary.startswith("stopped in ") and ": step 3, " in summary
    assert f"val loss {record['val_loss']:.4f} (evaluated at step 0)" in summary
