"""The contract every hostile or careless input must meet, checked the same way for each case.

A CLI case (``refused``) runs the real ``lucidlm`` command in a subprocess, under a wall-clock
limit (a hang fails) and an address-space limit (a multi-GB allocation fails), and asserts:
exit status != 0, no traceback, the last line on stderr is lucidlm's one-line error (never the
last-resort "internal error" line that means a bug), the message names what it should, and no
file under the watched paths was changed, added or removed.

A Python-API case (``api_refused``) asserts the call raises one of lucidlm's own errors (not a
bare ValueError/TypeError/KeyError) whose message names what it should, and that nothing
watched on disk changed.
"""

from __future__ import annotations

import hashlib
import os
import re
import resource
import subprocess
import sys
from pathlib import Path
from typing import Callable, Iterable, Optional, Union

import pytest

from lucidlm.cli import INTERNAL_ERROR
from lucidlm.errors import LucidLMError

SRC = Path(__file__).resolve().parents[2] / "src"
MEMORY_LIMIT = 6 << 30   # bytes of address space a refused input may reach (torch alone maps ~1-2 GB)
_HELP_HINT = re.compile(r"^\(see `lucidlm( \w+)? --help`\)$")
TIME_LIMIT = 120         # seconds; a hang is a failure, not a slow test


def snapshot(paths: Iterable[Union[str, Path]]) -> dict[str, str]:
    """Path -> sha256 of every file under ``paths`` (files or directories)."""
    found: dict[str, str] = {}
    for root in map(Path, paths):
        files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file()) if root.exists() else []
        for file in files:
            found[str(file)] = hashlib.sha256(file.read_bytes()).hexdigest()
    return found


def _limit_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))


def refused(*args: Union[str, bytes], names: Iterable[str] = (), watch: Iterable[Union[str, Path]] = (),
            stdin: Optional[bytes] = None, env: Optional[dict] = None, cwd: Optional[Path] = None,
            timeout: float = TIME_LIMIT) -> str:
    """Run ``lucidlm *args``; assert it is refused cleanly (see the module docstring). Returns the
    error line. ``names`` are regexes (case-insensitive) the error line must each match."""
    watch = list(watch)
    before = snapshot(watch)
    full_env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]),
                    HF_HUB_OFFLINE="1", PYTHONIOENCODING="utf-8")
    full_env.pop("LUCIDLM_DEBUG", None)
    full_env.update(env or {})
    try:
        done = subprocess.run([sys.executable, "-m", "lucidlm", *args], input=stdin, capture_output=True,
                              env=full_env, cwd=cwd, timeout=timeout, preexec_fn=_limit_memory)
    except subprocess.TimeoutExpired:
        pytest.fail(f"lucidlm {_show(args)} hung (no answer within {timeout:.0f} s)")
    err = done.stderr.decode("utf-8", "replace")
    shown = f"lucidlm {_show(args)}\nexit {done.returncode}\nstderr:\n{err[-3000:]}"
    assert done.returncode != 0, f"bad input was accepted:\n{shown}"
    assert "Traceback" not in err, f"traceback instead of one line:\n{shown}"
    assert INTERNAL_ERROR not in err, f"reached the last-resort handler (a bug):\n{shown}"
    # argparse's refusals (a bad flag value) end with a "(see `lucidlm CMD --help`)" hint line
    lines = [line for line in err.splitlines() if line.strip() and not _HELP_HINT.match(line)]
    assert lines, f"refused without saying why:\n{shown}"
    line = lines[-1]
    assert re.match(r"lucidlm( \w+)?: (error|interrupted)", line), f"last line is not lucidlm's error:\n{shown}"
    for name in names:
        assert re.search(name, line, re.IGNORECASE), f"the error does not name {name!r}:\n{shown}"
    assert snapshot(watch) == before, f"files on disk changed:\n{shown}"
    return line


def main_refused(*args: str, names: Iterable[str] = (), watch: Iterable[Union[str, Path]] = ()) -> str:
    """``refused`` in-process: ``lucidlm.cli.main(args)`` with the same assertions, for cases
    where the command line itself is the point (argument checks that run before any model
    loads) and a subprocess per case would only add seconds. Returns the error line."""
    import contextlib
    import io

    from lucidlm import cli

    watch = list(watch)
    before = snapshot(watch)
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            code = cli.main(list(args))
        except SystemExit as exc:  # argparse refuses a malformed value with exit 2
            code = exc.code
    text = err.getvalue()
    shown = f"lucidlm {_show(args)}\nexit {code}\nstderr:\n{text[-3000:]}"
    assert code not in (0, None), f"bad input was accepted:\n{shown}"
    assert INTERNAL_ERROR not in text and "Traceback" not in text, f"not lucidlm's one-line error:\n{shown}"
    lines = [line for line in text.splitlines() if line.strip() and not _HELP_HINT.match(line)]
    assert lines and re.match(r"lucidlm( \w+)?: error", lines[-1]), f"last line is not lucidlm's error:\n{shown}"
    for name in names:
        assert re.search(name, lines[-1], re.IGNORECASE), f"the error does not name {name!r}:\n{shown}"
    assert snapshot(watch) == before, f"files on disk changed:\n{shown}"
    return lines[-1]


def api_refused(call: Callable[[], object], error: type = LucidLMError, names: Iterable[str] = (),
                watch: Iterable[Union[str, Path]] = ()) -> LucidLMError:
    """Assert ``call()`` raises lucidlm's ``error`` naming each of ``names``; returns it."""
    watch = list(watch)
    before = snapshot(watch)
    with pytest.raises(LucidLMError) as info:
        call()
    assert isinstance(info.value, error), f"{type(info.value).__name__} is not a {error.__name__}: {info.value}"
    message = str(info.value)
    assert "\n" not in message.strip(), f"error is more than one line: {message!r}"
    for name in names:
        assert re.search(name, message, re.IGNORECASE), f"the error does not name {name!r}: {message}"
    assert snapshot(watch) == before, "files on disk changed"
    return info.value


def _show(args: tuple) -> str:
    return " ".join(a.decode("utf-8", "replace") if isinstance(a, bytes) else a for a in args)[:300]


def filling_disk(real_staging_file: Callable, after: int = 0, only_under: Optional[Path] = None) -> Callable:
    """A stand-in for ``staging.staging_file`` whose writer finds the disk full (ENOSPC) once
    ``after`` bytes are in the file; files staged outside ``only_under`` (when given) write
    normally."""
    import errno

    def staging_file(path):
        out, name = real_staging_file(path)
        if only_under is not None and Path(path).parent != only_under:
            return out, name

        class Full:
            def __enter__(self):
                return self

            def __exit__(self, *exc):
                out.close()

            def write(self, block):
                if out.tell() >= after:
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                return out.write(block)
        return Full(), name
    return staging_file

