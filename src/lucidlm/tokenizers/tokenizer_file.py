"""Reading a tokenizer file back: the JSON that ``Tokenizer.save`` writes, checked before any class is built.

A saved tokenizer is one JSON object, ``{"type": ..., "version": FORMAT_VERSION, ...}``; the
``"type"`` picks the class (``base.py``'s registry) and the rest is that class's
``_from_dict`` input. Here the file is refused, with its path, when it is missing, not JSON,
has no type (or a type or version of the wrong kind), or was written by a newer lucidlm.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from lucidlm.errors import TokenizerError
from lucidlm.validation import refuse_newer_format

FORMAT_VERSION = 1


def read_tokenizer_json(path: str | Path, known_types: list[str]) -> dict[str, Any]:
    """The checked contents of a file written by ``Tokenizer.save``: a JSON object with a ``"type"``
    (``known_types`` are named when it has none) and a format version this lucidlm reads."""
    path = Path(path)
    if not path.is_file():
        raise TokenizerError(f"tokenizer file {path} does not exist; save one with .save()")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise TokenizerError(f"{path} is not a JSON tokenizer file: {err}") from err
    if not isinstance(data, dict) or "type" not in data:
        raise TokenizerError(
            f"{path} has no \"type\" field, so it was not written by a lucidlm tokenizer's "
            f"save(); known types are {known_types}"
        )
    if not isinstance(data["type"], str):
        raise TokenizerError(
            f"{path}: \"type\" is {data['type']!r}, not a tokenizer type name; known types are "
            f"{known_types}. The file is damaged: save the tokenizer again"
        )
    version = data.get("version", FORMAT_VERSION)
    if isinstance(version, bool) or not isinstance(version, int):
        raise TokenizerError(
            f"{path}: \"version\" is {version!r}, not a whole number (this lucidlm writes "
            f"{FORMAT_VERSION}). The file is damaged: save the tokenizer again"
        )
    refuse_newer_format(path, "version", version, FORMAT_VERSION, "read this tokenizer", TokenizerError)
    return data
