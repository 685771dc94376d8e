"""``lucidlm generate`` / ``lucidlm chat`` through ``lucidlm.cli.main``, on a saved toy model."""

from __future__ import annotations

import io
import json

import pytest
from generation_toys import model_dir, one_torch_thread, reader, toy_model  # noqa: F401 (fixtures)

from lucidlm import cli
from lucidlm.chat import Conversation
from lucidlm.commands.chat import HELP_TEXT, chat_loop
from lucidlm.generation import generate


@pytest.fixture(autouse=True)
def only_our_commands(monkeypatch):
    """Build the parser from the generate and chat modules only, so these tests do not
    depend on every other command module being finished."""
    monkeypatch.setattr(cli, "COMMANDS", ("generate", "chat"))


@pytest.fixture(scope="module")
def model():
    return toy_model(seed=0)


def test_json_output_shape_and_values(model_dir, model, capsys):
    code = cli.main(["generate", "Hello", "--model", model_dir, "--temperature", "0", "--max-new-tokens", "12",
                     "--json"])
    out = capsys.readouterr().out
    assert code == 0
    assert out.count("\n") == 1  # exactly one line: one JSON object
    data = json.loads(out)
    assert set(data) == {"prompt_ids", "token_ids", "text", "finish_reason", "prompt_tokens", "new_tokens",
                         "load_seconds", "seconds", "tokens_per_second"}
    expected = generate(model, "Hello", temperature=0, max_new_tokens=12)
    assert {k: data[k] for k in ("prompt_ids", "token_ids", "text", "finish_reason")} == {
        "prompt_ids": list(b"Hello"), "token_ids": expected.token_ids, "text": expected.text,
        "finish_reason": expected.finish_reason}
    assert (data["prompt_tokens"], data["new_tokens"]) == (5, len(expected.token_ids))
    assert data["seconds"] > 0 and data["load_seconds"] > 0
    assert data["tokens_per_second"] == pytest.approx(data["new_tokens"] / data["seconds"], rel=0.02)


def test_plain_and_streamed_output_agree(model_dir, capsys):
    args = ["generate", "Hello", "--model", model_dir, "--temperature", "0.8", "--seed", "3", "--top-k", "20",
            "--max-new-tokens", "15", "--stop", "zz", "--stop", "qq"]
    assert cli.main(args) == 0
    plain = capsys.readouterr().out
    assert cli.main(args + ["--stream"]) == 0
    assert capsys.readouterr().out == plain


def test_beam_search_flags(model_dir, model, capsys):
    assert cli.main(["generate", "Hi", "--model", model_dir, "--num-beams", "3", "--length-penalty", "0.5",
                     "--max-new-tokens", "6", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["token_ids"] == generate(model, "Hi", num_beams=3, length_penalty=0.5, max_new_tokens=6).token_ids


@pytest.mark.parametrize("flags, fragment", [
    (["--temperature", "-1"], "--temperature -1 is invalid"),
    (["--top-p", "0"], "--top-p 0 is invalid: it must be in (0, 1]"),
    (["--num-beams", "0"], "--num-beams 0 is invalid"),
    (["--model", "/no/such/model"], "/no/such/model"),
])
def test_errors_are_one_line_with_exit_code_1(model_dir, capsys, flags, fragment):
    argv = ["generate", "Hello", "--model", model_dir, "-q"] + flags  # -q: no "loading ..." line
    assert cli.main(argv) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("lucidlm generate: error: ")
    assert captured.err.count("\n") == 1 and "Traceback" not in captured.err
    assert fragment in captured.err


def test_help_lists_every_flag_with_defaults(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["generate", "--help"])
    assert info.value.code == 0
    text = capsys.readouterr().out
    for flag in ("--model", "--adapter", "--max-new-tokens", "--temperature", "--top-k", "--top-p", "--min-p",
                 "--repetition-penalty", "--seed", "--num-beams", "--length-penalty", "--stop", "--chat",
                 "--stream", "--json", "--device", "--dtype"):
        assert flag in text
    assert "(default: 64)" in text


def test_chat_reads_lines_from_a_pipe(model_dir, model, monkeypatch, capsys):
    monkeypatch.setattr("sys.stdin", io.StringIO("Hi\n/reset\nHi\n"))
    assert cli.main(["chat", "--model", model_dir, "--temperature", "0", "--max-new-tokens", "6"]) == 0
    out = capsys.readouterr().out
    answer = generate(model, "Hi", chat=True, temperature=0, max_new_tokens=6).text
    assert out == f"{answer}\n(conversation reset)\n{answer}\n"


def test_chat_commands(model):
    out = io.StringIO()
    code = chat_loop(model, dict(temperature=0, max_new_tokens=5, stop_on_eos=False),
                     read_line=reader(["/system Be terse.", "Hi", "/bogus", "", "/exit", "never read"]), out=out)
    assert code == 0
    convo = Conversation(system="Be terse.")
    convo.add_user("Hi")
    answer = "".join(convo.reply(model, temperature=0, max_new_tokens=5, stop_on_eos=False))
    assert out.getvalue() == ("(system prompt set; conversation reset)\n" + answer + "\n"
                              "unknown command '/bogus'; " + HELP_TEXT + "\n")


def test_ctrl_c_during_an_answer_stops_only_that_answer(model, monkeypatch):
    calls = {"n": 0}
    original_step = model.step  # generation's forward pass (prefill and each decode step)

    def interrupted_step(*args, **kwargs):  # Ctrl-C arrives during the first answer's 3rd step
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return original_step(*args, **kwargs)

    monkeypatch.setattr(model, "step", interrupted_step)
    out = io.StringIO()
    assert chat_loop(model, dict(temperature=0, max_new_tokens=5, stop_on_eos=False),
                     read_line=reader(["Hi", "Hi again"]), out=out) == 0
    first, second = out.getvalue().split("\n")[:2]
    assert first.endswith(" [stopped]")
    assert not second.endswith(" [stopped]") and calls["n"] > 3  # the next answer ran
    assert model.kv_caches is None  # the cache was freed


def test_chat_exits_on_ctrl_c_and_ctrl_d_at_the_prompt(model):
    for exc in (KeyboardInterrupt, EOFError):
        def read_line(prompt, exc=exc):
            raise exc
        assert chat_loop(model, {}, read_line=read_line, out=io.StringIO()) == 0
