"""The README's main command, run for real: a loading line at once on stderr, Paris on stdout."""

from __future__ import annotations

import pytest
from cli_run import run_cli


@pytest.mark.slow
def test_readme_main_command_in_a_real_process():
    done = run_cli("generate", "--chat", "--stream", "What is the capital of France?", "--seed", "0")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "Paris" in done.stdout
    assert done.stderr.startswith("loading smollm2-135m ...")
