"""glibc malloc in a worker process: large answers without twice their size in RSS.

By default glibc serves a block of at least ``M_MMAP_THRESHOLD`` (128 KiB at start) with its
own ``mmap`` and unmaps it when freed; but each such free raises the threshold to the block's
size (up to 32 MiB), so after the first large answer every later one of up to 32 MiB comes
from the heap, whose freed space is kept and fragments. One 15 MiB answer then peaked at
~91 MiB of RSS in the worker instead of the ~46 MiB its copies take (``bench/bigbody.py``,
issue 48). Setting the threshold fixes it (glibc stops moving it): blocks of 1 MiB or more
are mapped and unmapped each time, as Python's own 1 MiB arenas already are. An operator's
``MALLOC_MMAP_THRESHOLD_`` wins; elsewhere than glibc nothing is done."""

from __future__ import annotations

import ctypes
import os

M_MMAP_THRESHOLD = -3  # mallopt's parameter (malloc.h)
THRESHOLD = 1 << 20


def fix_mmap_threshold(size: int = THRESHOLD) -> bool:
    """Fix glibc's mmap threshold at ``size`` bytes; False when not done (not glibc, or
    ``MALLOC_MMAP_THRESHOLD_`` set)."""
    if os.environ.get("MALLOC_MMAP_THRESHOLD_"):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    return bool(mallopt(M_MMAP_THRESHOLD, size))
