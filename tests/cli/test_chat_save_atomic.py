"""The chat REPL's /save goes through a staging file: a write that fails leaves the file an
earlier /save wrote whole and /load-able, and says why."""

from __future__ import annotations

import errno
import io
import json

import lucidlm.staging
from lucidlm.commands.chat import ChatSession


def session(out: io.StringIO) -> ChatSession:
    chat = ChatSession(model=None, gen_kwargs={"temperature": 0.2}, system="Be brief.", out=out, verbose=False)
    chat.convo.history.extend([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}])
    return chat


def test_a_failed_save_keeps_the_earlier_file(tmp_path, monkeypatch):
    path = tmp_path / "talk.json"
    out = io.StringIO()
    chat = session(out)
    chat.save(str(path))
    first = path.read_text(encoding="utf-8")
    assert json.loads(first)["messages"][-1]["content"] == "Hello!"

    def full_disk(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    chat.convo.history.append({"role": "user", "content": "And now?"})
    monkeypatch.setattr(lucidlm.staging, "publish", full_disk)
    chat.save(str(path))
    assert path.read_text(encoding="utf-8") == first  # whole, not cut off or replaced
    assert "cannot write" in out.getvalue() and "No space left" in out.getvalue()
    assert [p.name for p in tmp_path.iterdir()] == ["talk.json"]  # no staging file left behind
