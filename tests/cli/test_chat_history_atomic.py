"""The chat history (``<cache>/chat_history``) survives a failed write: GNU readline's own
``write_history_file`` counts a short write (a full disk, a file-size limit) as done and renames
the cut file over the history, which kept only its first bytes. GNU readline is the oracle for
the format: it reads back what lucidlm wrote, entry for entry."""

from __future__ import annotations

import os
import stat

import pytest
from file_limits import file_size_limit

from lucidlm.commands.chat_input import HISTORY_LENGTH, enable_line_editing

readline = pytest.importorskip("readline")
pytestmark = pytest.mark.skipif("libedit" in (readline.__doc__ or ""), reason="GNU readline's history file")


@pytest.fixture
def history():
    readline.clear_history()
    yield
    readline.clear_history()


def entries() -> list[str]:
    return [readline.get_history_item(i) for i in range(1, readline.get_current_history_length() + 1)]


def test_a_failed_history_write_keeps_the_earlier_history(tmp_path, history):
    path = tmp_path / "chat_history"
    typed = [f"message number {i}: what is {i} + {i}?" for i in range(20)]
    path.write_text("".join(line + "\n" for line in typed))
    save = enable_line_editing(path)
    assert entries() == typed  # read by readline
    readline.add_history("/set temperature 0.3")
    before = path.read_bytes()
    with file_size_limit():
        save()  # the disk is full: nothing to say, the history stays as it was
    assert path.read_bytes() == before and [p.name for p in tmp_path.iterdir()] == ["chat_history"]

    save()
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600  # what the user typed stays private
    readline.clear_history()
    readline.read_history_file(str(path))
    assert entries() == [*typed, "/set temperature 0.3"]


def test_the_history_keeps_its_last_entries(tmp_path, history):
    save = enable_line_editing(tmp_path / "chat_history")
    for i in range(HISTORY_LENGTH + 5):
        readline.add_history(f"line {i}")
    save()
    readline.clear_history()
    readline.read_history_file(str(tmp_path / "chat_history"))
    assert entries() == [f"line {i}" for i in range(5, HISTORY_LENGTH + 5)]


def test_a_symlinked_history_is_written_where_it_points_as_readline_writes_it(tmp_path, history):
    kept = tmp_path / "dotfiles" / "lucidlm_history"
    kept.parent.mkdir()
    readline.add_history("first")
    readline.write_history_file(str(kept))  # readline itself, through the link below, is the oracle
    link = tmp_path / "chat_history"
    link.symlink_to(kept)
    readline.add_history("second")
    readline.write_history_file(str(link))
    theirs = kept.read_bytes()
    assert link.is_symlink()
    kept.write_text("first\n")
    readline.clear_history()
    save = enable_line_editing(link)
    readline.add_history("second")
    save()
    assert link.is_symlink() and kept.read_bytes() == theirs


def test_a_history_byte_that_is_not_utf8_is_written_back_as_readline_writes_it(tmp_path, history):
    # a history from a Latin-1 terminal: Python's readline hands the byte over as a lone surrogate
    path = tmp_path / "chat_history"
    path.write_bytes(b"caf\xe9 au lait\n")
    save = enable_line_editing(path)
    readline.add_history("na\u00efve \u65e5\u672c")
    readline.write_history_file(str(tmp_path / "readline_wrote"))  # the oracle
    save()  # was a UnicodeEncodeError ('surrogates not allowed') at chat's exit
    assert path.read_bytes() == (tmp_path / "readline_wrote").read_bytes()


def test_a_history_link_into_a_missing_folder_makes_no_folder_as_readline_makes_none(tmp_path, history):
    link, ours = tmp_path / "readline" / "chat_history", tmp_path / "lucidlm" / "chat_history"
    for made in (link, ours):
        made.parent.mkdir()
        made.symlink_to(tmp_path / made.parent.name / "dotfiles" / "history")  # not cloned yet
    readline.add_history("hello")
    with pytest.raises(OSError):
        readline.write_history_file(str(link))  # the oracle: it fails, and makes nothing
    save = enable_line_editing(ours)
    readline.add_history("hello")
    save()  # made OURS/../dotfiles/, where a later git clone of the dotfiles then refuses to go
    assert sorted(p.name for p in ours.parent.iterdir()) == sorted(p.name for p in link.parent.iterdir())


def test_a_history_linked_to_a_pipe_or_device_is_written_into_it(tmp_path, history):
    # ln -s /dev/null chat_history turns a history off; the staging write renamed a file over
    # the link's target (as root, over /dev/null itself). A FIFO stands in for the device here.
    fifo, link = tmp_path / "fifo", tmp_path / "chat_history"
    save = enable_line_editing(link)  # before the link: reading a FIFO waits for a writer
    os.mkfifo(fifo)
    link.symlink_to(fifo)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    try:
        readline.add_history("hello")
        save()
        assert stat.S_ISFIFO(os.lstat(fifo).st_mode) and link.is_symlink()
        readline.write_history_file(str(tmp_path / "readline_wrote"))  # the oracle for what goes in
        assert os.read(reader, 1 << 16) == (tmp_path / "readline_wrote").read_bytes()
    finally:
        os.close(reader)
