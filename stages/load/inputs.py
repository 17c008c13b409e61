"""What load.path names: one NetCDF file, a file set, or a Zarr store.

The members of a file set or store, their identities and digests (the load
key of a set covers every file's bytes), the set as one :class:`Source` in
observation order, and the quick check that the input opens.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import xarray as xr

from gridsolve.schemas.errors import ContractError
from gridsolve.schemas.kinds.load import NetCDFLoad
from gridsolve.stages.engine import storage
from gridsolve.stages.engine.context import StageContext
from gridsolve.stages.engine.hashing import (
    canonical_json,
    hash_text,
)
from gridsolve.stages.load import files as filesets
from gridsolve.stages.load.base import STAGE
from gridsolve.stages.load.cube import _cube, _cube_name
from gridsolve.stages.load.dims import cf_roles, infer_dims
from gridsolve.stages.load.opening import local, open_netcdf
from gridsolve.stages.load.source import Source, resolve_selection
from gridsolve.stages.load.where import expand, is_zarr, single_file


def _members(config: NetCDFLoad) -> tuple[list[str], str | None]:
    """The files a file set or Zarr store consists of, and the store (None for a file set)."""
    opts = config.storage_options
    found = expand(config.path, opts)
    if len(found) == 1 and is_zarr(found[0], opts):
        return filesets.store_files(found[0], opts), found[0]
    stores = [f for f in found if is_zarr(f, opts)]
    if stores:
        raise ContractError(
            f"load.path names {len(stores)} Zarr store(s) ({stores[0]}, …) and "
            f"{len(found) - len(stores)} other path(s)",
            stage=STAGE,
            fix="name one Zarr store, or NetCDF files only",
        )
    return found, None


def _digest_cache(ctx: StageContext) -> Path:
    return Path(ctx.store.root) / "file-digests"


def _set_facts(config: NetCDFLoad, ctx: StageContext) -> tuple[dict[str, Any], str, str | None]:
    """Per-file identities and digests of a file set or store, its one digest, and the store."""
    members, store = _members(config)
    if any(storage.at(m).local is None for m in members):  # objects: their ETags, not bytes
        per = filesets.remote_digests(members, config.storage_options, store)
    else:
        per = filesets.digests(members, _digest_cache(ctx))
    if store is not None:
        digest = filesets.set_digest(per, store)
    else:
        # Order-free: the files are combined by their coordinates, not their names.
        digest = hash_text(canonical_json(sorted(d["digest"] for d in per.values())))
    return per, digest, store


@functools.lru_cache(maxsize=8)
def _file_set(config_json: str, files: tuple[str, ...], ident_json: str, options: str) -> Source:
    """The file set as one source: the cube's obs dim and the files in observation order."""
    config = NetCDFLoad.model_validate({**json.loads(config_json), "path": list(files)})
    opts = json.loads(options)
    datasets = [open_netcdf(local(f, opts), chunks={}) for f in files]
    try:
        var = _set_cube_name(config, datasets, files)
        filesets.check_holds(datasets, files, var)
        first = datasets[0][var]
        dims = tuple(str(d) for d in first.dims)
        sizes = {str(d): int(n) for d, n in first.sizes.items()}
        obs, _, _, problems = infer_dims(
            dims, config.obs_dim, config.y_dim, config.x_dim, cf_roles(first), sizes
        )
        if not obs:
            raise ContractError(
                f"cannot tell which dim of {var!r} to combine the files along",
                stage=STAGE,
                violations=problems,
                fix="set load.obs_dim",
            )
        filesets.check_obs_encoding(datasets, files, obs)
        _, order = filesets.combine(datasets, files, var, obs)
    finally:
        for ds in datasets:
            ds.close()
    ordered = tuple(files[i] for i in order)
    return Source(ordered[0], files=ordered, obs_dim=obs, options=options if opts else "")


def _set_cube_name(config: NetCDFLoad, datasets: list[xr.Dataset], files: tuple[str, ...]) -> str:
    """The cube's name in a file set: load.variable, else the one every file agrees on."""
    if config.variable is not None:
        return config.variable
    found: dict[str, str] = {}
    for f, ds in zip(files, datasets, strict=True):
        try:
            found[f] = _cube_name(config, ds)
        except ContractError:
            found[f] = ""
    names = set(found.values())
    if len(names) != 1 or "" in names:
        raise ContractError(
            "the input files do not agree on which variable is the cube",
            stage=STAGE,
            violations=[
                f"{f}: {n or 'no single numeric variable with ≥ 3 dims'}" for f, n in found.items()
            ],
            fix="set load.variable, or leave out the files that do not hold the cube",
        )
    return names.pop()


def _base(config: NetCDFLoad, per: Mapping[str, Any], store: str | None) -> Source:
    options = canonical_json(config.storage_options) if config.storage_options else ""
    if store is not None:
        return Source(store, zarr=True, options=options)
    files = tuple(per)
    if len(files) == 1:
        return Source(files[0], options=options)
    ident = canonical_json([v["identity"] for v in per.values()])
    return _file_set(canonical_json(config.key_payload()), files, ident, options or "{}")


def check_opens(config: NetCDFLoad) -> None:
    """Open what ``load.path`` names and check the cube's variable, selection and dims.

    InputError for the first file that does not open; ContractError (every
    violation) when the cube cannot be told, or its obs / y / x dims cannot be
    identified. Reads metadata and coordinates, not the cube's values.
    """
    options = canonical_json(config.storage_options) if config.storage_options else ""
    single = single_file(config)
    if single is not None:
        base = Source(single)
    else:
        members, store = _members(config)
        if store is not None:
            base = Source(store, zarr=True, options=options)
        else:
            for f in members:
                open_netcdf(local(f, config.storage_options)).close()
            if len(members) == 1:
                base = Source(members[0], options=options)
            else:
                payload = canonical_json(config.key_payload())
                base = _file_set(payload, tuple(members), "", options or "{}")
    ds = base.open()
    try:
        var = _cube_name(config, ds)
        _cube(config, resolve_selection(ds, var, config, base).apply(ds), var)
    finally:
        base.close(ds)
