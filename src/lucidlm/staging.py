"""Staging files: write beside the target under a temporary name, rename into place, and clean
up what a killed process left behind without touching a live process's work.

Every temporary file lucidlm writes next to a real one (a joined GGUF, a saved model's
safetensors, a JSON file) is named ``.<target>.partial-<host>-<pid>-<random>``. A kill -9
leaves it behind; the next write into the same directory removes it, but only when it is
proved stale: written on this host by a process that no longer exists (``os.kill(pid, 0)``),
or untouched for a day (another host's, or a name without a pid from an older lucidlm).
A file being written by a concurrent process is never removed.
"""

from __future__ import annotations

import glob
import hashlib
import os
import re
import shutil
import socket
import stat
import tempfile
import time
from pathlib import Path
from contextlib import contextmanager
from typing import IO, Iterable, Iterator, Optional

STALE_AFTER = 24 * 3600  # seconds: a staging file nobody wrote to for this long is abandoned
NAME_MAX = 255  # bytes in one name on Linux's and macOS's file systems
# what a staging name adds to its target's: ".", ".partial-", the owner marker (host, a pid of up
# to 10 digits) and mkstemp's 8 random characters
_ADDED = len("..partial-") + 8 + 1 + 10 + 1 + 8
_NAME = re.compile(r"[.-](?:partial|tmp|old)-(?P<host>[0-9a-f]{8})-(?P<pid>\d+)-")


def _host() -> str:
    return hashlib.sha256(socket.gethostname().encode("utf-8", "replace")).hexdigest()[:8]


def staging_prefix(target_name: str, pid: int | None = None) -> str:
    """The name prefix of the staging files of process ``pid`` (default: this one) for ``target_name``."""
    return f".{_short(target_name)}.partial-{owner_marker(pid)}"


def _short(target_name: str) -> str:
    """``target_name`` as its staging names carry it: cut, with a hash of the whole to keep
    targets apart, when it is too long to fit beside what they add (a target of 220-255 bytes,
    which the file system holds, failed with ENAMETOOLONG at its staging file)."""
    whole = os.fsencode(target_name)
    if len(whole) <= NAME_MAX - _ADDED:
        return target_name
    kept = whole[:NAME_MAX - _ADDED - 9].decode("utf-8", "ignore")  # never half a character
    return f"{kept}~{hashlib.sha256(whole).hexdigest()[:8]}"


def staging_file(target: Path) -> tuple[IO[bytes], Path]:
    """(open binary file, its path): a fresh staging file beside ``target``, old stale ones
    for the same target removed first."""
    remove_stale(target.parent, target.name)
    fd, name = tempfile.mkstemp(dir=target.parent, prefix=staging_prefix(target.name))
    return os.fdopen(fd, "wb"), Path(name)


def publish(staging: Path, target: Path, mode: int = 0o666) -> None:
    """Rename a complete staging file over ``target`` (atomic on one filesystem), with the
    permissions an ordinary file gets (mkstemp makes it private)."""
    os.chmod(staging, ordinary_mode(mode))
    os.replace(staging, target)


def ordinary_mode(mode: int = 0o666) -> int:
    """``mode`` less the process umask: the permissions ``open``/``mkdir`` would give a new file
    (0o666) or directory (0o777). ``mkstemp``/``mkdtemp`` make theirs private (0o600/0o700)."""
    umask = os.umask(0)
    os.umask(umask)
    return mode & ~umask


def atomic_write_text(path: Path, text: str, mode: int = 0o644) -> None:
    """Write ``text`` (UTF-8) to ``path`` through a staging file: readers see the old file or
    the whole new one, never a part. Ordinary permissions (mkstemp makes files private)."""
    atomic_write_bytes(path, text.encode("utf-8"), mode)


def atomic_write_bytes(path: Path, data: bytes, mode: int = 0o644) -> None:
    """``atomic_write_text`` for bytes (a rendered figure): a failed write (a full disk) leaves
    the previous file whole and no staging file behind. A pipe or a device (``/dev/stdout``, a
    FIFO) is written into as it is: a file renamed over it would replace it, and it keeps nothing."""
    if _is_special(path):
        with open(path, "wb") as out:
            out.write(data)
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    out, staging = staging_file(path)
    try:
        with out:
            out.write(data)
        publish(staging, path, mode)
    finally:
        staging.unlink(missing_ok=True)


def _is_special(path: Path) -> bool:
    """Whether ``path`` (through a symbolic link) is something other than a file or a directory."""
    try:
        mode = os.stat(path).st_mode
    except (OSError, ValueError):  # absent (or a name stat refuses): a file is made
        return False
    return not (stat.S_ISREG(mode) or stat.S_ISDIR(mode))


def owner_marker(pid: int | None = None) -> str:
    """``<host>-<pid>-``: what a staging name carries to say who is writing it (default: us)."""
    return f"{_host()}-{os.getpid() if pid is None else pid}-"


def owner_alive(name: str) -> bool | None:
    """Whether the process named in staging name ``name`` still runs: None when the name
    carries no owner on this host (an older lucidlm's name, or another machine's)."""
    match = _NAME.search(name)
    if not match or match.group("host") != _host():
        return None
    return _alive(int(match.group("pid")))


def is_stale(path: Path, now: float | None = None) -> bool:
    """True when the staging file ``path`` provably belongs to no live writer."""
    try:
        age = (time.time() if now is None else now) - path.lstat().st_mtime
    except OSError:
        return False  # already gone (or unreadable): nothing to do
    return owner_alive(path.name) is False or age > STALE_AFTER


def remove_stale(directory: Path, target_name: str) -> list[Path]:
    """Remove the stale staging files (or directories) for ``target_name`` in ``directory``;
    the removed paths. Never raises: cleaning up must not break the write it precedes."""
    removed = []
    for path in _candidates(directory, target_name):
        if not is_stale(path):
            continue
        try:
            remove_entry(path)
            removed.append(path)
        except OSError:
            pass  # read-only directory, raced with another cleaner: harmless
    return removed


def remove_entry(path: Path) -> None:
    """Delete a file or a directory tree; a symlink (to a file or a directory) is unlinked,
    never followed: what it points to stays. Raises OSError when it cannot."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink()


def _candidates(directory: Path, target_name: str) -> Iterator[Path]:
    escaped = glob.escape(_short(target_name))
    # ours, and the names older lucidlm versions used (".<name>.partial-XXXX", ".<name>.XXXX.tmp")
    for pattern in (f".{escaped}.partial-*", f".{escaped}.*.tmp"):
        try:
            yield from Path(directory).glob(pattern)
        except OSError:
            return


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, ValueError):
        return True  # someone else's process (or a pid we cannot ask about): keep its file
    return True


@contextmanager
def replacing_files(directory: Path, names: Iterable[str]) -> Iterator[list[str]]:
    """Around a write of several files into ``directory`` (a model save): once it has succeeded,
    remove the files called ``names`` that were there before and that the write did not rewrite
    (an earlier save's leftovers), and fill the yielded list with the names of the files the write
    wrote. A name ending in "/" is a directory (transformers' ``additional_chat_templates/``),
    removed whole, with what it holds, when the write added or removed no entry in it (a symbolic
    link to one is kept, and its target). Any other file (the user's) is left alone; a failed
    write removes nothing."""
    names = list(names)  # read twice below: a generator would leave the second set empty
    folders = {name.rstrip("/") for name in names if name.endswith("/")}
    ours = {name for name in names if not name.endswith("/")}
    before = {path.name: _stamp(path) for path in _plain_files(directory)}
    folders_before = {name: _stamp(directory / name) for name in folders if _is_real_dir(directory / name)}
    written: list[str] = []
    yield written
    for path in _plain_files(directory):
        if before.get(path.name) != _stamp(path):  # new, or replaced (atomic writes make a new file)
            written.append(path.name)
        elif path.name in ours and path.is_file():
            path.unlink()
    for name, stamp in folders_before.items():
        if _is_real_dir(directory / name) and _stamp(directory / name) == stamp:  # nothing written into it
            remove_entry(directory / name)
    written.sort()


def _is_real_dir(path: Path) -> bool:
    """A directory, not a symbolic link to one (whose target is not ours to remove)."""
    return path.is_dir() and not path.is_symlink()


def _plain_files(directory: Path) -> list[Path]:
    """The plain files of ``directory`` (staging files, which start with ".", left out)."""
    if not directory.is_dir():
        return []
    return [p for p in directory.iterdir() if not p.name.startswith(".") and p.is_file() and not p.is_symlink()]


def _stamp(path: Path) -> Optional[tuple[int, int, int, int]]:
    """What changes when a file is written: a new inode (written beside and renamed in), or the
    modification and change times and the size (written in place)."""
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return st.st_ino, st.st_mtime_ns, st.st_ctime_ns, st.st_size
