"""Where lucidlm keeps its own files: ``$LUCIDLM_CACHE``, else ``~/.cache/lucidlm``.

Verification stamps, joined model files, parsed GGUF headers, the compiled CPU kernels and the
chat history live here. It is a cache: any of it may be deleted, and a cache that cannot be
written is worked around, never fatal.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def cache_root() -> Path:
    try:
        return Path(os.environ.get("LUCIDLM_CACHE") or Path.home() / ".cache" / "lucidlm").expanduser()
    except RuntimeError:  # no $HOME and a uid without a passwd entry (a container run as an arbitrary
        return fallback_root()  # user): "Could not determine home directory" was an internal error


def fallback_root() -> Path:
    """A per-user directory under the system's temporary directory, for when the cache has no
    home or cannot be written."""
    return Path(tempfile.gettempdir()) / f"lucidlm-{_user()}"


def _user() -> str:
    try:
        return str(os.getuid())
    except AttributeError:  # Windows
        return os.environ.get("USERNAME", "user")
