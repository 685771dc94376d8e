"""A resume with a damaged or foreign state file: one line naming the file and what is wrong,
and nothing under the run directory changed (issue 13, points 3 and 4).

Each case copies a finished 4-step run, damages one file, and resumes it to step 6."""

from __future__ import annotations

import json
import shlex
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from lucidlm.errors import CheckpointError, DataError
from lucidlm.training import TrainConfig, train
from lucidlm.training.config import command_line

from harness import api_refused, refused

SHAKESPEARE = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "tinyshakespeare.txt"


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py: tiny runs on one torch thread


def tiny(corpus: Path, out: Path, **overrides) -> TrainConfig:
    settings = dict(data=str(corpus), out_dir=str(out), n_layer=1, n_head=2, n_embd=16, block_size=16, batch_size=4,
                    max_iters=4, lr_decay_iters=8, warmup_iters=1, eval_interval=2, eval_iters=1, sample_tokens=0,
                    progress=False, seed=1)
    return TrainConfig(**{**settings, **overrides})


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Finished runs to damage (copies) or to take foreign files from."""
    root = tmp_path_factory.mktemp("runs")
    corpus = root / "corpus.txt"
    corpus.write_text(SHAKESPEARE.read_text()[:4000])
    made = {"corpus": corpus}
    for name, overrides in {"run": {}, "seed2": {"seed": 2}, "wide": {"n_embd": 32}, "step2": {"max_iters": 2}}.items():
        train(tiny(corpus, root / name, **overrides))
        made[name] = root / name
    return made


@pytest.fixture
def run(runs, tmp_path) -> Path:
    """A private copy of the 4-step run, corpus beside it."""
    shutil.copytree(runs["run"], tmp_path / "run")
    shutil.copy(runs["corpus"], tmp_path / "corpus.txt")
    edit_state(tmp_path / "run", lambda state: {**state, "train_config": {**state["train_config"],
                                                                          "data": str(tmp_path / "corpus.txt")}})
    return tmp_path / "run"


def resume(run: Path, **overrides):
    return lambda: train(tiny(run.parent / "corpus.txt", run, max_iters=6, resume=True, **overrides))


def state_path(run: Path) -> Path:
    return run / "checkpoint" / "trainer_state.json"


def edit_state(run: Path, change) -> None:
    state = json.loads(state_path(run).read_text())
    state = change(state)
    state_path(run).write_text(json.dumps(state))


def truncate(path: Path, keep: float = 0.5) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


# ----------------------------------------------------------------------------- trainer_state.json

def _set(key, value):
    def change(state):
        state[key] = value
        return state
    return change


def _drop(key):
    def change(state):
        del state[key]
        return state
    return change


STATE_CASES = {
    "a list": (lambda state: [state], [r"trainer_state\.json", "JSON object"]),
    "no sampler state": (_drop("data"), [r"trainer_state\.json", "'data'", "missing"]),
    "step is text": (_set("step", "ten"), [r"trainer_state\.json", "'step'", "ten"]),
    "negative step": (_set("step", -3), [r"trainer_state\.json", "'step'", "-3"]),
    "losses are text": (_set("train_losses", ["a", "b"]), [r"trainer_state\.json", "train_losses"]),
    "rng not base64": (_set("torch_rng", ["!!not base64!!"]), [r"trainer_state\.json", r"torch_rng\[0\]"]),
    "rng too short": (_set("torch_rng", ["AAAA"]), [r"trainer_state\.json", r"torch_rng\[0\]", "5056"]),
    "rng not a list": (_set("torch_rng", 7), [r"trainer_state\.json", "torch_rng"]),
    "sampler rng garbage": (_set("data", "AAAA"), [r"trainer_state\.json", "'data'"]),
    "example sampler state": (_set("data", {"epoch": "one", "position": 0}), [r"trainer_state\.json", r"data\.epoch"]),
    "run id not text": (_set("run", {"id": 5}), [r"trainer_state\.json", r"run\.id"]),
}


@pytest.mark.parametrize("case", sorted(STATE_CASES))
def test_damaged_trainer_state_is_refused_naming_the_field(run, case):
    change, names = STATE_CASES[case]
    edit_state(run, change)
    api_refused(resume(run), CheckpointError, names=names, watch=[run])


def test_rng_state_of_the_right_size_but_not_an_mt19937_state_is_refused(run):
    import base64

    garbage = base64.b64encode(bytes(range(256)) * 19 + bytes(5056 - 256 * 19)).decode()
    edit_state(run, _set("torch_rng", [garbage]))
    api_refused(resume(run), CheckpointError, names=[r"trainer_state\.json", r"torch_rng\[0\]", "mt19937"],
                watch=[run])


def test_truncated_state_and_model_config_are_refused(run):
    truncate(state_path(run))
    api_refused(resume(run), CheckpointError, names=[r"trainer_state\.json", "not valid JSON"], watch=[run])


def test_truncated_model_config_is_refused(run):
    truncate(run / "checkpoint" / "lucidlm_config.json")
    api_refused(resume(run), CheckpointError, names=[r"lucidlm_config\.json", "not valid JSON"], watch=[run])


def test_truncated_weights_are_refused(run):
    truncate(run / "checkpoint" / "model.safetensors", 0.3)
    api_refused(resume(run), CheckpointError, names=[r"model\.safetensors", "cannot be read", "restore"],
                watch=[run])


# ----------------------------------------------------------------------------- optimizer.safetensors

def test_truncated_optimizer_file_is_refused(run):
    truncate(run / "checkpoint" / "optimizer.safetensors", 0.7)
    api_refused(resume(run), CheckpointError, names=[r"optimizer\.safetensors", "damaged"], watch=[run])


def test_optimizer_file_missing_a_tensor_is_refused(run):
    path = run / "checkpoint" / "optimizer.safetensors"
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        metadata = f.metadata()
    tensors = load_file(str(path))
    del tensors["state.2.exp_avg_sq"]
    save_file(tensors, str(path), metadata=metadata)
    api_refused(resume(run), CheckpointError, names=[r"optimizer\.safetensors", r"state\.2\.exp_avg_sq"],
                watch=[run])


def test_optimizer_from_another_seed_is_refused(runs, run):
    shutil.copy(runs["seed2"] / "checkpoint" / "optimizer.safetensors", run / "checkpoint")
    api_refused(resume(run), CheckpointError, names=[r"optimizer\.safetensors", "another run"], watch=[run])


def test_optimizer_from_another_step_of_the_same_run_is_refused(runs, run):
    shutil.copy(runs["step2"] / "checkpoint" / "optimizer.safetensors", run / "checkpoint")
    api_refused(resume(run), CheckpointError, names=[r"optimizer\.safetensors", "step 2", "step 4"], watch=[run])


def test_optimizer_from_a_run_of_another_width_is_refused_by_the_cli(runs, run):
    shutil.copy(runs["wide"] / "checkpoint" / "optimizer.safetensors", run / "checkpoint")
    refused(*cli_args(run), names=[r"optimizer\.safetensors", "shape", r"\(.*32.*\)"], watch=[run])


# ----------------------------------------------------------------------------- data

def test_truncated_data_meta_is_refused(run):
    truncate(run / "data" / "meta.json")
    api_refused(resume(run), DataError, names=[r"meta\.json", "not valid JSON", "delete"], watch=[run])


def test_data_meta_with_a_bad_count_is_refused(run):
    meta = json.loads((run / "data" / "meta.json").read_text())
    meta["n_train"] = "many"
    (run / "data" / "meta.json").write_text(json.dumps(meta))
    api_refused(resume(run), DataError, names=[r"meta\.json", "n_train", "many"], watch=[run])


def test_truncated_token_file_is_refused_by_the_cli(run):
    truncate(run / "data" / "train.bin")
    meta = json.loads((run / "data" / "meta.json").read_text())
    refused(*cli_args(run), names=[r"train\.bin", str(meta["n_train"]), "truncated"], watch=[run])


def test_corpus_with_the_same_characters_but_other_text_is_refused_by_the_cli(run):
    corpus = run.parent / "corpus.txt"
    text = corpus.read_text()
    corpus.write_text(text[len(text) // 2:] + text[: len(text) // 2])  # same characters, same size
    refused(*cli_args(run), names=["corpus", r"corpus\.txt", "corpus_sha256"], watch=[run, corpus])


def test_replaced_tokenizer_is_refused(run):
    path = run / "data" / "tokenizer.json"
    saved = json.loads(path.read_text())
    saved["chars"][-2:] = saved["chars"][-2:][::-1]  # same size, two ids swapped: the data no longer means the same
    path.write_text(json.dumps(saved))
    api_refused(resume(run), CheckpointError, names=["tokenizer", r"tokenizer\.json", "tokenizer_sha256"],
                watch=[run])


def test_other_recipe_settings_are_refused_by_the_cli_before_any_write(run):
    refused(*cli_args(run, learning_rate=5e-3), names=["learning_rate", "different settings", r"trainer_state\.json"],
            watch=[run])


def cli_args(run: Path, **overrides) -> list[str]:
    config = tiny(run.parent / "corpus.txt", run, max_iters=6, resume=True, **overrides)
    return shlex.split(command_line(config, "train"))[1:]


def test_a_checkpoint_from_before_run_records_still_resumes_exactly(runs, run):
    """Checkpoints written before the run's identity was recorded have no "run" in their state and
    no run id or step beside the optimizer: they resume (their shapes are still checked)."""
    from safetensors import safe_open

    edit_state(run, _drop("run"))
    path = run / "checkpoint" / "optimizer.safetensors"
    with safe_open(str(path), "pt") as f:
        metadata = {"param_groups": f.metadata()["param_groups"]}
    save_file(load_file(str(path)), str(path), metadata=metadata)
    resumed = resume(run)()
    longer = train(tiny(runs["corpus"], run.parent / "uninterrupted", max_iters=6))
    assert resumed.step == 6 and resumed.train_losses == longer.train_losses


# ----------------------------------------------------------------------------- metrics.jsonl

@pytest.mark.parametrize("tail", [b'{"step": 6, "train_lo', b"\x00" * 300])
def test_torn_metrics_line_is_dropped_and_the_resume_goes_on(run, tail, capsys):
    metrics = run / "metrics.jsonl"
    whole = metrics.read_bytes()
    metrics.write_bytes(whole + tail)
    result = resume(run)()
    assert result.step == 6
    lines = metrics.read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [0, 2, 4, 6]
    assert lines[:3] == whole.decode().splitlines()  # the whole lines are kept as they were
    assert "dropped 1 torn line" in capsys.readouterr().out


def test_a_new_run_after_a_killed_first_checkpoint_writes_step_0_once(runs, tmp_path):
    out = tmp_path / "fresh"
    out.mkdir()
    # What a kill while the first checkpoint was written leaves: the step-0 line, no checkpoint.
    first = (runs["run"] / "metrics.jsonl").read_text().splitlines()[0]
    (out / "metrics.jsonl").write_text(first + "\n")
    train(tiny(runs["corpus"], out, max_iters=2))
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [0, 2]


# ----------------------------------------------------------------------------- fine-tuning

ALPHABET = "abcdefghijklmnopqrstuvwxyz ?.:\n"


def test_finetune_resume_on_changed_examples_is_refused_before_any_write(tmp_path):
    from lucidlm.config import preset
    from lucidlm.model.transformer import Transformer
    from lucidlm.tokenizers import CharTokenizer
    from lucidlm.training.config import FinetuneConfig
    from lucidlm.training.finetune import finetune
    from lucidlm.weights.checkpoint import save_model

    tokenizer = CharTokenizer.train(ALPHABET)
    torch.manual_seed(0)
    save_model(Transformer(preset("llama", vocab_size=tokenizer.vocab_size, d_model=16, n_layers=1, n_heads=2,
                                  n_kv_heads=1, d_mlp=32, max_seq_len=32), tokenizer=tokenizer), tmp_path / "model")
    examples = tmp_path / "qa.jsonl"
    lines = [json.dumps({"prompt": f"what is {'x' * (i % 5)}?", "completion": f" {'y' * (i % 7)}."}) for i in range(24)]
    examples.write_text("\n".join(lines) + "\n")

    def config(**overrides):
        settings = dict(model=str(tmp_path / "model"), data=str(examples), out_dir=str(tmp_path / "run"), rank=2,
                        targets="q,v", batch_size=4, max_iters=2, lr_decay_iters=4, eval_interval=2, eval_iters=1,
                        sample_tokens=0, progress=False)
        return FinetuneConfig(**{**settings, **overrides})

    finetune(config())
    examples.write_text("\n".join(reversed(lines)) + "\n")  # the same examples in another order
    api_refused(lambda: finetune(config(max_iters=4, resume=True)), CheckpointError,
                names=[r"qa\.jsonl", "corpus_sha256"], watch=[tmp_path / "run"])


def test_finetune_resume_on_other_base_weights_is_refused_before_any_write(tmp_path):
    """A LoRA run saves only its adapter, so the base it was trained on is recorded by hash."""
    from lucidlm.config import preset
    from lucidlm.model.transformer import Transformer
    from lucidlm.tokenizers import CharTokenizer
    from lucidlm.training.config import FinetuneConfig
    from lucidlm.training.finetune import finetune
    from lucidlm.weights.checkpoint import save_model

    tokenizer = CharTokenizer.train(ALPHABET)
    torch.manual_seed(0)
    base = Transformer(preset("llama", vocab_size=tokenizer.vocab_size, d_model=16, n_layers=1, n_heads=2,
                              n_kv_heads=1, d_mlp=32, max_seq_len=32), tokenizer=tokenizer)
    save_model(base, tmp_path / "model")
    corpus = tmp_path / "text.txt"
    corpus.write_text("what is this? it is a test.\n" * 40)

    def config(**overrides):
        settings = dict(model=str(tmp_path / "model"), data=str(corpus), out_dir=str(tmp_path / "run"), rank=2,
                        targets="q,v", batch_size=2, block_size=16, max_iters=2, lr_decay_iters=4, eval_interval=2,
                        eval_iters=1, sample_tokens=0, progress=False)
        return FinetuneConfig(**{**settings, **overrides})

    finetune(config())
    finetune(config(max_iters=3, resume=True))  # the same base resumes (no false alarm)
    with torch.no_grad():
        base.blocks[0].mlp.down_proj.weight[0, 0] += 1e-3  # one weight of a frozen matrix, same shapes
    save_model(base, tmp_path / "model")
    api_refused(lambda: finetune(config(max_iters=4, resume=True)), CheckpointError,
                names=["base model's weights", "base_sha256"], watch=[tmp_path / "run"])

