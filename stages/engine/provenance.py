"""Whether a file or store is an output gridsolve wrote, from its own attributes.

Used by the writers and retention (never replace or delete anyone else's file) and
by the path checks before a run (a foreign file at ``write.path``, or beside it at
the name of a picture or the weights, is refused).
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

#: Zarr v2 and v3 store markers.
ZARR_MARKERS = (".zgroup", ".zarray", ".zmetadata", "zarr.json")


def _store_attrs(path: Path) -> dict[str, Any]:
    """The root attributes of a Zarr store of any format version ({} if it has none)."""
    for name, where in (
        (".zmetadata", ("metadata", ".zattrs")),  # format 2, consolidated (gridsolve's own)
        (".zattrs", ()),  # format 2
        ("zarr.json", ("attributes",)),  # format 3
    ):
        try:
            found: Any = json.loads((path / name).read_text())
        except (OSError, ValueError):
            continue
        for key in where:
            found = found.get(key, {}) if isinstance(found, dict) else {}
        if isinstance(found, dict) and found:
            return found
    return {}


def _ours(attrs: Any) -> bool:
    return bool(attrs.get("source") == "gridsolve" or "gridsolve_config" in attrs)


def is_gridsolve_output(path: Path) -> bool:
    """Whether ``path`` is an output gridsolve wrote (never delete anyone else's file).

    A NetCDF file or a Zarr store (format 2 or 3) whose global attributes hold
    the provenance every gridsolve output carries (``gridsolve_config``, or
    ``source: gridsolve``).
    """
    if path.is_dir():
        return _ours(_store_attrs(path))
    if not path.is_file():
        return False
    try:
        import netCDF4

        with netCDF4.Dataset(path) as nc:
            return _ours({k: nc.getncattr(k) for k in nc.ncattrs()})
    except Exception:  # not a NetCDF file, or unreadable: not ours to delete
        return False


#: The PNG text key, and the safetensors metadata key, that mark a file beside an
#: output (quick-look, loss picture, trained weights) as gridsolve's.
MARK_KEY = "gridsolve"
MARK_VALUE = "written by gridsolve beside its output"
#: The PNG text key of a quick-look's stamp of the output it shows (gridsolve/report/pictures.py);
#: quick-looks written before :data:`MARK_KEY` carry only this.
STAMP_KEY = "gridsolve-output"


def png_text(png: bytes) -> dict[str, str]:
    """The text entries of a PNG (tEXt, and uncompressed iTXt), those before its image data.

    Pillow writes a value that is not Latin-1 (a stamp naming a non-Latin path) as iTXt.
    """
    out: dict[str, str] = {}
    pos = 8  # the signature
    while pos + 8 <= len(png):
        (length,) = struct.unpack(">I", png[pos : pos + 4])
        kind = png[pos + 4 : pos + 8]
        body = png[pos + 8 : pos + 8 + length]
        if kind == b"IDAT":
            break
        if kind == b"tEXt":
            key, _, value = body.partition(b"\0")
            out[key.decode("latin-1")] = value.decode("latin-1")
        elif kind == b"iTXt":
            key, _, rest = body.partition(b"\0")
            if rest[:1] == b"\0":  # not compressed
                _lang, _, rest = rest[2:].partition(b"\0")
                _translated, _, value = rest.partition(b"\0")
                out[key.decode("latin-1")] = value.decode("utf-8", errors="replace")
        pos += 12 + length
    return out


def _safetensors_metadata(path: Path) -> dict[str, Any]:
    """The ``__metadata__`` of a safetensors file's header ({} if it is not one)."""
    try:
        with path.open("rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            if size > 100_000_000:
                return {}
            header = json.loads(f.read(size))
    except (OSError, ValueError, struct.error):
        return {}
    meta = header.get("__metadata__") if isinstance(header, dict) else None
    return meta if isinstance(meta, dict) else {}


def is_gridsolve_side_file(path: Path) -> bool:
    """Whether a picture (PNG) or weights file (safetensors) beside an output is gridsolve's.

    Every one gridsolve writes carries :data:`MARK_KEY` (quick-looks also their
    stamp); a file without it is someone else's, never to be replaced.
    """
    if path.suffix == ".safetensors":
        return _safetensors_metadata(path).get(MARK_KEY) == MARK_VALUE
    try:
        with path.open("rb") as f:
            head = f.read(1 << 16)  # the text chunks come before the image data
    except OSError:
        return False
    text = png_text(head)
    return text.get(MARK_KEY) == MARK_VALUE or STAMP_KEY in text
