"""Command-line edges: options that do not apply, the chat REPL at the context's edge, saving
over another format, stdout on a full disk, group sizes, and what help and titles say.

A tiny byte-level llama (context 256 tokens) keeps it fast; transformers is the oracle wherever
a Hugging Face directory is written.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from cli_run import cli_env
from test_chat_repl import run, spawn_chat  # the REPL harness, in a real pseudo-terminal

import lucidlm
from lucidlm.cli import main
from lucidlm.errors import ConfigError, QuantizationError

EOT = "<|endoftext|>"


def toy_model():
    from lucidlm import LanguageModel, preset
    from lucidlm.tokenizers import BPETokenizer

    tokenizer = BPETokenizer([], {EOT: 256}, eos_token=EOT)
    torch.manual_seed(0)
    return LanguageModel(preset("llama", n_layers=1, d_model=32, n_heads=2, n_kv_heads=1, vocab_size=257,
                                max_seq_len=256, multiple_of=32), tokenizer)


@pytest.fixture(scope="module")
def toy_dir(tmp_path_factory):
    from lucidlm.weights.checkpoint import save_model

    path = tmp_path_factory.mktemp("toy_edges")
    save_model(toy_model(), path)
    return path


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("edges_data")
    (root / "small.txt").write_text("the quick brown fox jumps over the lazy dog. " * 40, encoding="utf-8")
    lines = [{"prompt": f"what is {'x' * i}?", "completion": f" {'y' * i}."} for i in range(1, 9)]
    (root / "qa.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines), encoding="utf-8")
    return root


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err and "internal error" not in err, err
    return err


# ------------------------------------------------------------------ finetune: options that do not apply

@pytest.mark.parametrize("data, flags, flag, why", [
    ("small.txt", ["--epochs", "0.01"], "--epochs", "JSONL examples"),
    ("small.txt", ["--mask-prompt"], "--mask-prompt", "JSONL examples"),
    ("small.txt", ["--max-length", "16"], "--max-length", "JSONL examples"),
    ("small.txt", ["--no-truncate"], "--no-truncate", "JSONL examples"),
    ("qa.jsonl", ["--block-size", "16"], "--block-size", "a text corpus"),
    ("qa.jsonl", ["--block-size", "128"], "--block-size", "a text corpus"),  # typed, though it is the default
    ("small.txt", ["--method", "prefix", "--rank", "4"], "--rank", "--method lora, not --method prefix"),
    ("small.txt", ["--method", "prefix", "--alpha", "4"], "--alpha", "--method lora, not --method prefix"),
    ("small.txt", ["--method", "adapter", "--targets", "q,v"], "--targets", "--method lora, not --method adapter"),
    ("small.txt", ["--method", "full", "--init", "gaussian"], "--init", "--method lora, not --method full"),
    ("small.txt", ["--method", "lora", "--bottleneck", "8"], "--bottleneck", "--method adapter, not --method lora"),
    ("small.txt", ["--prefix-length", "4"], "--prefix-length", "--method prefix, not --method lora"),
])
def test_finetune_refuses_a_flag_the_run_would_ignore(toy_dir, corpus, tmp_path, capsys, data, flags, flag, why):
    out = tmp_path / "run"
    code = main(["finetune", "--model", str(toy_dir), "--data", str(corpus / data), "--out", str(out), *flags])
    assert code == 1
    err = one_error_line(capsys)
    assert err.startswith("lucidlm finetune: error: ") and f"({flag})" in err and why in err
    assert f"drop {flag}" in err
    assert not out.exists()  # refused before anything was written


def test_finetune_runs_with_the_flags_that_apply(toy_dir, corpus, tmp_path, capsys):
    """Flags of the chosen method and data kind are kept (and the untyped others stay quiet):
    --rank 2 with LoRA, --block-size 16 with a corpus."""
    out = tmp_path / "run"
    assert main(["finetune", "--model", str(toy_dir), "--data", str(corpus / "small.txt"), "--out", str(out),
                 "--rank", "2", "--block-size", "16", "--max-iters", "1", "--batch-size", "2", "--warmup-iters", "0",
                 "--eval-interval", "5", "--eval-iters", "1", "--sample-tokens", "0", "--no-progress"]) == 0
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["r"] == 2  # PEFT's own field name for the rank
    state = json.loads((out / "checkpoint" / "trainer_state.json").read_text())
    assert state["train_config"]["block_size"] == 16 and state["train_config"]["rank"] == 2
    capsys.readouterr()


def test_finetune_config_refuses_the_other_data_kinds_options_in_python():
    from lucidlm.training.config import FinetuneConfig, command_line

    with pytest.raises(ConfigError, match=r"epochs \(--epochs\) applies only to JSONL examples.*a text corpus"):
        FinetuneConfig(data="corpus.txt", out_dir="o", epochs=2.0)
    with pytest.raises(ConfigError, match=r"block_size \(--block-size\) applies only to a text corpus"):
        FinetuneConfig(data="train.jsonl", out_dir="o", block_size=64)
    with pytest.raises(ConfigError, match=r"mask_prompt \(--mask-prompt\)"):
        FinetuneConfig(data="corpus/", out_dir="o", mask_prompt=True)
    # Another method's settings may ride along in Python (one settings dict for a sweep of
    # methods): the run ignores them, and the command that resumes it leaves them out.
    sweep = FinetuneConfig(data="corpus.txt", out_dir="o", method="prefix", rank=4, bottleneck=8, prefix_length=4)
    words = command_line(sweep, "finetune", resume=True).split()
    assert "--prefix-length" in words and "--rank" not in words and "--bottleneck" not in words
    saved = {**sweep.to_dict(), "rank": 16}
    assert sweep.differences(saved) == []  # rank does not shape a prefix run
    lora = FinetuneConfig(data="corpus.txt", out_dir="o", method="lora", rank=4)
    assert lora.differences({**lora.to_dict(), "rank": 16}) == ["rank: 16 -> 4"]  # it shapes a LoRA run


def test_config_flags_left_out_take_the_recipe_defaults():
    """Flags default to nothing (so the typed ones are known); the config built from a command
    line that names only the required flags is the recipe's default config."""
    from lucidlm.cli import build_parser
    from lucidlm.commands.config_flags import config_from_args, typed_fields
    from lucidlm.training.config import FinetuneConfig, TrainConfig

    for command, config_class in (("train", TrainConfig), ("finetune", FinetuneConfig)):
        args = build_parser([command]).parse_args([command, "--data", "c.txt", "--out", "o"])
        assert config_from_args(config_class, args) == config_class(data="c.txt", out_dir="o")
        assert sorted(typed_fields(config_class, args)) == ["data", "out_dir"]


# ------------------------------------------------------------------ help texts

def test_switch_help_says_what_the_switch_does(capsys):
    for command in ("train", "finetune"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        lines = {line.split()[0]: " ".join(line.split()) for line in capsys.readouterr().out.splitlines()
                 if line.strip().startswith("--no-")}
        assert "no progress bar" in lines["--no-progress"]
        assert "instead of the fused kernel" in lines["--no-fused-adamw"]
        assert "use the fused AdamW kernel" not in lines["--no-fused-adamw"]


def test_required_flags_promise_no_default(capsys):
    """--out and --data must be given (the usage line shows them unbracketed), so their help
    names no default: "(default: out)" told the user a flag left out would write to ./out."""
    for command in ("train", "finetune"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        text = capsys.readouterr().out
        for flag in ("--out", "--data"):
            own = text.split(f"\n  {flag} STR", 1)[1].split("\n  -", 1)[0]
            assert "default" not in own, (command, flag, own)


def test_int4_group_sizes_agree_in_the_code_the_help_and_the_readme(capsys):
    from lucidlm.quantization import Int4Linear

    sizes = ", ".join(map(str, Int4Linear.group_sizes[:-1])) + f" or {Int4Linear.group_sizes[-1]}"
    assert sizes == "32, 64, 128 or 256"
    for command in ("generate", "chat", "convert"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        text = " ".join(capsys.readouterr().out.split())
        assert f"(int4: {sizes}, default 32;" in text, command
    readme = " ".join((Path(__file__).resolve().parents[2] / "README.md").read_text(encoding="utf-8").split())
    assert "asymmetric groups of 32 (default), 64, 128 or 256" in readme
    assert "64 or 128," not in readme and "(64/128: group_size=)" not in readme


# ------------------------------------------------------------------ group_size and the flags that name it

@pytest.mark.parametrize("bad", [True, 32.0, 0, -32, "32"])
def test_group_size_is_a_positive_whole_number(toy_dir, bad):
    with pytest.raises(QuantizationError, match=rf"^group_size={re.escape(repr(bad))} is invalid: expected a whole "
                                                rf"number >= 1"):
        lucidlm.quantize(toy_model(), "int8", group_size=bad)
    with pytest.raises(QuantizationError, match=r"group_size=.* is invalid: expected a whole number >= 1"):
        lucidlm.load(str(toy_dir), quantize="int8", group_size=bad)


def test_a_numpy_group_size_is_the_same_as_an_int(tmp_path):
    """np.int64(32) is a whole number: the same codes as 32, and a plain 32 in quantization.json."""
    from lucidlm.weights.checkpoint import save_model

    a = lucidlm.quantize(toy_model(), "int8", group_size=32)
    b = lucidlm.quantize(toy_model(), "int8", group_size=np.int64(32))
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    save_model(b, tmp_path)
    layout = json.loads((tmp_path / "quantization.json").read_text())["modules"]
    assert {spec["group_size"] for spec in layout.values()} == {32}


@pytest.mark.parametrize("command, flags, fragments", [
    ("generate", ["--float-embeddings"], ["--float-embeddings", "add --quantize"]),
    ("generate", ["--group-size", "32"], ["--group-size 32 only applies with --quantize int4 or int8"]),
    ("generate", ["--quantize", "gguf", "--group-size", "32"], ["--group-size 32", "not --quantize gguf"]),
    ("generate", ["--quantize", "int4", "--group-size", "48"], ["--group-size 48", "32, 64, 128, 256"]),
    ("generate", ["--quantize", "int8", "--group-size", "-32"], ["--group-size=-32 is invalid", ">= 1"]),
    ("generate", ["--quantize", "int4", "--group-size", "0"], ["--group-size=0 is invalid"]),
    ("chat", ["--group-size", "32"], ["--group-size 32 only applies with --quantize"]),
    ("chat", ["--float-embeddings"], ["--float-embeddings"]),
])
def test_quantize_flag_errors_name_the_flags(toy_dir, capsys, command, flags, fragments):
    argv = [command, "hi"] if command == "generate" else [command]
    assert main([*argv, "--model", str(toy_dir), "-q", *flags]) == 1
    err = one_error_line(capsys)
    assert err.startswith(f"lucidlm {command}: error: --"), err
    for fragment in fragments:
        assert fragment in err
    assert "quantize=" not in err and "group_size=" not in err  # the Python keywords: not what was typed


def test_convert_group_size_names_the_flag(toy_dir, tmp_path, capsys):
    assert main(["convert", str(toy_dir), str(tmp_path / "out"), "--to", "lucidlm", "--group-size", "32"]) == 1
    assert "--group-size 32 only applies with --quantize" in one_error_line(capsys)
    assert not (tmp_path / "out").exists()


def test_convert_builds_a_preset_with_random_init(tmp_path, capsys):
    """SOURCE may be a preset name (convert --help says so, and the error for a bare preset
    names --random-init): --random-init builds it untrained, as generate's flag does, and
    transformers reads the export with lucidlm's logits."""
    assert main(["convert", "shakespeare-char", str(tmp_path / "bare"), "--to", "hf"]) == 1
    loading, error = capsys.readouterr().err.splitlines()  # the loading line, then one error line
    assert loading == "loading shakespeare-char ..." and "--random-init" in error
    out = tmp_path / "out"
    assert main(["convert", "shakespeare-char", str(out), "--to", "hf", "--random-init"]) == 0
    ids = [1, 5, 9, 20, 33]
    expected = lucidlm_logits(lucidlm.load("shakespeare-char", random_init=True, dtype=torch.float32), ids)
    np.testing.assert_allclose(hf_logits(out, ids), expected, rtol=0, atol=1e-5)


# ------------------------------------------------------------------ saving over the other format

LUCIDLM_FILES = {"lucidlm_config.json", "checksums.json", "model.safetensors", "tokenizer.json"}


def hf_logits(directory: Path, ids: list[int]) -> np.ndarray:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(directory), torch_dtype=torch.float32)
    with torch.no_grad():
        return model(torch.tensor([ids])).logits.numpy()


def lucidlm_logits(model, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([ids])).float().numpy()


# The toy's byte-level BPE tokenizer goes into the export too (transformers reads it back).
HF_FILES = {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"}


def test_convert_force_replaces_the_other_formats_files(toy_dir, tmp_path, capsys):
    out = tmp_path / "out"
    ids = [72, 101, 108, 108, 111, 33]
    expected = lucidlm_logits(lucidlm.load(str(toy_dir), dtype=torch.float32), ids)

    assert main(["convert", str(toy_dir), str(out), "--to", "lucidlm"]) == 0
    assert LUCIDLM_FILES <= {p.name for p in out.iterdir()}
    (out / "notes.txt").write_text("mine")  # the user's own file: never touched
    capsys.readouterr()
    assert main(["convert", str(toy_dir), str(out), "--to", "hf", "--force"]) == 0
    summary = capsys.readouterr().out
    assert {p.name for p in out.iterdir()} == HF_FILES | {"notes.txt"}
    assert summary.split("[", 1)[1].split("]", 1)[0] == ", ".join(sorted(HF_FILES))  # written now, only
    # transformers and lucidlm both read the directory as the Hugging Face model it is
    np.testing.assert_allclose(hf_logits(out, ids), expected, atol=1e-5, rtol=0)
    np.testing.assert_allclose(lucidlm_logits(lucidlm.load(str(out), dtype=torch.float32), ids), expected,
                               atol=1e-5, rtol=0)

    # and back: a lucidlm save over the Hugging Face one leaves no config.json for transformers to misread
    assert main(["convert", str(toy_dir), str(out), "--to", "lucidlm", "--force"]) == 0
    summary = capsys.readouterr().out
    assert {p.name for p in out.iterdir()} == LUCIDLM_FILES | {"notes.txt"}
    assert summary.split("[", 1)[1].split("]", 1)[0] == ", ".join(sorted(LUCIDLM_FILES))
    assert (out / "notes.txt").read_text() == "mine"
    reloaded = lucidlm.load(str(out), dtype=torch.float32)
    assert reloaded.tokenizer.encode("Hello!") == ids
    np.testing.assert_allclose(lucidlm_logits(reloaded, ids), expected, atol=0, rtol=0)


def test_a_failed_save_removes_nothing(toy_dir, tmp_path, monkeypatch):
    from lucidlm.weights import hf

    out = tmp_path / "out"
    assert main(["convert", str(toy_dir), str(out), "--to", "lucidlm"]) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    def full_disk(*args, **kwargs):
        import errno
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(hf, "save_hf", full_disk)
    assert main(["convert", str(toy_dir), str(out), "--to", "hf", "--force"]) == 1
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_merge_to_hf_force_over_a_lucidlm_save(toy_dir, tmp_path, capsys):
    from lucidlm.peft import add_lora, save_adapter

    model = lucidlm.load(str(toy_dir), dtype=torch.float32)
    add_lora(model, r=2, alpha=4, targets="q,v")
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)  # a real update, so the merge changes the weights
    save_adapter(model, tmp_path / "adapter")
    ids = [72, 105, 32, 116, 104, 101, 114, 101]
    expected = lucidlm_logits(lucidlm.load(str(toy_dir), adapter=str(tmp_path / "adapter")), ids)

    out = tmp_path / "merged"
    assert main(["convert", str(toy_dir), str(out), "--to", "lucidlm"]) == 0
    assert main(["merge", "--model", str(toy_dir), "--adapter", str(tmp_path / "adapter"), "--out", str(out),
                 "--to", "hf", "--force"]) == 0
    capsys.readouterr()
    assert {p.name for p in out.iterdir()} == HF_FILES
    np.testing.assert_allclose(hf_logits(out, ids), expected, atol=1e-5, rtol=0)
    np.testing.assert_allclose(lucidlm_logits(lucidlm.load(str(out), dtype=torch.float32), ids), expected,
                               atol=1e-5, rtol=0)


# ------------------------------------------------------------------ stdout on a full disk

@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
@pytest.mark.parametrize("flags", [[], ["--stream"], ["--json"]])
def test_stdout_on_a_full_disk_is_one_line_and_exit_1(toy_dir, flags):
    import subprocess

    with open("/dev/full", "w") as full:
        done = subprocess.run([sys.executable, "-m", "lucidlm", "generate", "hi", "--model", str(toy_dir), "-q",
                               "--max-new-tokens", "3", "--temperature", "0", *flags], stdout=full,
                              stderr=subprocess.PIPE, text=True, env=cli_env(), timeout=300)
    assert done.returncode == 1, done.stderr
    assert done.stderr == ("lucidlm generate: error: cannot write to stdout: No space left on device; free space, "
                           "or send the output elsewhere.\n")


def test_a_closed_pipe_still_ends_quietly(toy_dir):
    """`lucidlm generate ... | head`: the reader is gone; that is no error (exit 0, nothing said)."""
    import subprocess

    child = subprocess.Popen([sys.executable, "-m", "lucidlm", "generate", "hi", "--model", str(toy_dir), "-q",
                              "--max-new-tokens", "50", "--temperature", "0", "--stream"], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=cli_env())
    child.stdout.close()  # before the child has written anything
    _, err = child.communicate(timeout=300)
    assert child.returncode == 0 and err == ""


def test_a_closed_pipe_is_no_success_for_train(corpus, tmp_path):
    """`lucidlm train ... | head -n 1`: train's stdout is its log, and the closed pipe ends the run
    unfinished and unsaved; it exits as a shell shows a program a closed pipe ends (128 + SIGPIPE),
    saying so on stderr, not 0 as if the model were trained."""
    import signal
    import subprocess

    out = tmp_path / "run"
    child = subprocess.Popen([sys.executable, "-m", "lucidlm", "train", "--data", str(corpus / "small.txt"),
                              "--tokenizer", "char", "--out", str(out), "--n-layer", "1", "--n-head", "2",
                              "--n-embd", "16", "--block-size", "8", "--batch-size", "2", "--max-iters", "5",
                              "--eval-iters", "1", "--device", "cpu", "--no-progress"], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=cli_env())
    child.stdout.close()  # before the child has written anything
    _, err = child.communicate(timeout=300)
    assert child.returncode == 128 + signal.SIGPIPE, err
    assert "stdout was closed" in err and "Traceback" not in err
    assert not (out / "checkpoint").exists()


@pytest.mark.parametrize("fd, args, names", [
    (0, ["generate", "-"], ["cannot read stdin", "<&-"]),
    (0, ["chat"], ["cannot read stdin", "<&-"]),
    (1, ["generate", "hi"], ["cannot write to stdout", ">&-"]),
    (1, ["generate", "hi", "--json"], ["cannot write to stdout", ">&-"]),
], ids=["generate-stdin", "chat-stdin", "generate-stdout", "json-stdout"])
def test_a_closed_standard_stream_is_one_line_and_exit_1(toy_dir, fd, args, names):
    """Started with stdin or stdout closed (`<&-`, `>&-`), where Python's sys.stdin/stdout are
    None: lucidlm's one line and exit 1 (as `cat <&-` says "Bad file descriptor"), not the
    internal error of an AttributeError."""
    import os
    import subprocess

    done = subprocess.run([sys.executable, "-m", "lucidlm", *args, "--model", str(toy_dir), "-q",
                           "--max-new-tokens", "2", "--temperature", "0"], stdin=None if fd == 0 else subprocess.DEVNULL,
                          stdout=None if fd == 1 else subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                          env=cli_env(), timeout=300, preexec_fn=lambda: os.close(fd))
    assert done.returncode == 1, done.stderr
    assert len(done.stderr.splitlines()) == 1 and all(name in done.stderr for name in names), done.stderr


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
@pytest.mark.parametrize("stderr", ["closed", "/dev/full"])
def test_an_unusable_stderr_does_not_stop_generate(toy_dir, stderr):
    """`2>&-` or stderr on a full disk: the loading line cannot be written, which is no reason to
    fail; the text still comes out on stdout, exit 0 (as `ls 2>&-` still lists)."""
    import os
    import subprocess

    command = [sys.executable, "-m", "lucidlm", "generate", "hi", "--model", str(toy_dir), "--max-new-tokens", "3",
               "--temperature", "0"]
    quiet = subprocess.run([*command, "-q"], capture_output=True, text=True, env=cli_env(), timeout=300)
    with open("/dev/full", "w") as full:
        done = subprocess.run(command, stdout=subprocess.PIPE, stderr=full if stderr == "/dev/full" else None,
                              text=True, env=cli_env(), timeout=300,
                              preexec_fn=(lambda: os.close(2)) if stderr == "closed" else None)
    assert (done.returncode, done.stdout) == (0, quiet.stdout)


# ------------------------------------------------------------------ stdout that is not UTF-8

@pytest.mark.parametrize("flags", [[], ["--stream"], ["--json"], ["--json", "--stream"]])
def test_stdout_that_cannot_encode_the_text_escapes_it(toy_dir, flags):
    """PYTHONIOENCODING=ascii (or a Latin-1 locale): the text comes out with Python's escapes for
    what the stream lacks (as Python writes stderr), JSON with its own \\u escapes (still JSON,
    the same values); not an internal error."""
    import subprocess

    def run_with(encoding):
        return subprocess.run([sys.executable, "-m", "lucidlm", "generate", "caf\u00e9 \u2615", "--model", str(toy_dir),
                               "-q", "--max-new-tokens", "24", "--temperature", "0", *flags], capture_output=True,
                              env=cli_env(PYTHONIOENCODING=encoding), timeout=300)

    utf8, ascii_ = run_with("utf-8"), run_with("ascii")
    assert utf8.returncode == 0 and ascii_.returncode == 0, ascii_.stderr
    assert ascii_.stderr == b""
    text = utf8.stdout.decode("utf-8")
    if "--json" in flags:
        assert [json.loads(line) for line in ascii_.stdout.decode("ascii").splitlines()][:-1] == \
               [json.loads(line) for line in text.splitlines()][:-1]  # the last line's timings differ
        text = json.loads(text.splitlines()[-1])["text"]
        assert json.loads(ascii_.stdout.decode("ascii").splitlines()[-1])["text"] == text
    else:
        assert ascii_.stdout == text.encode("ascii", "backslashreplace")
    assert not text.isascii()  # the toy model's bytes decode to text ASCII cannot hold


# ------------------------------------------------------------------ inspect's title

def test_inspect_title_names_the_default_model(toy_dir, tmp_path, monkeypatch, capsys):
    """Without --model the report is of the embedded model, and its title says so (it said None)."""
    import lucidlm.loading as loading

    sources = []
    real_load = loading.load

    def load(source=None, **kwargs):  # the toy stands in for the embedded model (no download here)
        sources.append(source)
        return real_load(str(toy_dir), **kwargs)

    import lucidlm

    monkeypatch.setattr(loading, "load", load)
    monkeypatch.setattr(lucidlm, "load", load)  # what the commands' loader calls
    out = tmp_path / "r.html"
    assert main(["inspect", "Hi", "--out", str(out)]) == 0
    assert sources == [loading.DEFAULT_MODEL]  # the embedded model, named as generate names it
    title = re.search(r"<title>([^<]*)</title>", out.read_text(encoding="utf-8")).group(1)
    assert title == f"lucidlm inspect: {loading.DEFAULT_MODEL}" == "lucidlm inspect: smollm2-135m"
    capsys.readouterr()


# ------------------------------------------------------------------ the chat REPL, in a real terminal

def test_chat_refuses_a_message_longer_than_the_context_and_keeps_the_conversation(toy_dir, tmp_path):
    from lucidlm.generation.chat_template import encode_chat

    pexpect = pytest.importorskip("pexpect")
    model = lucidlm.load(str(toy_dir))
    long_message = "x" * 400
    system = [{"role": "system", "content": "Be brief."}]
    n_tokens = len(encode_chat(model.tokenizer, system + [{"role": "user", "content": long_message}]))
    assert n_tokens > 256

    child = spawn_chat(toy_dir, tmp_path / "cache", "--system", "Be brief.")
    run(child, "first question")
    run(child, "second question")
    refused = run(child, long_message, re.escape(f"error: this message is {n_tokens} tokens in the chat template "
                                                 f"with the system prompt, more than the model's context of 256 "
                                                 f"tokens"))
    assert "dropped" not in refused
    run(child, f"/save {tmp_path / 'kept.json'}", re.escape("(saved 5 messages"))
    data = json.loads((tmp_path / "kept.json").read_text(encoding="utf-8"))
    assert [m["role"] for m in data["messages"]] == ["system", "user", "assistant", "user", "assistant"]
    assert [m["content"] for m in data["messages"] if m["role"] == "user"] == ["first question", "second question"]
    run(child, "third question")  # the session goes on with its history

    # /set max_new_tokens default: back to the session's --max-new-tokens (5), not refused
    run(child, "/set max_new_tokens 3", re.escape("(max_new_tokens = 3)"))
    run(child, "/set max_new_tokens default", re.escape("(max_new_tokens = 5, the session's default)"))
    run(child, "/show", re.escape("max_new_tokens 5"))
    run(child, "/set top_p 0.5", re.escape("(top_p = 0.5)"))
    run(child, "/set top_p default", re.escape("(top_p = the model default)"))
    child.sendline("/exit")
    child.expect(pexpect.EOF)
