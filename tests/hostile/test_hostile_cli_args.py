"""Careless and hostile command lines: every bad flag value, non-UTF-8 text and unusable output
path is refused with lucidlm's one line (exit != 0, no traceback, nothing on disk changed),
before a model is loaded or any training starts. A tiny random GPT-2 directory (GPT-2's own
BPE) stands in for a model; the embedded one is never loaded. Then a seeded argv fuzz over
every subcommand's parser, in-process, that must never reach the internal-error handler."""

from __future__ import annotations

import os
import random
import re
import shutil
import sys
from pathlib import Path

import pytest

import lucidlm
from lucidlm import cli
from lucidlm.weights.checkpoint import save_model

from harness import main_refused, refused  # tests/hostile is on sys.path

NOT_UTF8 = b"caf\xe9 \xff"  # Latin-1 bytes: argv and stdin both deliver them to Python undecodable


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    model = lucidlm.load("gpt2", random_init=True, n_layers=1, d_model=16, n_heads=2, max_seq_len=16)
    return str(save_model(model, tmp_path_factory.mktemp("tiny") / "model"))


@pytest.fixture(scope="module")
def places(tmp_path_factory):
    """A corpus, a file, a stranger's non-empty folder and an existing empty output folder."""
    root = tmp_path_factory.mktemp("places")
    (root / "corpus.txt").write_text("to be or not to be, that is the question\n" * 50)
    (root / "a_file").write_text("not a directory\n")
    (root / "theirs").mkdir()
    (root / "theirs" / "notes.txt").write_text("someone's notes\n")
    (root / "folder").mkdir()
    return root


GENERATE = [  # flags after `generate PROMPT --model TINY`, what the error line must name
    (["--seed", str(2 ** 64)], [r"--seed 18446744073709551616", r"2\*\*64 - 1"]),
    (["--device", "foo"], [r"device 'foo'", r"cuda:N"]),
    (["--device", "gpu"], [r"'gpu'", r"'cuda'"]),
    (["--dtype", "float8"], [r"dtype 'float8'", r"bfloat16"]),  # (float64 is a dtype load takes)
    (["--temperature", "nan"], [r"--temperature nan"]),
    (["--top-p", "1.5"], [r"--top-p 1\.5"]),
    (["--top-k", "-1"], [r"--top-k -1"]),
    (["--num-beams", "100000"], [r"--num-beams 100000", r"50257"]),
    (["--repetition-penalty", "0"], [r"--repetition-penalty 0 "]),
]


@pytest.mark.parametrize("flags, names", GENERATE, ids=[" ".join(f) for f, _ in GENERATE])
def test_generate_flags(tiny_dir, flags, names):
    main_refused("generate", "Hello", "--model", tiny_dir, "-q", *flags, names=names, watch=[tiny_dir])


def test_cuda_devices_on_a_machine_without_them(tiny_dir):
    import torch

    if torch.cuda.is_available():  # the case is a machine with fewer GPUs than asked for
        device = f"cuda:{torch.cuda.device_count()}"
        main_refused("generate", "Hi", "--model", tiny_dir, "--device", device, names=[device, "CUDA"])
    else:
        for device in ("cuda", "cuda:7"):
            main_refused("generate", "Hi", "--model", tiny_dir, "--device", device, names=[device, "--device cpu"])


@pytest.mark.parametrize("args, stdin, names", [
    (["generate", NOT_UTF8], None, [r"PROMPT", r"0xe9", r"character 3", "UTF-8"]),
    (["generate", "-"], b"hello " + NOT_UTF8, [r"stdin", r"0xe9", r"byte 9"]),
], ids=["argv", "stdin"])
def test_text_that_is_not_utf8(tiny_dir, tmp_path, args, stdin, names):  # real bytes through a real process
    refused(*args, "--model", tiny_dir, names=names, stdin=stdin, watch=[tiny_dir, tmp_path], cwd=tmp_path)


def test_utf8_text_under_an_ascii_locale_is_text(tiny_dir):
    """LC_ALL=C with PYTHONUTF8=0: Python decodes argv as ASCII, escaping every byte of UTF-8 text
    as it does bytes that are not UTF-8; the text is UTF-8 all the same, and is read as Python
    reads it in UTF-8 mode (PYTHONUTF8=1), not refused as "not UTF-8"."""
    import json
    import os
    import subprocess

    def prompt_ids(utf8_mode):
        env = dict(os.environ, PYTHONPATH=str(Path(lucidlm.__file__).parents[1]), LC_ALL="C", LANG="C",
                   PYTHONUTF8=utf8_mode, PYTHONIOENCODING="utf-8", HF_HUB_OFFLINE="1")
        done = subprocess.run([sys.executable, "-m", "lucidlm", "generate", "caf\u00e9 \u2615", "--model", tiny_dir,
                               "-q", "--json", "--max-new-tokens", "1", "--temperature", "0", "--stop", "\u2615"],
                              capture_output=True, text=True, env=env, timeout=300)
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout)["prompt_ids"]

    assert prompt_ids("0") == prompt_ids("1")


ESCAPED = NOT_UTF8.decode("utf-8", "surrogateescape")  # what Python makes of those bytes in argv


@pytest.mark.parametrize("args, names", [
    (["generate", "Hi", "--stop", ESCAPED], [r"--stop", r"0xe9"]),
    (["generate", "Hi", "--chat", "--system", ESCAPED], [r"--system", r"0xe9"]),
    (["chat", "--system", ESCAPED], [r"--system", r"0xe9", "character 3"]),
    (["inspect", ESCAPED], [r"TEXT", r"0xe9"]),
    (["generate", "\ud800x"], [r"PROMPT", r"lone surrogate U\+D800"]),  # from Python: no byte made it
], ids=["stop", "system", "chat", "inspect", "lone-surrogate"])
def test_text_flags_that_are_not_utf8(tiny_dir, tmp_path, args, names):
    main_refused(*args, "--model", tiny_dir, names=names, watch=[tiny_dir, tmp_path])


def test_an_unknown_argument_that_is_not_utf8_is_quoted_escaped(capsys):
    """argparse's own errors quote argv too: an unrecognized word with bytes that are not
    UTF-8 gets the one-line error, escaped, on a stream that refuses surrogates (capsys's)."""
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["chat", "stray", ESCAPED])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "unrecognized arguments: stray" in err and "\\udce9" in err and ESCAPED not in err


TRAIN = [  # flags after `train --data CORPUS --out NEW`
    (["--learning-rate", "nan"], [r"--learning-rate", r"=nan"]),
    (["--beta1", "2"], [r"--beta1", r"=2\.0", r"\[0\.0, 1\.0\)"]),
    (["--block-size", "-1"], [r"--block-size", r"=-1"]),
    (["--seed", str(2 ** 64)], [r"--seed", r"2\*\*64 - 1"]),
    (["--device", "foo"], [r"device 'foo'"]),
    (["--sample-prompt", ESCAPED], [r"--sample-prompt", r"0xe9"]),
]


@pytest.mark.parametrize("flags, names", TRAIN, ids=[str(f[0]) for f, _ in TRAIN])
def test_train_flags(places, tmp_path, flags, names):
    out = tmp_path / "run"
    main_refused("train", "--data", str(places / "corpus.txt"), "--out", str(out), *flags, names=names)
    assert not out.exists()  # refused before anything was written


@pytest.mark.parametrize("flags, names", [
    (["--block-size", "-1"], [r"--block-size", r"=-1"]),
    (["--learning-rate", "inf"], [r"--learning-rate", r"=inf"]),
    (["--beta2", "-0.1"], [r"--beta2", r"=-0\.1"]),
])
def test_finetune_flags(places, tiny_dir, tmp_path, flags, names):
    out = tmp_path / "run"
    main_refused("finetune", "--model", tiny_dir, "--data", str(places / "corpus.txt"), "--out", str(out), *flags,
            names=names)
    assert not out.exists()


def _train_out(places, out):
    return ("train", "--data", str(places / "corpus.txt"), "--out", str(out), "--preset", "seed000")


def test_train_out_paths(places):
    main_refused(*_train_out(places, places / "a_file"), names=[r"--out", "a_file", "cannot write", "exists"],
                 watch=[places])
    main_refused(*_train_out(places, places / "a_file" / "run"), names=[r"--out", "a_file/run", "not a directory"],
                 watch=[places])
    line = refused(*_train_out(places, places / "theirs"), names=[r"--out", "notes.txt", "not from a lucidlm run"],
                   watch=[places])
    assert "new or empty directory" in line


@pytest.mark.parametrize("name, make", [
    ("checkpoint", lambda p: p.write_text('model_checkpoint_path: "model.ckpt-1000"\n')),  # TensorFlow's index file
    ("data", lambda p: p.write_text("my notes\n")),
    ("loss.png", lambda p: p.mkdir()),
])
def test_what_stands_where_a_run_writes_is_never_replaced(places, tiny_dir, tmp_path, name, make):
    """A file named "checkpoint" (TensorFlow keeps one in its training folders) made the folder
    look like a lucidlm run, and the first checkpoint swap deleted it; a file named "data" was the
    internal-error line; a folder named loss.png failed the run after training, at its first plot."""
    out = tmp_path / "their_run"
    out.mkdir()
    make(out / name)
    names = [re.escape(str(out / name)), "where a lucidlm run keeps its own", "--out"]
    small = ("--max-iters", "1", "--block-size", "8", "--batch-size", "2", "--eval-interval", "1", "--eval-iters", "1",
             "--sample-tokens", "0")  # a run that would otherwise go through and save its checkpoint
    for resume in ((), ("--resume",)):
        main_refused(*_train_out(places, out), *small, *resume, names=names, watch=[out])
        main_refused("finetune", "--model", tiny_dir, "--data", str(places / "corpus.txt"), "--out", str(out), *small,
                     *resume, names=names, watch=[out])


def test_inspect_out_paths(places, tiny_dir):
    for flags, names in [(["--out", str(places / "folder")], [r"--out", "is a directory"]),
                         (["--out", str(places / "a_file" / "r.html")], [r"--out", "a_file is a file"]),
                         (["--plots", str(places / "a_file")], [r"--plots", "is a file, not a directory"]),
                         (["--plots", str(places / "a_file" / "figs")], [r"--plots", "a_file is a file"])]:
        main_refused("inspect", "Hello", "--model", tiny_dir, *flags, names=names, watch=[places, tiny_dir])


def test_inspect_out_never_replaces_the_model_it_reads(tmp_path, tiny_dir):
    """A report written over the model's own weights, config or tokenizer replaced the model
    (the next load found its checksum wrong); a report beside them is fine."""
    model = tmp_path / "model"
    shutil.copytree(tiny_dir, model)
    link = tmp_path / "weights-link.safetensors"
    link.symlink_to(model / "model.safetensors")
    for out in (model / "model.safetensors", model / "tokenizer.json", link,
                model / "config.json"):  # a Hugging Face config.json beside it would change how it loads
        main_refused("inspect", "Hello", "--model", str(model), "--out", str(out),
                     names=[r"--out", re.escape(str(out)), "--model", "read from", "choose another --out"],
                     watch=[model])
    assert cli.main(["inspect", "Hello", "--model", str(model), "--out", str(model / "report.html")]) == 0
    assert lucidlm.load(str(model)).config == lucidlm.load(tiny_dir).config  # still loads (checksums verified)


def test_output_names_longer_than_the_file_system_holds_are_one_line(places, tiny_dir):
    """A name one byte over the file system's NAME_MAX (os.pathconf) stopped every command in the
    internal-error line (Path.exists passes ENAMETOOLONG on); a name that fits is written, though
    its staging file's name (~38 bytes longer) would not fit: it was refused as 'File name too long'."""
    long = places / ("b" * (os.pathconf(places, "PC_NAME_MAX") + 1))
    says = [r"longer than the file system allows", "choose a shorter"]
    for command in (("convert", tiny_dir, str(long), "--to", "hf"),
                    ("merge", "--model", tiny_dir, "--adapter", str(places / "folder"), "--out", str(long)),
                    _train_out(places, long),
                    ("finetune", "--model", tiny_dir, "--data", str(places / "corpus.txt"), "--out", str(long)),
                    ("inspect", "Hello", "--model", tiny_dir, "--out", str(long)),
                    ("inspect", "Hello", "--model", tiny_dir, "--plots", str(long))):
        flag = "OUT_DIR" if command[0] == "convert" else "--plots" if "--plots" in command else "--out"
        main_refused(*command, names=[re.escape(flag), *says], watch=[places, tiny_dir])
    fits = places / ("a" * (os.pathconf(places, "PC_NAME_MAX") - 5) + ".html")
    assert cli.main(["inspect", "Hello", "--model", tiny_dir, "--out", str(fits), "-q"]) == 0
    assert fits.read_text(encoding="utf-8").lstrip().lower().startswith("<!doctype html")
    assert [p.name for p in places.iterdir() if p.name.startswith(".")] == []  # no staging file left
    fits.unlink()


def test_finetune_out_is_never_the_base_it_reads(places, tmp_path):
    """A base that is a training run: --out RUN read RUN/checkpoint as a run to --resume, and
    --resume then refused it as incomplete (no trainable.safetensors), each error pointing at
    the other; the base is what it is, and nothing is written."""
    from lucidlm.training import TrainConfig, pretrain

    run = tmp_path / "run"
    pretrain(TrainConfig(data=str(places / "corpus.txt"), out_dir=str(run), preset="seed000", n_layer=1, n_embd=16,
                         n_head=2, block_size=8, batch_size=2, max_iters=1, eval_interval=1, eval_iters=1,
                         sample_tokens=0, progress=False, warmup_iters=0, lr_decay_iters=1))
    for out in (run, run / "checkpoint"):
        for resume in ((), ("--resume",)):
            main_refused("finetune", "--model", str(run), "--data", str(places / "corpus.txt"), "--out", str(out),
                         *resume, names=[f"--out {re.escape(str(out))} is the --model", "choose another --out"],
                         watch=[run])


def test_merge_and_convert_out_paths(places, tiny_dir):
    for out in (places / "a_file", places / "a_file" / "merged"):
        main_refused("merge", "--model", tiny_dir, "--adapter", str(places / "folder"), "--out", str(out),
                     names=[r"--out", "a_file"], watch=[places, tiny_dir])
        main_refused("convert", tiny_dir, str(out), "--to", "hf", names=[r"OUT_DIR", "a_file"],
                     watch=[places, tiny_dir])
    if Path("/proc/self").is_dir():  # a directory that cannot be made there: mkdir says ENOENT, not EACCES
        main_refused("convert", tiny_dir, "/proc/lucidlm-out", "--to", "lucidlm",
                     names=[r"cannot write /proc/lucidlm-out", "OUT_DIR"], watch=[tiny_dir])


# -- a seeded fuzz of every parser, in process: parse errors exit 2, checks raise lucidlm errors ------------
VALUES = ["0", "-1", "1", "2.5", "nan", "inf", "-inf", "1e400", str(2 ** 64), "", "x", "foo", "cuda:99", "gpu",
          "\udce9t\udcff", "--", "-", "lora", "float64", "auto", "/nonexistent/x", "1e-45"]


def _check_instead_of_running(args):
    """Stands in for each command's handler: the checks the command runs before loading anything."""
    from lucidlm.commands.config_flags import config_from_args
    from lucidlm.commands.generate import sampling_kwargs
    from lucidlm.commands.perplexity import check_window_flags
    from lucidlm.generation import check_options
    from lucidlm.training.config import FinetuneConfig, TrainConfig

    if args.command in ("train", "finetune"):
        config_from_args(TrainConfig if args.command == "train" else FinetuneConfig, args)
    elif args.command in ("generate", "chat"):
        extra = dict(num_beams=args.num_beams, length_penalty=args.length_penalty) if args.command == "generate" else {}
        check_options(**sampling_kwargs(args), **extra)
    elif args.command == "perplexity":
        check_window_flags(args)
    return 0


def test_argv_fuzz_never_reaches_the_internal_error_handler(monkeypatch, capsys):
    real_build = cli.build_parser

    def build(commands=None):
        parser = real_build(commands)
        sub = cli._subparser(parser, next(iter(commands))) if commands else None
        if sub is not None:
            sub.set_defaults(handler=_check_instead_of_running)
        return parser

    monkeypatch.setattr(cli, "build_parser", build)
    rng = random.Random(13)
    for command in cli.COMMANDS:
        parser = cli._subparser(real_build([command]), command)
        flags = [s for a in parser._actions for s in a.option_strings if s.startswith("--") and s != "--help"]
        for _ in range(25):
            argv = [command]
            if command in ("generate", "inspect", "convert"):
                argv.append(rng.choice(["Hi", "\udcff"]))
            if command == "convert":
                argv.append("/nonexistent/out")
            if command in ("train", "finetune"):
                argv += ["--data", "corpus.txt", "--out", "run"]
            if command == "perplexity":
                argv += ["--data", "corpus.txt"]
            for flag in rng.sample(flags, k=min(len(flags), rng.randint(1, 4))):
                argv += [flag, rng.choice(VALUES)]
            try:
                code = cli.main(argv)
            except SystemExit as exc:  # argparse: a malformed or refused value, exit 2
                code = exc.code
            err = capsys.readouterr().err
            assert cli.INTERNAL_ERROR not in err and "Traceback" not in err, f"{argv!r}\n{err}"
            assert code in (0, 1, 2), f"{argv!r} -> {code}\n{err}"
            if code == 1:
                assert err.startswith(f"lucidlm {command}: error: ") and err.count("\n") == 1, f"{argv!r}\n{err}"


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
