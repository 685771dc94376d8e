"""Run the real ``lucidlm`` command in a subprocess, with this checkout's sources first on the path."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"


def cli_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]),
               HF_HUB_OFFLINE="1", PYTHONIOENCODING="utf-8")
    env.update(extra)
    return env


def run_cli(*args: str, stdin: str | None = None, python_flags: tuple[str, ...] = (),
            timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *python_flags, "-m", "lucidlm", *args], input=stdin, text=True,
                          capture_output=True, env=cli_env(), timeout=timeout)
