"""The suite's own rule: under CI=true a skipped test is a failure (tests/conftest.py)."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

CONFTEST = Path(__file__).with_name("conftest.py")

SKIPPING_TESTS = '''
import pytest

def test_skips():
    pytest.skip("the oracle is missing")

def test_passes():
    pass
'''


def _run_pytest(tmp_path: Path, ci: str) -> subprocess.CompletedProcess:
    tests = tmp_path / "tests"
    tests.mkdir()
    shutil.copy(CONFTEST, tests / "conftest.py")
    (tests / "test_skipping.py").write_text(SKIPPING_TESTS)
    env = {**os.environ, "CI": ci}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tests)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)


def test_a_skip_fails_the_run_in_ci(tmp_path):
    result = _run_pytest(tmp_path, "true")
    assert result.returncode == 1, result.stdout
    assert "1 failed, 1 passed" in result.stdout
    assert "the oracle is missing" in result.stdout  # the skip's own reason is shown


def test_a_skip_is_only_a_skip_outside_ci(tmp_path):
    result = _run_pytest(tmp_path, "")
    assert result.returncode == 0, result.stdout
    assert "1 passed, 1 skipped" in result.stdout
