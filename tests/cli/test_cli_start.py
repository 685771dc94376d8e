"""A fast start: ``lucidlm --help`` / ``--version`` and the generate/chat/serve/inspect/perplexity help never
import torch.

Checked on the real command in a fresh process with ``python -X importtime``, which lists every
module the process imports (the timing itself lives in benchmarks/bench_cli_start.py).
"""

from __future__ import annotations

import pytest
from cli_run import run_cli


def imported_modules(importtime_stderr: str) -> set[str]:
    names = set()
    for line in importtime_stderr.splitlines():
        if line.startswith("import time:") and "|" in line:
            names.add(line.rsplit("|", 1)[1].strip())
    return names


@pytest.mark.parametrize("args", [["--help"], ["--version"], ["generate", "--help"], ["chat", "--help"],
                                  ["serve", "--help"], ["inspect", "--help"], ["perplexity", "--help"]])
def test_help_and_version_do_not_import_torch(args):
    done = run_cli(*args, python_flags=("-X", "importtime"))
    assert done.returncode == 0, done.stderr[-2000:]
    modules = imported_modules(done.stderr)
    assert "lucidlm.cli" in modules  # the listing is real: the CLI itself shows up in it
    assert not {m for m in modules if m == "torch" or m.startswith("torch.")}
    assert "usage: lucidlm" in done.stdout or done.stdout.startswith("lucidlm ")


def test_version_prints_the_package_version():
    from importlib.metadata import version

    done = run_cli("--version")
    assert done.stdout.strip() == f"lucidlm {version('lucidlm')}"


def test_top_level_help_lists_each_command_with_its_own_summary():
    """The summaries cli.py shows without importing the commands are the commands' own help, each
    beginning on its command's line (argparse pushed the longest name's, perplexity's, below it)."""
    import argparse
    import re

    from lucidlm import cli

    full = cli.build_parser()  # every command registered for real
    sub = next(a for a in full._actions if isinstance(a, argparse._SubParsersAction))
    own = {choice.dest: choice.help for choice in sub._choices_actions}
    assert own == cli.SUMMARIES, "a command's help= changed: copy it into lucidlm/cli.py SUMMARIES"
    assert set(cli.SUMMARIES) == set(cli.COMMANDS)
    done = run_cli("--help")
    for name in cli.COMMANDS:
        line = re.search(rf"^ +{name} +(\S.*)$", done.stdout, re.MULTILINE)
        assert line and cli.SUMMARIES[name].startswith(line.group(1)), (name, done.stdout)


def test_import_lucidlm_is_lazy_but_complete():
    import subprocess
    import sys

    from cli_run import cli_env

    code = ("import sys, lucidlm; assert 'torch' not in sys.modules; "
            "names = [lucidlm.load, lucidlm.LanguageModel, lucidlm.Transformer, lucidlm.ModelConfig, "
            "lucidlm.PRESETS, lucidlm.preset, lucidlm.LucidLMError]; "
            "assert issubclass(lucidlm.LanguageModel, lucidlm.Transformer); "
            "assert set(lucidlm.__all__) <= set(dir(lucidlm)); print('ok')")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=cli_env(), timeout=300)
    assert done.stdout.strip() == "ok", done.stderr[-2000:]


def test_generate_says_loading_before_it_imports_torch(tmp_path):
    """A fresh `lucidlm generate` writes its loading line before the seconds torch's import takes."""
    import torch

    from lucidlm import LanguageModel, preset
    from lucidlm.tokenizers import BPETokenizer
    from lucidlm.weights.checkpoint import save_model

    torch.manual_seed(0)
    tokenizer = BPETokenizer([], {"<|endoftext|>": 256}, eos_token="<|endoftext|>")
    save_model(LanguageModel(preset("llama", n_layers=1, d_model=32, n_heads=2, vocab_size=257, max_seq_len=32,
                                    multiple_of=32), tokenizer), tmp_path)
    done = run_cli("generate", "Hi", "--model", str(tmp_path), "--max-new-tokens", "2",
                   python_flags=("-X", "importtime"))
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stderr.splitlines()
    loading = lines.index(f"loading {tmp_path} ...")
    first_torch = next(i for i, line in enumerate(lines) if line.rsplit("|", 1)[-1].strip() == "torch")
    assert loading < first_torch


def test_prompt_from_a_terminal_says_how_to_end_it(tmp_path):
    """``generate -`` typed at a terminal (not piped) waits for Ctrl-D before it loads anything:
    it says so at once instead of sitting silent, then answers what was typed."""
    import sys

    import torch

    pexpect = pytest.importorskip("pexpect")
    from cli_run import cli_env

    from lucidlm import LanguageModel, preset
    from lucidlm.tokenizers import BPETokenizer
    from lucidlm.weights.checkpoint import save_model

    torch.manual_seed(0)
    tokenizer = BPETokenizer([], {"<|endoftext|>": 256}, eos_token="<|endoftext|>")
    save_model(LanguageModel(preset("llama", n_layers=1, d_model=32, n_heads=2, vocab_size=257, max_seq_len=32,
                                    multiple_of=32), tokenizer), tmp_path)
    child = pexpect.spawn(sys.executable, ["-m", "lucidlm", "generate", "-", "--model", str(tmp_path), "-q",
                                           "--max-new-tokens", "2", "--temperature", "0"],
                          env=cli_env(TERM="xterm"), encoding="utf-8", timeout=120)
    child.expect_exact("end it with Ctrl-D", timeout=30)
    child.sendline("Hi")
    child.sendeof()
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0


@pytest.mark.parametrize("command", [["inspect", "Hi", "--out", "{tmp}/r.html"], ["convert", "{model}", "{tmp}/out", "--to", "hf"]])
def test_inspect_and_convert_say_loading_before_they_import_torch(command, tmp_path):
    """Like generate, the README tour's inspect and convert write their loading line at once
    (stderr), not after the seconds torch's import and the load take in silence."""
    import torch

    from lucidlm import LanguageModel, preset
    from lucidlm.tokenizers import BPETokenizer
    from lucidlm.weights.checkpoint import save_model

    torch.manual_seed(0)
    model_dir = tmp_path / "model"
    tokenizer = BPETokenizer([], {"<|endoftext|>": 256}, eos_token="<|endoftext|>")
    save_model(LanguageModel(preset("llama", n_layers=1, d_model=32, n_heads=2, vocab_size=257, max_seq_len=32,
                                    multiple_of=32), tokenizer), model_dir)
    args = [a.format(tmp=tmp_path, model=model_dir) for a in command]
    if command[0] == "inspect":
        args += ["--model", str(model_dir)]
    done = run_cli(*args, python_flags=("-X", "importtime"))
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stderr.splitlines()
    loading = lines.index(f"loading {model_dir} ...")
    first_torch = next(i for i, line in enumerate(lines) if line.rsplit("|", 1)[-1].strip() == "torch")
    assert loading < first_torch
