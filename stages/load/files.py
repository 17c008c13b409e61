"""Many files as one cube: globs and lists of NetCDF files, Zarr stores, their content digests.

``load.path`` names one NetCDF file, a glob (``data/sst-*.nc``), a list of
paths (each may be a glob), or a Zarr store (a folder). Several NetCDF files
are combined along the observation dim by its coordinate, like
``xarray.open_mfdataset(combine="by_coords")``, after checking that they share
the grid and that no observation is in two files; files whose observations
interleave are combined in observation order.

The cache key of a file set covers the bytes of every file, in the order the
cube uses them. Each file's digest is kept on disk against its identity
(device, inode, size, mtime, ctime: a file rewritten, replaced or touched gets
a new ctime, which user tools cannot set back), so a rerun over an archive
where one file was added hashes that file only. A file changed less than 2 s
before it was hashed is hashed again next time: on a file system with coarse
timestamps it could change again without changing its identity.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import xarray as xr

from gridsolve.schemas.errors import ContractError, InputError
from gridsolve.stages.engine import remote, storage
from gridsolve.stages.engine.hashing import canonical_json, file_identity, hash_file, hash_text
from gridsolve.stages.engine.paths import atomic_file
from gridsolve.stages.load.scanmemo import RACY_NS
from gridsolve.stages.load.where import relative_paths

STAGE = "load"


def store_files(store: str, options: Mapping[str, Any] | None = None) -> list[str]:
    """Every file inside a Zarr store, sorted (what its digest covers)."""
    return storage.at(store, options).files_under(("Zarr store", InputError, STAGE))


# ---------------------------------------------------------------- digests
_DIGEST_LOCK = threading.Lock()


def _digest_file(path: str, cache: Path | None) -> tuple[dict[str, int], str]:
    """(identity, xxh3-128 of the bytes) of one file; the digest reused while the identity holds."""
    seen = time.time_ns()  # before the identity: see "racy" below
    ident = file_identity(path)
    entry = cache / f"{hash_text(path)}.json" if cache is not None else None
    if entry is not None and entry.exists():
        try:
            saved = json.loads(entry.read_text())
            if saved.get("path") == path and saved.get("identity") == ident:
                return ident, str(saved["digest"])
        except (OSError, ValueError, KeyError):
            pass  # unreadable entry: hash again
    digest = hash_file(path)
    if file_identity(path) != ident:  # changed while it was read: do not remember it
        return file_identity(path), hash_file(path)
    # A file changed within the file system's timestamp resolution of now could change
    # again with the same identity (coarse mtime/ctime): hash it again next time ("racy").
    settled = seen - max(ident["mtime_ns"], ident["ctime_ns"]) > RACY_NS
    if entry is not None and settled:
        with _DIGEST_LOCK:
            try:
                with atomic_file(entry) as tmp:
                    tmp.write_text(json.dumps({"path": path, "identity": ident, "digest": digest}))
            except OSError:
                pass  # a read-only cache only costs a rehash next time
    return ident, digest


def remote_digests(
    files: Sequence[str], options: Mapping[str, Any] | None, store: str | None = None
) -> dict[str, dict[str, Any]]:
    """Each object's identity (size, ETag) and a digest of it, in order; nothing downloaded.

    A store's objects are listed in one call; single objects are asked one by one.
    """
    where = store or (files[0] if files else "")
    with remote.translated(where, "input file", InputError, STAGE, options):
        if store is not None:
            listed = remote.find(store, options)
            idents = {f: listed[f] for f in files}
        else:
            idents = {f: remote.object_identity(f, options) for f in files}
    return {f: {"identity": i, "digest": remote.object_digest(i)} for f, i in idents.items()}


def digests(files: Sequence[str], cache: Path | None) -> dict[str, dict[str, Any]]:
    """Each local file's identity and byte digest (``{"identity": …, "digest": …}``), in order."""
    out: dict[str, dict[str, Any]] = {}
    for f in files:
        try:
            ident, digest = _digest_file(f, cache)
        except FileNotFoundError:
            raise InputError(
                f"input file not found: {f}",
                stage=STAGE,
                fix=f"check load.path ({relative_paths()})",
            ) from None
        except OSError as exc:
            raise InputError(
                f"cannot read input file {f}: {exc.strerror}",
                stage=STAGE,
                fix="check its permissions",
            ) from exc
        out[f] = {"identity": ident, "digest": digest}
    return out


def set_digest(per_file: dict[str, dict[str, Any]], root: str | None = None) -> str:
    """One digest of a file set: each file's bytes digest, in order, named relative to ``root``."""
    names = [_relative(f, root) if root else "" for f in per_file]
    return hash_text(
        canonical_json([[n, d["digest"]] for n, d in zip(names, per_file.values(), strict=True)])
    )


def _relative(path: str, root: str) -> str:
    return storage.at(root).relative(path)


# ---------------------------------------------------------------- combining
def _span(values: np.ndarray) -> str:
    return f"{values[0]} … {values[-1]}" if len(values) else "empty"


def check_holds(
    datasets: Sequence[xr.Dataset], files: Sequence[str], var: str, obs_dim: str | None = None
) -> None:
    """ContractError naming the files that lack the cube variable ``var`` (or its ``obs_dim``)."""
    problems = [
        f"{f}: has no variable {var!r} (its variables: {', '.join(map(str, ds.data_vars))})"
        for f, ds in zip(files, datasets, strict=True)
        if var not in ds.variables
    ]
    problems += [
        f"{f}: {var!r} has no dim {obs_dim!r} (its dims are {list(ds[var].dims)})"
        for f, ds in zip(files, datasets, strict=True)
        if obs_dim is not None and var in ds.variables and obs_dim not in ds[var].dims
    ]
    if problems:
        raise ContractError(
            "the input files do not all hold the cube",
            stage=STAGE,
            violations=problems,
            fix="list only files of the same product in load.path",
        )


def combine(
    datasets: Sequence[xr.Dataset], files: Sequence[str], var: str, obs_dim: str
) -> tuple[xr.Dataset, list[int]]:
    """The files' datasets as one, along ``obs_dim`` in coordinate order, and the files' order.

    Files are ordered by their first observation; files whose observations
    interleave are combined in observation order (:func:`obs_sort`).
    ContractError naming the files if one lacks the cube, their grids differ,
    or an observation is in two files.
    """
    check_holds(datasets, files, var, obs_dim)
    missing = [f for f, ds in zip(files, datasets, strict=True) if obs_dim not in ds.coords]
    if missing:
        raise ContractError(
            f"input files without a {obs_dim!r} coordinate cannot be put in order",
            stage=STAGE,
            violations=[f"{f}: no coordinate variable {obs_dim!r}" for f in missing],
            fix=f"give every file its {obs_dim!r} values (a coordinate variable)",
        )
    first = [np.asarray(ds[obs_dim].values[:1]) for ds in datasets]
    if any(len(v) == 0 for v in first):
        empty = [f for f, v in zip(files, first, strict=True) if len(v) == 0]
        raise ContractError(
            f"input files without observations: {empty}", stage=STAGE, fix="leave them out"
        )
    order = sorted(range(len(datasets)), key=lambda i: first[i][0])
    ref_i = order[0]
    ref = datasets[ref_i][var]
    problems = []
    for i in order[1:]:
        da = datasets[i][var]
        for dim in ref.dims:
            if dim == obs_dim:
                continue
            if dim not in da.dims or da.sizes[dim] != ref.sizes[dim]:
                problems.append(
                    f"{files[i]}: dim {dim!r} has "
                    f"{da.sizes.get(dim, 'no')} values, {files[ref_i]} has {ref.sizes[dim]}"
                )
            elif dim in ref.coords and not np.array_equal(
                np.asarray(da[dim].values), np.asarray(ref[dim].values)
            ):
                problems.append(
                    f"{files[i]}: coordinate {dim!r} ({_span(np.asarray(da[dim].values))}) "
                    f"differs from {files[ref_i]}'s ({_span(np.asarray(ref[dim].values))})"
                )
        if set(da.dims) != set(ref.dims):
            problems.append(
                f"{files[i]}: dims {list(da.dims)}, {files[ref_i]} has {list(ref.dims)}"
            )
    if problems:
        raise ContractError(
            "the input files are on different grids",
            stage=STAGE,
            violations=problems,
            fix="combine only files of the same grid (regrid the others first)",
        )
    _check_disjoint(
        [np.asarray(datasets[i][obs_dim].values) for i in order], [files[i] for i in order], obs_dim
    )
    combined = concat(datasets, order, obs_dim)
    sort = obs_sort(np.asarray(combined[obs_dim].values))
    return (combined if sort is None else combined.isel({obs_dim: sort})), order


def _check_disjoint(values: Sequence[np.ndarray], files: Sequence[str], obs_dim: str) -> None:
    """ContractError naming two files that hold the same observation (``values``: each file's)."""
    stacked = np.concatenate(values)
    owner = np.concatenate([np.full(len(v), i) for i, v in enumerate(values)])
    order = np.argsort(stacked, kind="stable")
    ranked, owners = stacked[order], owner[order]
    same = np.flatnonzero((ranked[1:] == ranked[:-1]) & (owners[1:] != owners[:-1]))
    if same.size:
        k = int(same[0])
        a, b = sorted((int(owners[k]), int(owners[k + 1])))
        raise ContractError(
            f"input files overlap along {obs_dim!r}",
            stage=STAGE,
            found=f"{obs_dim} = {ranked[k]} is in {files[a]} ({_span(values[a])}) and in "
            f"{files[b]} ({_span(values[b])}); {int(same.size)} observation(s) are in two files",
            fix="list each observation in one file only (leave out duplicates)",
        )


def obs_sort(values: np.ndarray) -> np.ndarray | None:
    """Positions that put the combined files' obs ``values`` in order; None if they are.

    Files whose observations interleave (odd months in one, even in the other)
    are combined observation by observation: every value is in one file only
    (:func:`combine` checks), so the order is unique.
    """
    if len(values) < 2:
        return None
    steps = values[1:] > values[:-1]
    if bool(np.all(steps)):
        return None
    return np.argsort(values, kind="stable")


def check_obs_encoding(datasets: Sequence[xr.Dataset], files: Sequence[str], obs_dim: str) -> None:
    """ContractError naming the files whose obs coordinate has another calendar than the first's."""

    def encoding(ds: xr.Dataset) -> dict[str, str]:
        # The calendar must agree (it decides what the numbers mean); units and reference
        # dates may differ per file (the output then writes units that fit every value).
        enc = ds[obs_dim].encoding
        return {"calendar": str(enc.get("calendar", "standard")).replace("gregorian", "standard")}

    first = encoding(datasets[0])
    problems = [
        f"{f}: {obs_dim!r} stored as {encoding(ds)}, {files[0]} as {first}"
        for f, ds in zip(files[1:], datasets[1:], strict=True)
        if encoding(ds) != first
    ]
    if problems:
        raise ContractError(
            f"the input files store {obs_dim!r} in different calendars",
            stage=STAGE,
            violations=problems,
            fix="write every file's times in one calendar (e.g. cdo setcalendar)",
        )


def concat(datasets: Sequence[xr.Dataset], order: Sequence[int], obs_dim: str) -> xr.Dataset:
    """``datasets`` in ``order`` as one along ``obs_dim``; the rest taken from the first."""
    if len(datasets) == 1:
        return datasets[0]
    return xr.concat(
        [datasets[i] for i in order],
        dim=obs_dim,
        data_vars="minimal",
        coords="minimal",
        compat="override",
        join="override",
        combine_attrs="override",
    )
