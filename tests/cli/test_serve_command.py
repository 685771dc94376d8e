"""``lucidlm serve`` as a user runs it: a real process that says where it listens, answers, and
stops cleanly at Ctrl-C; its flags refused before the model loads. (The API itself:
tests/serving/test_openai_server.py.)"""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import sys
import threading
import urllib.request

import pytest
from cli_run import cli_env


def test_serve_says_where_it_listens_answers_and_stops_at_ctrl_c():
    import lucidlm
    from lucidlm.generation import generate

    process = subprocess.Popen([sys.executable, "-m", "lucidlm", "serve", "--port", "0"], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, env=cli_env())
    try:
        lines: list[str] = []
        reader = threading.Thread(target=lambda: lines.append(process.stdout.readline()), daemon=True)
        reader.start()
        reader.join(timeout=120)
        assert lines and lines[0], "no line on stdout within 120 s"
        listening = re.fullmatch(r"lucidlm serve: (http://127\.0\.0\.1:(\d+)/v1) \(model smollm2-135m\)\n", lines[0])
        assert listening, lines[0]
        request = urllib.request.Request(f"{listening.group(1)}/completions", method="POST", data=json.dumps(
            {"model": "smollm2-135m", "prompt": "The capital of France is", "max_tokens": 5,
             "temperature": 0}).encode(), headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=120) as response:
            answer = json.loads(response.read())
        want = generate(lucidlm.load(), "The capital of France is", max_new_tokens=5, temperature=0)
        assert answer["choices"][0]["text"] == want.text and answer["model"] == "smollm2-135m"
        process.send_signal(signal.SIGINT)
        out, err = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    assert process.returncode == 0, err[-2000:]
    assert err.startswith("loading smollm2-135m ...\n")
    assert '"POST /v1/completions HTTP/1.1" 200' in err  # the request log
    assert err.endswith("lucidlm serve: stopped\n") and "Traceback" not in err


def test_a_port_in_use_is_refused_before_the_model_loads(capsys, monkeypatch):
    import lucidlm
    from lucidlm.cli import main

    monkeypatch.setattr(lucidlm, "load", lambda *a, **k: pytest.fail("loaded a model for a port it cannot use"))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve", "-q", "--port", str(port)]) == 1
    err = capsys.readouterr().err
    assert err == (f"lucidlm serve: error: cannot listen on 127.0.0.1:{port}: Address already in use; choose "
                   f"another --port (0 picks a free one) or --host.\n")


@pytest.mark.parametrize("port", ["70000", "-1", "http"])
def test_a_port_that_is_no_port_is_refused_by_argparse(port, capsys):
    from lucidlm.cli import main

    with pytest.raises(SystemExit) as exited:
        main(["serve", "--port", port])
    assert exited.value.code == 2
    assert f"argument --port: '{port}' is not a port: give a whole number from 1 to 65535, or 0 for a free one." \
        in capsys.readouterr().err


def test_draft_flags_are_checked_before_the_model_loads(capsys, monkeypatch, tmp_path):
    import lucidlm
    from lucidlm.cli import main

    monkeypatch.setattr(lucidlm, "load", lambda *a, **k: pytest.fail("loaded a model for flags it refuses"))
    assert main(["serve", "-q", "--port", "0", "--draft-tokens", "3"]) == 1
    assert "--draft-tokens 3 needs --draft" in capsys.readouterr().err
    assert main(["serve", "-q", "--port", "0", "--draft", str(tmp_path / "nowhere")]) == 1
    assert f"--draft {tmp_path / 'nowhere'}: no such file or directory" in capsys.readouterr().err


@pytest.mark.parametrize("rows", ["0", "-2", "2.5", "four"])
def test_parallel_that_is_no_number_of_rows_is_refused_by_argparse(rows, capsys):
    from lucidlm.cli import main

    with pytest.raises(SystemExit) as exited:
        main(["serve", "--parallel", rows])
    assert exited.value.code == 2
    assert f"argument --parallel/-np: '{rows}' is not a number of rows: give a whole number >= 1, the most " \
           f"requests' rows decoded as one batch (1: one request at a time)." in capsys.readouterr().err


def test_parallel_reaches_the_server_and_its_default_is_the_servers(monkeypatch):
    """The default is spelled out in the command (its --help imports no torch): it must be the server's."""
    from lucidlm.cli import main
    from lucidlm.commands.serve import DEFAULT_PARALLEL
    from lucidlm.serving import http_server

    assert DEFAULT_PARALLEL == http_server.DEFAULT_PARALLEL
    seen = []

    def not_listening(self, *args, parallel, **kwargs):
        seen.append(parallel)
        raise OSError(98, "stop here")

    monkeypatch.setattr(http_server.OpenAIServer, "__init__", not_listening)
    assert main(["serve", "-q", "--port", "0", "-np", "8"]) == 1
    assert main(["serve", "-q", "--port", "0"]) == 1
    assert seen == [8, DEFAULT_PARALLEL]


def test_cont_batching_is_on_unless_no_cont_batching_says_otherwise(monkeypatch):
    from lucidlm.cli import main
    from lucidlm.serving import http_server

    seen = []

    def not_listening(self, *args, cont_batching, **kwargs):
        seen.append(cont_batching)
        raise OSError(98, "stop here")

    monkeypatch.setattr(http_server.OpenAIServer, "__init__", not_listening)
    for flags in ([], ["--no-cont-batching"], ["--cont-batching"], ["-cb"]):
        assert main(["serve", "-q", "--port", "0", *flags]) == 1
    assert seen == [True, False, True, True]
