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
:mod:`.scan`, :mod:`.blocks` (tile reads, change detection) and
:mod:`.inputs` (file sets and stores).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from gridsolve.schemas.kinds.load import DemoLoad, NetCDFLoad
from gridsolve.schemas.metadata import LoadMeta
from gridsolve.stages.engine.context import StageContext
from gridsolve.stages.engine.registry import StageDecl, register
from gridsolve.stages.engine.store import Artifact, StageOutput
from gridsolve.stages.load.blocks import read_block
from gridsolve.stages.load.demo import demo_file
from gridsolve.stages.load.inputs import _base, _set_facts, _single
from gridsolve.stages.load.scan import scan_netcdf, scan_source

VERSION = "1"


def fingerprint(config: NetCDFLoad | DemoLoad, ctx: StageContext) -> dict[str, str]:
    """Content digest of the input: the selected variables of one file, or every file's bytes."""
    path, nc = _netcdf_config(config, ctx)
    if path is not None:
        return {"content": scan_netcdf(nc, path).digest}
    return {"content": _set_facts(nc, ctx)[1]}


def run(
    config: NetCDFLoad | DemoLoad, inputs: Mapping[str, Artifact], ctx: StageContext
) -> StageOutput:
    """Checked description of the input plus its coords, design and shared weights."""
    path, nc = _netcdf_config(config, ctx)
    if path is not None:
        return scan_netcdf(nc, path).output
    per, digest, store = _set_facts(nc, ctx)
    out = scan_source(nc, _base(nc, per, store), per).output
    # The key covers the files' bytes: the guard compares this run's with them.
    return StageOutput(arrays=out.arrays, meta={**out.meta, "content_hash": digest})


def locate(config: NetCDFLoad | DemoLoad, ctx: StageContext) -> dict[str, Any]:
    """Where the input is this run: path(s), file identities and content digest when scanned.

    Per-run facts (the runner attaches them to the ref): never part of the key
    or of the stored artifact, which are by content.
    """
    path, nc = _netcdf_config(config, ctx)
    if path is not None:
        scan = scan_netcdf(nc, path)  # memoised: the fingerprint scanned this file state
        return {
            "path": path,
            "file": scan.identity,
            "content": scan.digest,
            "config": nc.key_payload(),
        }
    per, digest, store = _set_facts(nc, ctx)
    base = _base(nc, per, store)
    return {
        "path": base.path,
        "source": base.describe(),
        "files": {f: per[f] for f in (base.files or per)},
        "content": digest,
        "config": nc.key_payload(),
    }


def _netcdf_config(
    config: NetCDFLoad | DemoLoad, ctx: StageContext
) -> tuple[str | None, NetCDFLoad]:
    """The one file to read (None: a file set or store) and the config to read it with."""
    if isinstance(config, DemoLoad):
        path = demo_file(ctx.store.root, config.size, config.seed, config.nan_fraction)
        return os.path.abspath(path), NetCDFLoad(path=str(path), variable="signal")
    return _single(config), config


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
