"""The ``load`` stage: open a NetCDF cube, check its contract, hash its content.

The load stage does not copy the cube. It checks every contract of the file
(dims, dtypes, values), hashes the decoded values of every selected variable
(xxh3-128, streamed, so memory stays flat), and stores the small parts (coords,
design matrix, shared weights) plus a description that later stages use to
read their own tiles straight from the file. Tile reads check that the file
did not change since it was hashed.

The stored artifact is content-addressed and names no file: where the input
is this run (path, file identity) is per-run metadata (:func:`locate`) that
the runner attaches to the load stage's ref, so a touched or copied input
with the same content is a cache hit and later stages read the file this run
names.

This module is the stage itself (its functions and registration); the parts
live beside it by concern: :mod:`.opening`, :mod:`.source` (selection),
:mod:`.timeaxis` (CF time), :mod:`.masking` (CF valid ranges), :mod:`.dims`,
:mod:`.cube`, :mod:`.coords`, :mod:`.content` (hashing, value checks),
:mod:`.scan`, :mod:`.blocks` (tile reads, change detection),
:mod:`.inputs` (file sets and stores), :mod:`.where` (what ``load.path``
names) and :mod:`.reading` (the stage's work, imported on its first miss).
A rerun whose every stage hits finds the key without opening the input
(:mod:`.scanmemo`) and imports no xarray.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from gridsolve.schemas.kinds.load import DemoLoad, NetCDFLoad
from gridsolve.schemas.metadata import LoadMeta
from gridsolve.stages.engine.context import StageContext
from gridsolve.stages.engine.hashing import canonical_json
from gridsolve.stages.engine.registry import Lazy, StageDecl, decl_for, register
from gridsolve.stages.load import scanmemo
from gridsolve.stages.load.where import netcdf_config

VERSION = "1"

#: The stage's work, imported on its first miss (``reading`` imports xarray).
run = Lazy("gridsolve.stages.load.reading:run")
read_block = Lazy("gridsolve.stages.load.blocks:read_block")


def fingerprint(config: NetCDFLoad | DemoLoad, ctx: StageContext) -> dict[str, str]:
    """Content digest of the input: the selected variables of one file, or every file's bytes."""
    path, nc = netcdf_config(config, ctx)
    if path is not None:
        return {"content": _file_digest(config, nc, path, ctx)[1]}
    from gridsolve.stages.load.reading import set_digest

    return {"content": set_digest(nc, ctx)}


def _file_digest(
    config: NetCDFLoad | DemoLoad, nc: NetCDFLoad, path: str, ctx: StageContext
) -> tuple[dict[str, int], str]:
    """(identity, content digest) of one input file: remembered while unchanged, else scanned."""
    from gridsolve.stages.engine.runner import code_version
    from gridsolve.stages.engine.versions import package_versions

    folder = Path(ctx.store.root) / "scan-digests"
    libraries = {**package_versions(), **scanmemo.decoding_versions()}
    versions = canonical_json([code_version(decl_for(config)), libraries])
    got = scanmemo.remembered(folder, nc, path, versions)
    if got is not None:
        return got
    from gridsolve.stages.load.reading import scan_file

    scan = scan_file(nc, path)  # memoised in this process: run() reuses it
    scanmemo.remember(folder, nc, path, versions, scan.identity, scan.digest, scan.began_ns)
    return scan.identity, scan.digest


def locate(config: NetCDFLoad | DemoLoad, ctx: StageContext) -> dict[str, Any]:
    """Where the input is this run: path(s), file identities and content digest when scanned.

    Per-run facts (the runner attaches them to the ref): never part of the key
    or of the stored artifact, which are by content.
    """
    path, nc = netcdf_config(config, ctx)
    if path is not None:
        identity, digest = _file_digest(config, nc, path, ctx)  # as the fingerprint found it
        return {"path": path, "file": identity, "content": digest, "config": nc.key_payload()}
    from gridsolve.stages.load.reading import set_location

    return set_location(nc, ctx)


def grid(meta: Mapping[str, Any]) -> tuple[int, int, int]:
    """(rows, columns, rows per plane) of the grid the run is tiled over.

    Rows are the cube's batch dims and y folded together (``LoadMeta.plane_window``);
    a tile never crosses a plane boundary.
    """
    typed = LoadMeta.of(meta)
    rows, cols = typed.grid_shape()
    return rows, cols, typed.ny


for _impl, _cfg, _summary in (
    ("netcdf", NetCDFLoad, "check and hash a NetCDF cube"),
    ("demo", DemoLoad, "seeded synthetic cube (written once as NetCDF)"),
):
    register(
        StageDecl(
            kind="load",
            impl=_impl,
            version=VERSION,
            config=_cfg,
            run=run,
            fingerprint=fingerprint,
            locate=locate,
            grid=grid,
            read_block=read_block,
            summary=_summary,
        )
    )
