"""Where the tokenizer tests find the shared assets (../shared/data beside the repo)."""

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]  # repo root: tests/tokenizers/<this file>


def shared_file(*parts: str) -> Path:
    path = ROOT.parent.joinpath("shared", "data", *parts)
    if not path.exists():
        pytest.skip(f"{path} not found: the shared assets live in ../shared beside the repo")
    return path
