"""Shared test helpers: where ../shared lives, and a quiet, offline environment."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# No test may reach a model hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("MPLBACKEND", "Agg")

REPO_ROOT = Path(__file__).resolve().parent.parent
SHARED = REPO_ROOT.parent / "shared"


@pytest.fixture(scope="session")
def shared_dir() -> Path:
    if not SHARED.is_dir():
        pytest.skip(f"{SHARED} (the shared assets beside the repo) is not present")
    return SHARED


# -- the embedded pretrained model and its transformers reference, loaded once per run ------
# Several test modules compare against these; loading transformers' GGUF reader costs
# ~15 s each time, so they are session-scoped. Tests must leave them as they found them
# (hooks removed, KV cache cleared); anything that changes weights loads its own copy.

@pytest.fixture(scope="session")
def smollm2():
    import lucidlm
    from lucidlm.pretrained import find_gguf

    try:
        find_gguf("smollm2-135m")
    except Exception as exc:  # noqa: BLE001 - any reason the package is unusable
        pytest.skip(f"the embedded SmolLM2 is not available: {exc}")
    return lucidlm.load("smollm2-135m")


@pytest.fixture(scope="session")
def hf_smollm2(smollm2):
    """(transformers model, transformers tokenizer) reading the same GGUF file, in float32."""
    import warnings

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lucidlm.pretrained import find_gguf

    path = find_gguf("smollm2-135m")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    return model.eval(), tokenizer
