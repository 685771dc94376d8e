"""Refusing an allocation this machine cannot hold: ``check_allocation`` and the limits it reads.

Part of the validation helper (``validation.py``, which re-exports it): a size computed from
a file or an argument (a vocabulary, a context length, a KV cache) is compared with physical
RAM and with what is left of the process's address-space limit (``ulimit -v``) before the
allocation, so an absurd size is one line instead of a multi-GB allocation or a kill.
"""

from __future__ import annotations

import os
from typing import Optional, Type, Union

from lucidlm.errors import LucidLMError


def check_allocation(n_bytes: Union[int, float], what: str, error: Type[LucidLMError], fix: str) -> None:
    """Refuse to allocate ``n_bytes`` for ``what`` when it exceeds this machine's memory (or
    what is left of this process's address-space limit, ``ulimit -v``), so an absurd size in a
    file or argument becomes one line instead of a multi-GB allocation."""
    refusal = _refusal(n_bytes)
    if refusal is not None:
        raise error(f"{what} would need {_human(n_bytes)}, {refusal}. {fix[0].upper() + fix[1:]}.")


def allocation_fits(n_bytes: Union[int, float]) -> bool:
    """Whether ``check_allocation`` would let ``n_bytes`` through (for room that is only nice to
    have, such as a KV cache's reserve of rows)."""
    return _refusal(n_bytes) is None


def _refusal(n_bytes: Union[int, float]) -> Optional[str]:
    """Why ``n_bytes`` cannot be allocated, or None."""
    total = physical_memory()
    if total and n_bytes > total:
        return f"more than this machine's {_human(total)} of memory"
    left = address_space_left()
    if left is not None and n_bytes > left:
        return f"more than the {_human(left)} of address space this process may still use (ulimit -v)"
    return None


def address_space_left() -> Optional[int]:
    """Bytes this process may still map under its RLIMIT_AS, or None without a limit."""
    try:
        import resource

        limit = resource.getrlimit(resource.RLIMIT_AS)[0]
        if limit == resource.RLIM_INFINITY:
            return None
        with open("/proc/self/statm") as f:  # first field: pages of address space mapped now
            used = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    except (ImportError, OSError, ValueError, IndexError):
        return None
    return max(limit - used, 0)


def physical_memory() -> int:
    """Bytes of RAM on this machine (0 when the platform cannot tell)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return 0


def _human(n: Union[int, float]) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB", "PB"):
        if abs(n) < 1024 or unit == "PB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n} B"
