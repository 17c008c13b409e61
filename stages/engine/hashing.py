"""Content hashes and chained cache keys.

Keys are xxh3-128 hex digests. The load stage hashes data content; every later
key is a Merkle chain: the hash of (kind, impl, version, canonical JSON of the
result-affecting config, keys of the inputs, digests of outside content, the
digest of the code that runs and the versions of the libraries that can change
numbers; see ``stages/engine/versions.py``). No array is hashed twice and nothing is
pickled to be hashed.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import xxhash


def canonical_json(obj: Any) -> str:
    """JSON with sorted keys and fixed separators: equal values give equal text."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=True)


def hash_text(text: str) -> str:
    """xxh3-128 hex digest of a string."""
    return xxhash.xxh3_128_hexdigest(text.encode("utf-8"))


def stage_key(
    kind: str,
    impl: str,
    version: str,
    config: Mapping[str, Any],
    inputs: Mapping[str, str],
    extra: Mapping[str, str] | None = None,
    *,
    code: str = "",
    libraries: Mapping[str, str] | None = None,
) -> str:
    """The cache key of a stage run: chained over its inputs' keys, its code and libraries."""
    return hash_text(
        canonical_json(
            {
                "kind": kind,
                "impl": impl,
                "version": version,
                "config": dict(config),
                "inputs": dict(inputs),
                "extra": dict(extra or {}),
                "code": code,
                "libraries": dict(libraries or {}),
            }
        )
    )


def tile_key(stage: str, bounds: Iterable[int | str]) -> str:
    """The key of one tile of a tiled stage."""
    return hash_text(canonical_json({"stage": stage, "tile": list(bounds)}))


class ArrayHasher:
    """Streams arrays (in any chunking) into one digest with their dtype and shape."""

    def __init__(self) -> None:
        self._h = xxhash.xxh3_128()

    def header(self, obj: Any) -> None:
        """Fold a JSON-able description (names, dims, dtype, attrs) into the digest."""
        self._h.update(canonical_json(obj).encode("utf-8"))
        self._h.update(b"\0")

    def update(self, block: np.ndarray) -> None:
        """Fold the C-order bytes of ``block`` into the digest."""
        flat = np.ascontiguousarray(block).reshape(-1)
        self._h.update(memoryview(flat.view(np.uint8)))  # type: ignore[arg-type]

    def hexdigest(self) -> str:
        """The digest so far."""
        return self._h.hexdigest()


def hash_array(arr: np.ndarray, label: str = "") -> str:
    """Digest of one in-memory array with its dtype and shape."""
    h = ArrayHasher()
    h.header({"label": label, "dtype": arr.dtype.str, "shape": list(arr.shape)})
    h.update(arr)
    return h.hexdigest()


_FILE_MEMO: dict[tuple[str, int, int, int, int], str] = {}
_FILE_LOCK = threading.Lock()


def hash_file(path: str | Path, block: int = 16 * 2**20) -> str:
    """xxh3-128 of a file's bytes, read now (never memoised)."""
    h = xxhash.xxh3_128()
    with open(path, "rb") as f:
        while chunk := f.read(block):
            h.update(chunk)
    return h.hexdigest()


def file_digest(path: str | Path, block: int = 16 * 2**20) -> str:
    """xxh3-128 of a file's bytes.

    Memoised in this process on (path, inode, size, mtime, ctime) only so that
    one run does not read a file twice; the digest itself always comes from the
    bytes, so a touched or copied file has the same digest.
    """
    p = Path(path)
    st = p.stat()
    memo_key = (str(p.resolve()), st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    with _FILE_LOCK:
        if memo_key in _FILE_MEMO:
            return _FILE_MEMO[memo_key]
    digest = hash_file(p, block)
    with _FILE_LOCK:
        _FILE_MEMO[memo_key] = digest
    return digest


def file_identity(path: str | Path) -> dict[str, int]:
    """Inode, size and change times: a cheap sign that a file may have changed.

    Never an identity for caching (that is the content): a differing identity
    only means the content must be looked at again. The inode and ctime catch
    a file replaced by rename or rewritten with its mtime restored (``cp -p``).
    """
    st = os.stat(path)
    return {
        "device": st.st_dev,
        "inode": st.st_ino,
        "size": st.st_size,
        "mtime_ns": st.st_mtime_ns,
        "ctime_ns": st.st_ctime_ns,
    }
