"""Where lucidlm keeps its own files: ``$LUCIDLM_CACHE``, else ``~/.cache/lucidlm``.

Verification stamps, joined model files, parsed GGUF headers, the compiled CPU kernels and the
chat history live here. It is a cache: any of it may be deleted, and a cache that cannot be
written is worked around, never fatal (a joined GGUF and the kernels go to ``fallback_root()``).
"""

from __future__ import annotations

import errno
import os
import stat
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


def private_fallback_root() -> Path:
    """``fallback_root()``, made if absent; OSError unless it is a directory of this user that
    nobody else can write into: anyone may create ``/tmp/lucidlm-<uid>`` first, and what lucidlm
    loads from it (the compiled kernels) is code. Writable by the user's own group is allowed:
    under umask 002 (Debian's user private groups) the GGUF join makes it so."""
    root = fallback_root()
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = root.lstat()
    if hasattr(os, "getuid") and (not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o002
                                  or (st.st_mode & 0o020 and st.st_gid != os.getgid())):
        raise PermissionError(errno.EACCES, "not a private directory of this user", str(root))
    return root
