"""Where lucidlm keeps its own files: ``$LUCIDLM_CACHE``, else ``~/.cache/lucidlm``.

Verification stamps, joined model files, parsed GGUF headers, the compiled CPU kernels and the
chat history live here. It is a cache: any of it may be deleted, and a cache that cannot be
written is worked around, never fatal.
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    return Path(os.environ.get("LUCIDLM_CACHE") or Path.home() / ".cache" / "lucidlm").expanduser()
