"""A bad sampling flag is refused as the user typed it (``--top-p 2``, ``/set temp -1``), not by
the Python keyword the check behind it uses (``top_p=2.0``), and before the model loads: the
Python API's checks (``check_options``) decide, the command line only names the flag. (The
loading line comes before the check, at once: tests/cli/test_cli_start.py.)"""

from __future__ import annotations

import io

import pytest

from lucidlm import cli
from lucidlm.commands.chat import ChatSession
from lucidlm.errors import GenerationError
from lucidlm.generation import check_options

# flag, bad value, the keyword the Python API names (and the CLI must not)
BAD_FLAGS = [
    ("--top-p", "2", "top_p="), ("--repetition-penalty", "-1", "repetition_penalty="),
    ("--temperature", "-0.5", "temperature="), ("--top-k", "-1", "top_k="), ("--min-p", "1.5", "min_p="),
    ("--typical-p", "0", "typical_p="), ("--epsilon-cutoff", "1", "epsilon_cutoff="),
    ("--eta-cutoff", "1", "eta_cutoff="), ("--max-new-tokens", "-1", "max_new_tokens="),
    ("--min-new-tokens", "-2", "min_new_tokens="), ("--seed", "-3", "seed="), ("--stop", "", "stop="),
]


@pytest.fixture
def no_loading(monkeypatch):
    import lucidlm

    def load(*args, **kwargs):
        raise AssertionError("a bad flag reached lucidlm.load")

    monkeypatch.setattr(lucidlm, "load", load)


@pytest.mark.parametrize("command", ["generate", "chat"])
@pytest.mark.parametrize("flag, value, keyword", BAD_FLAGS, ids=[f for f, _, _ in BAD_FLAGS])
def test_a_bad_sampling_flag_is_named_as_typed_before_loading(command, flag, value, keyword, no_loading, capsys):
    argv = ["generate", "hi"] if command == "generate" else ["chat"]
    assert cli.main([*argv, flag, value]) != 0
    err = capsys.readouterr().err
    shown = f"{flag} {value or chr(39) * 2}"  # --stop '' as a shell would take it back
    assert f"error: {shown} is invalid" in err, err
    assert keyword not in err, err


def test_beam_flags_are_named_as_typed(no_loading, capsys):
    assert cli.main(["generate", "hi", "--num-beams", "0"]) != 0
    assert "--num-beams 0 is invalid" in capsys.readouterr().err
    assert cli.main(["generate", "hi", "--num-beams", "2", "--length-penalty", "100"]) != 0
    assert "--length-penalty 100 is invalid" in capsys.readouterr().err


def test_the_python_api_still_names_its_keywords():
    with pytest.raises(GenerationError, match=r"^top_p=2 is invalid"):
        check_options(top_p=2)
    with pytest.raises(GenerationError, match=r"^repetition_penalty=-1 is invalid"):
        check_options(repetition_penalty=-1)


@pytest.mark.parametrize("line, shown", [
    ("top_p 7", "/set top_p 7 is invalid: it must be in (0, 1]"),
    ("temp -1", "/set temp -1 is invalid"),  # an alias, named as typed
    ("parameter top-k -2", "/set top-k -2 is invalid"),
    ("top_k 1.5", "/set top_k 1.5 is invalid: expected a whole number"),  # not int()'s "invalid literal"
    ("max_new_tokens -1", "/set max_new_tokens -1 is invalid"),
])
def test_chat_set_names_what_was_typed(line, shown):
    out = io.StringIO()
    session = ChatSession(model=None, gen_kwargs={"temperature": 0.2, "top_k": None}, system=None, out=out,
                          verbose=False)
    session.set(line)
    said = out.getvalue()
    assert said.startswith(shown), said
    assert "=" not in said.split(" is invalid")[0] and "literal" not in said, said
    assert session.settings == {"temperature": 0.2, "top_k": None}  # refused: nothing changed


@pytest.mark.parametrize("argv, message", [
    (["--suppress-tokens", "99999"], "--suppress-tokens names token id 99999, outside this model's vocabulary "
                                     "0..49151"),
    (["--logit-bias", "99999=1"], "--logit-bias names token id 99999, outside this model's vocabulary"),
    (["--sequence-bias", "5,99999=1"], "--sequence-bias names token id 99999, outside this model's vocabulary"),
    (["--bad-words-ids", "2"], "--bad-words-ids bans the end token 2 alone, which transformers leaves possible "
                               "(it drops EOS from its bans); to forbid it, use --suppress-tokens 2 (or "
                               "--min-new-tokens to delay it)."),
    (["--bad-words", "<|im_end|>"], "--bad-words '<|im_end|>' is the end token 2 alone, which transformers' word "
                                    "ban silently leaves possible, so lucidlm refuses it; to forbid it, use "
                                    "--suppress-tokens 2 (or --min-new-tokens to delay it)."),
])
def test_token_ids_the_model_refuses_are_named_by_their_flags(argv, message, capsys):
    """Checked once the model has loaded (the vocabulary and the end token are its own), and said
    in the command line's words, not the Python keywords (suppress_tokens=[2]) behind them.
    SmolLM2: 49152 tokens, <|im_end|> = 2 ends an answer."""
    for command in (["generate", "hi"], ["chat"]):
        assert cli.main([*command, "-q", *argv]) == 1
        err = capsys.readouterr().err
        assert message in err, err
        assert not any(keyword in err for keyword in ("suppress_tokens", "bad_words_ids", "logit_bias", "sequence_bias",
                                                      "min_new_tokens")), err
