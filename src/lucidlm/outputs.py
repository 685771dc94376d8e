"""Output paths checked before any work starts, and one clear line when a write fails.

A run that trains for an hour and then finds that ``--out`` is a file, or sits under a file,
or that the disk is full, has wasted the hour. Every command and recipe checks where it will
write first (``check_output_dir`` / ``check_output_file``, which never create or change
anything), and wraps its writes in ``writing(path, flag)``, which turns a full disk or a
read-only target into one ``OutputError`` naming the path and the flag to change.

It imports nothing from lucidlm but its errors, so every layer can use it.
"""

from __future__ import annotations

import errno
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Union

from lucidlm.errors import OutputError

PathLike = Union[str, Path]
_NO_SPACE = {errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)}
# ENOENT too: a directory that cannot be made where it is asked for (under /proc), or one
# removed while it was being written; ENAMETOOLONG: a name the file system cannot hold (a path
# longer than PATH_MAX; a staging file's name is cut to fit, see staging._short)
_NOT_WRITABLE = {errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOENT, errno.ENAMETOOLONG}
# a directory where a file goes (OUT/config.json/), or a file where a directory goes
_IN_THE_WAY = {errno.EISDIR, errno.ENOTDIR}


def user_path(path: PathLike) -> Path:
    """``path`` as the user means it: a leading ``~`` is their home directory. A shell expands
    ``~`` only at the start of a word, not in ``--out=~/run`` or a quoted path, and never in
    Python's ``TrainConfig(out_dir="~/run")``; a literal directory named "~" is never meant."""
    return Path(os.path.expanduser(path))


def check_output_dir(path: PathLike, flag: str) -> Path:
    """``path`` (``user_path``) as a directory lucidlm may create or write into: not a file, not
    under a file, its nearest existing ancestor writable. Creates nothing; use the path it returns."""
    path = user_path(path)
    check_name_lengths(path, flag)
    if path.exists() and not path.is_dir():
        raise OutputError(f"{flag} {path} is a file, not a directory; give a directory path (it is created if "
                          f"needed).")
    _check_parents(path, flag)
    return path


def check_output_file(path: PathLike, flag: str) -> Path:
    """``path`` as a file lucidlm may write (an existing file is replaced): not a directory,
    not under a file, its directory writable. Creates nothing."""
    path = user_path(path)
    check_name_lengths(path, flag)
    if path.is_dir():
        raise OutputError(f"{flag} {path} is a directory; give a file path such as {path / 'report.html'}.")
    _check_parents(path, flag)
    return path


def foreign_entries(directory: Path, ours: tuple[str, ...]) -> list[str]:
    """Names in ``directory`` that lucidlm did not write, when none of ``ours`` is there (a
    directory holding any of ours is a lucidlm output; hidden staging files are ignored)."""
    if not directory.is_dir():
        return []
    names = sorted(p.name for p in directory.iterdir() if not p.name.startswith("."))
    is_ours = any(name == o or name.startswith(o + ".") for name in names for o in ours)  # also "loss.png.tmp"
    return [] if is_ours else names


@contextmanager
def writing(path: PathLike, flag: str) -> Iterator[None]:
    """Turn a full disk, a file too large for the file system, a read-only target or a directory in
    the way of a file while writing ``path`` into one ``OutputError`` naming the path and ``flag``;
    any other OSError is left as it is."""
    try:
        yield
    except OutputError:
        raise
    except OSError as exc:
        if exc.errno in _NO_SPACE:
            raise OutputError(f"No space left on device while writing {path}: free space or choose another "
                              f"{flag}.") from None
        if exc.errno == errno.EFBIG:  # FAT32's 4 GiB, or `ulimit -f` (Python ignores SIGXFSZ, so the write fails)
            raise OutputError(f"File too large while writing {path}: the file system (FAT32 holds at most "
                              f"4 GiB) or the file-size limit (ulimit -f) does not allow it; choose another "
                              f"{flag}.") from None
        if exc.errno in _NOT_WRITABLE:
            raise OutputError(f"cannot write {path} ({exc.strerror}): choose another {flag}.") from None
        if exc.errno in _IN_THE_WAY:  # the file named, not the staging file renamed onto it
            target = exc.filename2 or exc.filename or path
            raise OutputError(f"cannot write {target} ({exc.strerror}): move it out of the way or choose another "
                              f"{flag}.") from None
        raise


def check_name_lengths(path: Path, flag: str) -> None:
    """Refuse a name longer than the file system holds (255 bytes on Linux's) in one line naming
    ``flag``: ``Path.exists`` and ``is_dir`` pass ENAMETOOLONG on as an OSError."""
    try:
        os.lstat(path)
    except OSError as exc:
        if exc.errno == errno.ENAMETOOLONG:
            raise OutputError(f"{flag} {path}: a name in it is longer than the file system allows "
                              f"({exc.strerror}); choose a shorter {flag}.") from None
        # absent, or under a file: what the checks below say


def _check_parents(path: Path, flag: str) -> None:
    ancestor = path.parent
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise OutputError(f"{flag} {path}: {ancestor} is a file, so nothing can be written under it; choose "
                          f"another {flag}.")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise OutputError(f"{flag} {path}: {ancestor} is not writable; choose another {flag}.")
