"""The CLI's last-resort handler: an unexpected exception (a bug) is one line that says so and
how to see the traceback; ``LUCIDLM_DEBUG=1`` shows the traceback itself."""

from __future__ import annotations

import pytest

from lucidlm import cli


def _buggy_parser(commands=None):
    parser = cli.Parser(prog="lucidlm")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("generate").set_defaults(handler=lambda args: {}["no such key"])
    return parser


def test_a_bug_is_one_line_naming_the_debug_switch(monkeypatch, capsys):
    monkeypatch.delenv("LUCIDLM_DEBUG", raising=False)
    monkeypatch.setattr(cli, "build_parser", _buggy_parser)
    assert cli.main(["generate"]) == 70
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith(f"lucidlm generate: {cli.INTERNAL_ERROR} (KeyError: 'no such key')")
    assert "LUCIDLM_DEBUG=1" in err and "bug" in err


def test_debug_switch_shows_the_traceback(monkeypatch):
    monkeypatch.setenv("LUCIDLM_DEBUG", "1")
    monkeypatch.setattr(cli, "build_parser", _buggy_parser)
    with pytest.raises(KeyError, match="no such key"):
        cli.main(["generate"])


def test_own_errors_do_not_reach_the_handler(monkeypatch, capsys):
    from lucidlm.errors import ConfigError

    def parser(commands=None):
        p = _buggy_parser()
        p._subparsers._group_actions[0].choices["generate"].set_defaults(
            handler=lambda args: (_ for _ in ()).throw(ConfigError("config.json: field 'x' is -1")))
        return p

    monkeypatch.setattr(cli, "build_parser", parser)
    assert cli.main(["generate"]) == 1
    err = capsys.readouterr().err
    assert err == "lucidlm generate: error: config.json: field 'x' is -1\n"
