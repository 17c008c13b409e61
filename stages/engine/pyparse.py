"""One lock for everything in gridsolve that turns text into Python syntax trees.

CPython 3.11 keeps one recursion counter per interpreter for building ``ast``
objects; two threads building at once (a garbage collection inside one runs
a finaliser that lets the other in) corrupt it, and ``ast.parse`` raises
``SystemError: AST constructor recursion depth mismatch`` (CPython issue
gh-106905). ``np.load`` parses each ``.npy`` header with ``ast.literal_eval``,
and the write stage loads tiles from several threads, so gridsolve's own
parses are taken under :data:`PARSE_LOCK`. Other libraries' parses in other
threads (a traceback's caret markers) are outside gridsolve's reach.
"""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np

#: Held around every ``ast.parse`` gridsolve makes, directly or through ``np.load``.
#: Re-entrant: a region that holds it (a model's first compile) may read an array.
PARSE_LOCK = threading.RLock()


def load_npy(path: str | Path, *, mmap: bool = True) -> np.ndarray:
    """The array of a ``.npy`` file: a read-only memory map, or (``mmap=False``) a copy in memory.

    Objects are refused (``allow_pickle=False``).
    """
    with PARSE_LOCK:  # the header's parse; the data is read outside it
        mapped = np.load(path, mmap_mode="r", allow_pickle=False)
    return np.asarray(mapped) if mmap else np.array(mapped)
