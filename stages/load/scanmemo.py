"""The content digest of one input file, remembered across runs while the file is unchanged.

A run's load key covers the content of the selected variables (see
:mod:`.scan`), and finding it means reading and hashing them: for a rerun whose
every stage is a cache hit that is most of the work left, plus opening the
file with xarray (≈ 0.6 s of imports here). This remembers the digest under the
cache root, per file path, file identity (device, inode, size, mtime, ctime:
:func:`~gridsolve.stages.engine.hashing.file_identity`), load settings, load
code and library versions, as the file-set digests are (:mod:`.files`). Any
change to the file changes its identity, and the next run scans it again;
so does a file changed within the file system's timestamp resolution of its
scan ("racy": its identity could repeat), which is never remembered.

An entry only ever records a scan that passed every check, so a reused digest
skips no refusal: a file that was refused is scanned (and refused) again.
"""

from __future__ import annotations

import functools
import importlib.metadata
import json
import threading
from pathlib import Path

from gridsolve.schemas.kinds.load import NetCDFLoad
from gridsolve.stages.engine.hashing import canonical_json, file_identity, hash_text
from gridsolve.stages.engine.paths import atomic_file

#: A file whose mtime or ctime is this close to now may change again with the same identity:
#: remembered only once unchanged this long (2 s: FAT's timestamp resolution; ext4, XFS and
#: NFSv4 keep nanoseconds).
RACY_NS = 2_000_000_000
_LOCK = threading.Lock()


@functools.cache
def decoding_versions() -> dict[str, str]:
    """Versions of the libraries that decode times into the hashed values (besides the key's)."""
    out = {}
    for name in ("pandas", "cftime"):
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = "absent"
    return out


def _entry(folder: Path, config: NetCDFLoad, path: str, versions: str) -> Path:
    name = hash_text(canonical_json([path, config.key_payload(), versions]))
    return folder / f"{name}.json"


def remembered(
    folder: Path, config: NetCDFLoad, path: str, versions: str
) -> tuple[dict[str, int], str] | None:
    """(identity, digest) recorded for ``path`` as it is now; None if it changed or is new."""
    try:
        ident = file_identity(path)
        saved = json.loads(_entry(folder, config, path, versions).read_text())
    except (OSError, ValueError):
        return None  # no entry, an unreadable one, or no file (the scan says which)
    if not isinstance(saved, dict) or saved.get("identity") != ident:
        return None
    digest = saved.get("digest")
    return (ident, digest) if isinstance(digest, str) else None


def remember(
    folder: Path,
    config: NetCDFLoad,
    path: str,
    versions: str,
    ident: dict[str, int],
    digest: str,
    began_ns: int,
) -> None:
    """Record ``digest`` of ``path`` scanned at ``ident``, unless the file is racy or changed.

    ``began_ns``: when the scan took ``ident``. A file changed within RACY_NS before
    that could have changed again during the scan without a new identity.
    """
    try:
        if file_identity(path) != ident:  # changed since its scan began
            return
    except OSError:
        return
    if began_ns - max(ident["mtime_ns"], ident["ctime_ns"]) <= RACY_NS:
        return
    entry = _entry(folder, config, path, versions)
    with _LOCK:
        try:
            entry.parent.mkdir(parents=True, exist_ok=True)
            with atomic_file(entry) as tmp:
                tmp.write_text(json.dumps({"path": path, "identity": ident, "digest": digest}))
        except OSError:
            pass  # a read-only cache only costs a scan next time
