"""Joining a GGUF shipped in PyPI parts: the join is checked and atomic."""

from __future__ import annotations

import hashlib

import pytest

from lucidlm.errors import GGUFError
from lucidlm.pretrained import PRETRAINED, find_gguf
from lucidlm.pretrained_parts import assembled_gguf, part_paths


def test_parts_join_in_order_and_are_reused(tmp_path, monkeypatch):
    monkeypatch.setenv("LUCIDLM_CACHE", str(tmp_path / "stamps"))
    parts = []
    for i, data in enumerate([b"GGUF" + b"a" * 1000, b"b" * 3000, b"c" * 7]):
        parts.append(tmp_path / f"m.gguf.part{i:02d}")
        parts[-1].write_bytes(data)
    whole = b"".join(p.read_bytes() for p in parts)
    target = tmp_path / "cache" / "m.gguf"
    assert assembled_gguf(parts, target, hashlib.sha256(whole).hexdigest()) == target
    assert target.read_bytes() == whole
    before = target.stat()
    assert assembled_gguf(parts, target, hashlib.sha256(whole).hexdigest()) == target  # intact: reused as is
    assert (target.stat().st_ino, target.stat().st_mtime_ns) == (before.st_ino, before.st_mtime_ns)


def test_a_damaged_join_is_rebuilt_from_the_parts(tmp_path, monkeypatch):
    monkeypatch.setenv("LUCIDLM_CACHE", str(tmp_path / "stamps"))
    parts = [tmp_path / "m.gguf.part00", tmp_path / "m.gguf.part01"]
    parts[0].write_bytes(b"GGUF" + bytes(range(256)) * 8)
    parts[1].write_bytes(b"tail" * 100)
    whole = b"".join(p.read_bytes() for p in parts)
    target = tmp_path / "cache" / "m.gguf"
    assembled_gguf(parts, target, hashlib.sha256(whole).hexdigest())
    with open(target, "r+b") as f:  # one flipped byte, same size
        f.seek(700)
        f.write(bytes([whole[700] ^ 0xFF]))
    assert assembled_gguf(parts, target, hashlib.sha256(whole).hexdigest()) == target
    assert target.read_bytes() == whole


def test_a_damaged_part_leaves_nothing_behind(tmp_path):
    part = tmp_path / "m.gguf.part00"
    part.write_bytes(b"GGUF broken")
    target = tmp_path / "cache" / "m.gguf"
    with pytest.raises(GGUFError, match="SHA-256"):
        assembled_gguf([part], target, hashlib.sha256(b"something else").hexdigest())
    assert list(target.parent.iterdir()) == []


def test_a_missing_part_package_names_the_install_command():
    with pytest.raises(GGUFError, match="pip install gemma3"):
        part_paths([("lucidlm-no-such-part-package", "x.part00")], PRETRAINED["gemma3-270m"].install_command)


def test_gemma3_is_found_in_its_installed_parts(gemma3_gguf):
    assert gemma3_gguf == find_gguf("gemma3-270m")
    assert gemma3_gguf.read_bytes()[:4] == b"GGUF"
    assert gemma3_gguf.stat().st_size == sum(p.stat().st_size for p in
                                             part_paths(PRETRAINED["gemma3-270m"].parts, ""))
