"""Tile reads, and the mid-run guard that the input did not change since it was hashed."""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

import numpy as np

from gridsolve.schemas.artifacts import Tile
from gridsolve.schemas.errors import GridsolveError, InputError, StageError
from gridsolve.schemas.kinds.load import NetCDFLoad
from gridsolve.schemas.metadata import LoadMeta
from gridsolve.stages.engine import storage
from gridsolve.stages.engine.hashing import (
    canonical_json,
    file_identity,
    hash_file,
)
from gridsolve.stages.engine.registry import SOURCE
from gridsolve.stages.load import files as filesets
from gridsolve.stages.load.base import STAGE
from gridsolve.stages.load.scan import scan_netcdf
from gridsolve.stages.load.source import Source, _values

# The mid-run guard. The stored load artifact names no file (it is content-
# addressed); the ref's per-run source (``locate``) says where the input is this
# run, its identity (inode, size, mtime, ctime) and the content digest seen
# there when the run began. A tile read whose file still has that identity
# proceeds for the cost of a stat. A different identity alone (touched,
# rsync'd, copied over with the same bytes) is not a change: the content is
# hashed again, once per identity and process, and the read refused only if
# it differs from the content the load key covers. So a real change is caught
# and a touch never fails a run, let alone every later one.
_REVALIDATED: dict[tuple[str, str, str], bool] = {}


_REVALIDATE_LOCK = threading.Lock()


def _same_content(src: Mapping[str, Any], content_hash: str, now: Mapping[str, int]) -> bool:
    memo = (src["path"], canonical_json(now), content_hash)
    with _REVALIDATE_LOCK:  # tiles that find the same new identity wait for one rescan
        if memo not in _REVALIDATED:
            try:
                config = NetCDFLoad.model_validate({**src["config"], "path": src["path"]})
                same = scan_netcdf(config, src["path"]).digest == content_hash
            except GridsolveError:  # unreadable now: half-written or replaced
                same = False
            _REVALIDATED[memo] = same
        return _REVALIDATED[memo]


def _set_changed(src: Mapping[str, Any]) -> str | None:
    """The first file of a file set or Zarr store whose bytes differ from what ``locate`` saw."""
    files: Mapping[str, Any] = src.get("files") or {}
    if any(storage.at(f).local is None for f in files):  # objects: compared by their ETags
        base = Source.from_description(src["source"])
        try:
            store = base.path if base.zarr else None
            listed = filesets.remote_digests(list(files), base.storage_options, store)
        except (InputError, KeyError):
            listed = {}
        for f, seen in files.items():
            if f not in listed or listed[f]["identity"] != seen["identity"]:
                return str(f)
        return None
    for f, seen in files.items():
        try:
            now = file_identity(f)
        except FileNotFoundError:
            return str(f)
        if now == seen["identity"]:
            continue
        memo = (f, canonical_json(now), str(seen["digest"]))
        with _REVALIDATE_LOCK:
            if memo not in _REVALIDATED:
                try:
                    _REVALIDATED[memo] = hash_file(f) == seen["digest"]
                except OSError:
                    _REVALIDATED[memo] = False
            if not _REVALIDATED[memo]:
                return str(f)
    return None


def _check_unchanged(meta: Mapping[str, Any]) -> Source:
    """Where the input is this run; InputError if its content is not the one the key covers."""
    src = meta.get(SOURCE) or {}
    path = src.get("path")
    if not path:
        raise StageError(
            "the load metadata names no input file for this run",
            stage=STAGE,
            fix="open the load stage's output through stages.runner, which attaches "
            "where the input is (stages.load.locate)",
        )
    typed = LoadMeta.of(meta)
    content = typed.content_hash
    if "source" in src:
        base = Source.from_description(src["source"], typed.selection)
        changed = _set_changed(src) if src.get("content") == content else base.path
        unchanged = changed is None
        what = f"input file {changed}" + (f" (in the Zarr store {base.path})" if base.zarr else "")
    else:
        base = Source.from_description({"path": path}, typed.selection)
        try:
            now: dict[str, int] | None = file_identity(path)
        except FileNotFoundError:
            now = None
        unchanged = (
            now is not None
            and src.get("content") == content
            and (now == src.get("file") or _same_content(src, content, now))
        )
        what = f"input file {path}"
    if not unchanged:
        raise InputError(
            f"{what} changed or vanished while the run was using it",
            stage=STAGE,
            fix="rerun once the file is complete; write nightly files under a temporary name "
            "and rename them when done",
        )
    return base


def read_block(meta: Mapping[str, Any], role: str, tile: Tile) -> np.ndarray:
    """Read ``role`` ("cube", "weights", "target") for one tile, as (leading, rows, cols) floats.

    ``meta`` is the load stage's output as the runner opens it, with this run's source.
    """
    path = _check_unchanged(meta)
    typed = LoadMeta.of(meta)
    name = typed.variable if role == "cube" else typed.aux[role].name
    y_dim, x_dim, obs_dim = typed.y_dim, typed.x_dim, typed.obs_dim
    ds = path.open_selected()
    try:
        var = ds[name]
        window = {d: v for d, v in typed.plane_window(tile).items() if d in var.dims}
        lead = [d for d in var.dims if d not in window]
        if role in ("cube", "weights"):
            lead = [obs_dim]
        values = _values(
            var,
            lambda v: v.isel(window).transpose(*lead, y_dim, x_dim),
            f"variable {name!r}",
            path,
        )
    finally:
        path.close(ds)
    if values.ndim == 2:
        values = values[None]
    if values.dtype.kind != "f":
        values = values.astype(np.float64)
    return values
