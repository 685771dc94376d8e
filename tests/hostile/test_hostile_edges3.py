"""Hostile and careless inputs, third round (hunt 3, "robust"): a diverged training run, outputs
written over their own input, saves over an earlier model, a panicking tokenizer file, a full
disk under safetensors, huge step counts and ``~`` in output paths.

Each case checks the files with the reference libraries (safetensors, transformers, tokenizers,
os.path), not with lucidlm's own readers."""

from __future__ import annotations

import errno
import json
import math
import os
import types
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import lucidlm
from lucidlm.config import preset
from lucidlm.errors import TokenizerError
from lucidlm.model.transformer import Transformer
from lucidlm.weights.checkpoint import save_model
from lucidlm.weights.hf import save_hf

from harness import api_refused, main_refused, refused, snapshot  # tests/hostile is on sys.path

TINY = dict(vocab_size=64, d_model=32, n_layers=1, n_heads=4, n_kv_heads=2, d_mlp=64, max_seq_len=32)
TINY_TRAIN = ["--tokenizer", "char", "--n-layer", "1", "--n-head", "2", "--n-embd", "16", "--block-size", "16",
              "--batch-size", "2", "--eval-iters", "1", "--sample-tokens", "0", "--no-progress"]

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py: tiny runs on one torch thread


# -- a diverged run keeps its last good checkpoint -----------------------------------------------

def test_diverged_run_stops_and_keeps_the_last_finite_checkpoint(corpus, tmp_path):
    run = tmp_path / "run"
    line = refused("train", "--data", str(corpus), "--out", str(run), *TINY_TRAIN, "--max-iters", "3",
                   "--eval-interval", "3", "--constant-lr", "--learning-rate", "1000", "--grad-clip", "0",
                   names=[r"diverged at step 3", r"\bnan\b", r"checkpoint of step 0", "--learning-rate"])
    assert "n/a" not in line
    # Read with safetensors itself: the step-0 checkpoint survived, every weight finite.
    weights = load_file(str(run / "checkpoint" / "model.safetensors"))
    assert weights and all(bool(t.isfinite().all()) for t in weights.values())
    assert json.loads((run / "checkpoint" / "trainer_state.json").read_text())["step"] == 0
    # Its files are readable as open() makes files (0666 less the umask), not safetensors' private 0600.
    umask = os.umask(0)
    os.umask(umask)
    for name in ("model.safetensors", "optimizer.safetensors", "trainer_state.json"):
        assert (run / "checkpoint" / name).stat().st_mode & 0o777 == 0o666 & ~umask, name


def _bare_trainer() -> "lucidlm.training.loop.Trainer":
    from lucidlm.training.loop import Trainer

    model = torch.nn.Linear(2, 2)
    config = types.SimpleNamespace(gradient_accumulation_steps=1)
    return Trainer(model, object(), torch.optim.SGD(model.parameters(), lr=0.1), config)


def test_nan_loss_over_no_token_is_not_divergence_but_over_tokens_it_is():
    from lucidlm.training.divergence import TrainingDiverged

    trainer = _bare_trainer()
    trainer.eval_tokens = {"train": 4, "val": 0}  # val batches counted no token: NaN is a mean over nothing
    trainer.check_diverged({"train": 1.5, "val": math.nan})
    trainer.eval_tokens = {"train": 4, "val": 3}
    with pytest.raises(TrainingDiverged, match=r"the val loss is nan; no checkpoint was written"):
        trainer.check_diverged({"train": 1.5, "val": math.nan})
    trainer.train_losses = [2.0, math.inf]
    with pytest.raises(TrainingDiverged, match=r"training loss became inf at step 1"):
        trainer.check_diverged({})


def test_nan_weights_are_divergence_even_with_finite_losses():
    from lucidlm.training.divergence import TrainingDiverged

    trainer = _bare_trainer()
    trainer.check_diverged({})
    with torch.no_grad():
        trainer.model.weight[0, 1] = float("nan")
    with pytest.raises(TrainingDiverged, match="weights hold NaN"):
        trainer.check_diverged({})


def test_console_says_which_nan_it_is():
    from lucidlm.training.callbacks import Console

    lines = []
    console = Console(progress=False)
    console.print = lines.append
    trainer = types.SimpleNamespace(seconds_left=lambda: None, step=3, config=types.SimpleNamespace(max_iters=3),
                                    eval_tokens={"val": 0})
    record = {"step": 3, "train_loss": 1.0, "val_loss": math.nan, "val_ppl": math.nan, "tokens_per_s": None}
    console.on_evaluate(trainer, record)
    trainer.eval_tokens = {"val": 12}
    console.on_evaluate(trainer, record)
    assert "n/a (no token with a loss" in lines[0]
    assert "val loss nan (diverged)" in lines[1] and "n/a" not in lines[1]


# -- merge / convert never write over the model they read --------------------------------------

@pytest.fixture(scope="module")
def hf_base_and_lora(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    root = tmp_path_factory.mktemp("merge")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.save_pretrained(root / "base")
    lora = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=["q_proj", "v_proj"],
                                                      init_lora_weights=False))
    lora.save_pretrained(root / "lora")
    (root / "link").symlink_to(root / "base")
    return root


@pytest.mark.parametrize("out, names", [("base", ["--out", "is the --model"]),
                                        ("link", ["--out", "is the --model"]),  # the same directory, by a link
                                        ("lora", ["--out", "is the --adapter"])])
def test_merge_refuses_to_write_over_its_base_or_adapter(hf_base_and_lora, out, names):
    root = hf_base_and_lora
    refused("merge", "--model", str(root / "base"), "--adapter", str(root / "lora"), "--out", str(root / out),
            "--to", "hf", "--force", names=names, watch=[root / "base", root / "lora"])


@pytest.fixture
def training_run(tmp_path) -> Path:
    """What `lucidlm train --out RUN` leaves: the model in RUN/checkpoint."""
    torch.manual_seed(0)
    save_model(Transformer(preset("gpt2", **{k: v for k, v in TINY.items() if k not in ("n_kv_heads", "d_mlp")})),
               tmp_path / "run" / "checkpoint")
    (tmp_path / "run" / "metrics.jsonl").write_text("")
    return tmp_path / "run"


@pytest.mark.parametrize("out", ["checkpoint", ".", "../run/./checkpoint"])
def test_convert_refuses_the_directory_its_source_is_read_from(training_run, out):
    refused("convert", str(training_run), str(training_run / out), "--to", "hf", "--force",
            names=["OUT_DIR", "is the SOURCE", r"read from .*run/checkpoint\)"], watch=[training_run])


@pytest.mark.parametrize("out", ["hf", "checkpoint/hf"])
def test_convert_beside_or_below_the_checkpoint_still_works(training_run, out):
    from lucidlm import cli

    before = snapshot([training_run / "checkpoint"])
    assert cli.main(["convert", str(training_run), str(training_run / out), "--to", "hf"]) == 0
    assert (training_run / out / "config.json").is_file()
    assert {k: v for k, v in snapshot([training_run / "checkpoint"]).items() if "/hf/" not in k} == before


# -- a save over an earlier model leaves none of its files -----------------------------------------

def test_save_model_over_a_model_with_a_tokenizer_leaves_no_stale_tokenizer(tmp_path):
    from lucidlm.tokenizers import CharTokenizer

    torch.manual_seed(0)
    first = Transformer(preset("llama", **TINY))
    first.tokenizer = CharTokenizer(list("abcdefghijklmnopqrstuvwxyz .,!?"))
    save_model(first, tmp_path / "m")
    assert (tmp_path / "m" / "tokenizer.json").is_file()
    second = Transformer(preset("llama", **TINY))  # no tokenizer
    save_model(second, tmp_path / "m")
    assert not (tmp_path / "m" / "tokenizer.json").exists()
    assert lucidlm.load(tmp_path / "m").tokenizer is None


def test_save_hf_over_a_lucidlm_save_reads_as_the_hf_model(tmp_path):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    save_model(lucidlm.load("llama", random_init=True, **TINY), tmp_path / "m")
    torch.manual_seed(1)
    model = Transformer(preset("llama", **TINY))
    save_hf(model, tmp_path / "m")
    left = {p.name for p in (tmp_path / "m").iterdir()}
    assert not left & {"lucidlm_config.json", "checksums.json", "tokenizer.json"}, left
    ids = torch.tensor([[1, 5, 9, 2]])
    reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "m").eval()
    with torch.no_grad():
        expected = reference(ids).logits
        got = lucidlm.load(tmp_path / "m")(ids)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


# -- a tokenizer file that panics the Rust backend --------------------------------------------------

def _panicking_tokenizer_json() -> str:
    from tokenizers import Tokenizer, models, pre_tokenizers

    backend = Tokenizer(models.WordLevel({"a": 0, "b": 1, "<unk>": 2}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    spec = json.loads(backend.to_str())
    spec["normalizer"] = {"type": "Precompiled", "precompiled_charsmap": "!!!"}  # damaged base64
    text = json.dumps(spec)
    with pytest.raises(BaseException) as info:  # the reference: tokenizers itself panics on it
        Tokenizer.from_str(text)
    assert type(info.value).__name__ == "PanicException" and not isinstance(info.value, Exception)
    return text


def test_a_tokenizer_json_that_panics_the_backend_is_one_tokenizer_error(tmp_path):
    from lucidlm.tokenizers.pretrained import HFTokenizer

    path = tmp_path / "tokenizer.json"
    path.write_text(_panicking_tokenizer_json())
    api_refused(lambda: HFTokenizer.from_file(path), TokenizerError, names=[r"tokenizer\.json", "not a Hugging Face",
                                                                       "Precompiled"])


def test_an_embedded_tokenizer_that_panics_the_backend_is_one_tokenizer_error():
    from lucidlm.tokenizers.pretrained import HFTokenizer

    api_refused(lambda: HFTokenizer._from_dict({"tokenizer_json": _panicking_tokenizer_json()}), TokenizerError,
                names=["embedded tokenizer_json", "Precompiled"])


# -- a full disk under safetensors ------------------------------------------------------------------

def test_safetensors_io_error_is_the_os_error_it_stands_for(tmp_path, monkeypatch):
    from safetensors import SafetensorError

    from lucidlm.weights import checkpoint

    torch.manual_seed(0)
    save_model(Transformer(preset("llama", **TINY)), tmp_path / "src")

    def full_disk(*args, **kwargs):  # what safetensors raises when the disk fills (checked on a 64 KiB tmpfs)
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(checkpoint, "save_file", full_disk)
    with pytest.raises(OSError) as info:
        checkpoint.atomic_save_safetensors({"w": torch.zeros(2)}, tmp_path / "x" / "model.safetensors")
    assert info.value.errno == errno.ENOSPC and info.value.filename == str(tmp_path / "x" / "model.safetensors")
    assert not [p for p in (tmp_path / "x").iterdir()]  # no staging file left
    main_refused("convert", str(tmp_path / "src"), str(tmp_path / "out"), "--to", "lucidlm",
                 names=[r"No space left on device while writing .*out", "OUT_DIR"], watch=[tmp_path / "src"])


# -- step counts a run can compute with -------------------------------------------------------------

@pytest.mark.parametrize("flag", ["--gradient-accumulation-steps", "--max-iters", "--eval-iters", "--eval-interval",
                                  "--log-interval", "--sample-tokens", "--warmup-iters"])
def test_huge_step_counts_are_refused_before_anything_is_written(corpus, tmp_path, flag):
    name = flag[2:].replace("-", "_")
    main_refused("train", "--data", str(corpus), "--out", str(tmp_path / "run"), *TINY_TRAIN, flag, str(10 ** 30),
                 names=[name, r"\[\d, 2147483647\]"])
    assert not (tmp_path / "run").exists()


def test_finetune_step_counts_are_bounded_too(tmp_path):
    from lucidlm.training import FinetuneConfig

    api_refused(lambda: FinetuneConfig(data="x.jsonl", out_dir=str(tmp_path), max_iters=10 ** 30),
                names=["max_iters", "2147483647"])


# -- ~ in output paths --------------------------------------------------------------------------------

def test_tilde_in_out_dir_is_the_home_directory(tmp_path, monkeypatch):
    from lucidlm.training import FinetuneConfig, TrainConfig

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    expected = os.path.expanduser("~/run")  # the reference: what a shell makes of ~/run
    assert expected == str(tmp_path / "home" / "run")
    assert TrainConfig(data="x.txt", out_dir="~/run").out_dir == expected
    assert FinetuneConfig(data="x.jsonl", out_dir="~/run").out_dir == expected
    assert TrainConfig(data="x.txt", out_dir=Path("~/run")).out_dir == expected


def test_inspect_plots_tilde_is_the_home_directory(tmp_path, monkeypatch):
    from lucidlm import cli

    home, cwd = tmp_path / "home", tmp_path / "cwd"
    home.mkdir()
    cwd.mkdir()
    from lucidlm.tokenizers import CharTokenizer

    torch.manual_seed(0)
    tokenizer = CharTokenizer(list("abcdefghijklmnopqrstuvwxyz"))
    model = Transformer(preset("llama", **{**TINY, "vocab_size": tokenizer.vocab_size}))
    model.tokenizer = tokenizer
    save_model(model, tmp_path / "m")
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(cwd)
    assert cli.main(["inspect", "hi", "--model", str(tmp_path / "m"), "--out", "~/r.html", "--plots", "~/figs"]) == 0
    assert any(Path(os.path.expanduser("~/figs")).iterdir())
    assert not (cwd / "~").exists()


# -- messages ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype, what", [(torch.int32, "not a floating-point type"), (torch.bool, "not a floating"),
                                         (torch.int8, "a quantized format")])
def test_a_non_float_weight_is_named_for_what_it_is(tmp_path, dtype, what):
    from safetensors.torch import save_file

    from lucidlm.errors import WeightsError

    torch.manual_seed(0)
    save_hf(Transformer(preset("llama", **TINY)), tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    name = "model.layers.0.mlp.up_proj.weight"
    tensors[name] = (tensors[name] * 100).round().to(dtype)
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    api_refused(lambda: lucidlm.load(tmp_path), WeightsError, names=[name.replace(".", r"\."), what])
