"""How ``lucidlm chat`` reads what the user types: line editing, history, multi-line messages.

On a terminal, GNU readline gives arrow-key editing, Ctrl-R search and a history kept in
``<lucidlm cache>/chat_history`` across sessions. Readline also reads the line itself (not the
terminal's canonical mode, which cuts a line at 4095 bytes), so a paste of any length
arrives whole; with bracketed paste on, a multi-line paste is one message, not one per line.
A message can also span lines between two ``\"\"\"`` (ollama's convention).
"""

from __future__ import annotations

import locale
import os
from pathlib import Path
from typing import Callable, Optional

HISTORY_LENGTH = 1000
MULTILINE = '"""'

ReadLine = Callable[[str], str]


def history_path() -> Path:
    from lucidlm.cache_dir import cache_root

    return cache_root() / "chat_history"


def enable_line_editing(path: Optional[Path] = None) -> Callable[[], None]:
    """Turn on readline for ``input()`` and load the history; returns the function that saves it."""
    try:
        import readline
    except ImportError:  # e.g. Windows without pyreadline: plain input() still works
        return lambda: None
    path = path or history_path()
    if "libedit" not in (readline.__doc__ or ""):
        readline.parse_and_bind("set enable-bracketed-paste on")  # a pasted block is one input
    readline.set_history_length(HISTORY_LENGTH)
    try:
        readline.read_history_file(path)
    except OSError:  # no history yet, or unreadable: start a new one
        pass

    def save() -> None:
        from lucidlm.staging import atomic_write_bytes

        try:
            path.parent.mkdir(parents=True, exist_ok=True)  # the cache directory
            if "libedit" in (readline.__doc__ or ""):  # its own escaped format: only it writes that
                readline.write_history_file(path)
            else:  # GNU readline counts a short write (a full disk) as done and renames the cut file into place
                lines = "".join(line + "\n" for line in _history(readline)[-HISTORY_LENGTH:])
                # private, as readline makes it (what the user typed), and through a symbolic link
                # to the file it names, as readline writes it (a history kept with one's dotfiles)
                target = Path(os.path.realpath(path))
                if not target.parent.is_dir():  # a link into a folder not there (dotfiles not cloned yet):
                    return  # readline's write fails; making the folder would block that clone
                atomic_write_bytes(target, _as_readline_writes(lines), 0o600)
        except OSError:  # the earlier history stays as it was
            pass
    return save


def _history(readline) -> list[str]:
    """The session's history, oldest first, as GNU readline writes it: one line per entry."""
    return [readline.get_history_item(i) or "" for i in range(1, readline.get_current_history_length() + 1)]


def _as_readline_writes(text: str) -> bytes:
    """``text`` in the bytes readline stores: Python's readline module decodes the history with the
    locale's encoding and surrogateescape, so a history written in another encoding (a Latin-1
    byte) comes back as a lone surrogate, which UTF-8 refuses (UnicodeEncodeError at chat's exit)."""
    return text.encode(locale.getencoding(), "surrogateescape")


def read_message(read_line: ReadLine, prompt: str, more_prompt: str) -> str:
    """One message: a line, or every line from an opening to a closing ``\"\"\"``.
    EOFError / KeyboardInterrupt propagate (the caller decides what they mean)."""
    line = read_line(prompt)
    if not line.lstrip().startswith(MULTILINE):
        return line
    first = line.lstrip()[len(MULTILINE):]
    if first.rstrip().endswith(MULTILINE):  # """one line"""
        return first.rstrip()[:-len(MULTILINE)]
    lines = [first] if first.strip() else []
    while True:
        line = read_line(more_prompt)
        if line.rstrip().endswith(MULTILINE):
            last = line.rstrip()[:-len(MULTILINE)]
            if last:
                lines.append(last)
            return "\n".join(lines)
        lines.append(line)
