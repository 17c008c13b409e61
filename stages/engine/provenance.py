"""Whether a file or store is an output gridsolve wrote, from its own attributes.

Used by the writers and retention (never replace or delete anyone else's file) and
by the path checks before a run (a foreign file at ``write.path`` is refused).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


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
