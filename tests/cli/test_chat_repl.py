"""``lucidlm chat`` driven in a real pseudo-terminal (pexpect): what a person at the keyboard gets.

A tiny byte-level model (context 256 tokens) keeps it fast; answers are gibberish, which
does not matter: the tests are about the prompt, its commands, editing and history.
"""

from __future__ import annotations

import json
import re
import sys

import pytest
from cli_run import cli_env

pexpect = pytest.importorskip("pexpect")

PROMPT = ">>> "
EOT = "<|endoftext|>"


@pytest.fixture(scope="module")
def toy_dir(tmp_path_factory):
    import torch

    from lucidlm import LanguageModel, preset
    from lucidlm.tokenizers import BPETokenizer
    from lucidlm.weights.checkpoint import save_model

    tokenizer = BPETokenizer([], {EOT: 256}, eos_token=EOT)
    torch.manual_seed(0)
    model = LanguageModel(preset("llama", n_layers=1, d_model=32, n_heads=2, n_kv_heads=1, vocab_size=257,
                                 max_seq_len=256, multiple_of=32), tokenizer)
    path = tmp_path_factory.mktemp("toy_chat")
    save_model(model, path)
    return path


def spawn_chat(toy_dir, cache_dir, *extra):
    # A cache of its own (the history file), with this session's compiled CPU kernels in it:
    # building them again would be 15-30 s of the first prompt, and tests/quantization builds them.
    from lucidlm.cache_dir import cache_root

    built = cache_root() / "kernels"
    if built.is_dir() and not (cache_dir / "kernels").exists():
        cache_dir.mkdir(parents=True, exist_ok=True)
        (cache_dir / "kernels").symlink_to(built, target_is_directory=True)
    child = pexpect.spawn(sys.executable, ["-m", "lucidlm", "chat", "--model", str(toy_dir), "-q",
                                           "--temperature", "0", "--max-new-tokens", "5", *extra],
                          env=cli_env(LUCIDLM_CACHE=str(cache_dir), TERM="xterm", INPUTRC="/dev/null"),
                          encoding="utf-8", timeout=180, dimensions=(50, 250))
    child.expect_exact("lucidlm chat - ")
    child.expect_exact(PROMPT)
    return child


def run(child, line, *expected):
    child.sendline(line)
    for text in expected:
        child.expect(text)
    child.expect_exact(PROMPT)
    return child.before


def saved(child, path):
    run(child, f"/save {path}", re.escape(f"to {path}"))
    return json.loads(path.read_text(encoding="utf-8"))


def test_chat_prompt_commands_paste_and_history(toy_dir, tmp_path):
    cache = tmp_path / "cache"
    child = spawn_chat(toy_dir, cache)
    run(child, "/help", re.escape("/set NAME VALUE"), re.escape("/save FILE"))
    run(child, "/set temperature 0.3", re.escape("(temperature = 0.3)"))
    run(child, "/set temprature 0.5", re.escape("did you mean 'temperature'?"))
    run(child, "/set top_p 7", re.escape("/set top_p 7 is invalid"))
    run(child, "/show", re.escape("temperature 0.3"))
    run(child, "Hello there")
    run(child, "/stats", r"\(\d+ tokens, ([\d.]+ tok/s|-) after the first; prompt \d+ tokens read in [\d.]+ s, "
                         r"\d+ tok/s; finish: \w+\)")

    # """ ... """ is one message; so is a bracketed paste of several lines
    child.sendline('"""')
    child.sendline("line one")
    child.sendline('line two"""')
    child.expect_exact(PROMPT)
    child.send("\x1b[200~first\nsecond\x1b[201~")
    child.send("\r")
    child.expect_exact(PROMPT)
    first = saved(child, tmp_path / "a.json")
    users = [m["content"] for m in first["messages"] if m["role"] == "user"]
    assert users == ["Hello there", "line one\nline two", "first\nsecond"]

    # /load continues a saved conversation: the same messages and settings come back
    run(child, "/reset", re.escape("(conversation reset)"))
    run(child, f"/load {tmp_path / 'a.json'}", re.escape(f"(loaded {len(first['messages'])} messages"))
    assert saved(child, tmp_path / "a2.json") == first
    run(child, f"/load {tmp_path / 'nothing.json'}", re.escape("cannot load"))

    # a 6000-character line arrives whole (a terminal in canonical mode would cut it at 4095)
    long_text = "".join(f"{i % 10}" for i in range(6000))
    run(child, "/system " + long_text, re.escape("(system prompt set; conversation reset)"))
    data = saved(child, tmp_path / "b.json")
    assert data["system"] == long_text and data["messages"][0] == {"role": "system", "content": long_text}
    run(child, "/system", re.escape("(system prompt back to the chat template's default; conversation reset)"))
    assert saved(child, tmp_path / "c.json")["system"] is None

    # the arrow keys edit and recall: up twice re-runs the /set before /reset
    run(child, "/set top_k 7", re.escape("(top_k = 7)"))
    run(child, "/reset", re.escape("(conversation reset)"))
    child.send("\x1b[A\x1b[A\r")
    child.expect(re.escape("(top_k = 7)"))
    child.expect_exact(PROMPT)
    run(child, "/set seed 42", re.escape("(seed = 42)"))
    child.sendeof()
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0
    assert "/set seed 42" in (cache / "chat_history").read_text(encoding="utf-8")

    # the history survives the session: up-arrow in a new one brings back its last line
    child = spawn_chat(toy_dir, cache)
    child.send("\x1b[A\r")
    child.expect(re.escape("(seed = 42)"))
    child.expect_exact(PROMPT)
    child.sendline("/exit")
    child.expect(pexpect.EOF)


def test_a_conversation_longer_than_the_context_drops_the_oldest_turns(toy_dir, tmp_path):
    child = spawn_chat(toy_dir, tmp_path / "cache", "--system", "Be brief.", "--verbose")
    run(child, "a" * 30, r"tok/s")
    before = run(child, "b" * 30, r"tok/s")
    assert "dropped" not in before
    run(child, "c" * 30, re.escape("(the conversation outgrew the context of 256 tokens: dropped the 2 oldest "
                                   "messages; the system prompt stays)"))
    data = saved(child, tmp_path / "d.json")
    assert data["messages"][0] == {"role": "system", "content": "Be brief."}
    assert [m["content"] for m in data["messages"] if m["role"] == "user"][-1] == "c" * 30
    assert "a" * 30 not in [m["content"] for m in data["messages"]]
    child.sendline("/exit")
    child.expect(pexpect.EOF)


def test_a_model_that_cannot_chat_is_refused_before_the_session(tmp_path, capsys):
    """A character model (what the README's `lucidlm train` makes) cannot write the chat
    template's markers, and a model without a tokenizer cannot read a message: one line and
    exit 1 before the first prompt, not an error on every message of a session that exits 0."""
    import torch

    from lucidlm import LanguageModel, cli, preset
    from lucidlm.tokenizers import CharTokenizer
    from lucidlm.weights.checkpoint import save_model

    tokenizer = CharTokenizer.train("abcdefghijklmnopqrstuvwxyz ?.\n")
    torch.manual_seed(0)
    config = preset("llama", n_layers=1, d_model=32, n_heads=2, n_kv_heads=1, vocab_size=tokenizer.vocab_size,
                    max_seq_len=64, multiple_of=32)
    save_model(LanguageModel(config, tokenizer), tmp_path / "char")
    save_model(LanguageModel(config, None), tmp_path / "none")
    for name, message in (("char", "cannot write its chat template"), ("none", "has no tokenizer, so it cannot chat")):
        assert cli.main(["chat", "--model", str(tmp_path / name), "-q"]) == 1
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, err
