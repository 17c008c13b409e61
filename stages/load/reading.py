"""The load stage's work on the input: scanning one file, a file set or a Zarr store.

Imported on the stage's first miss (the stage declares ``run`` as a
:class:`~gridsolve.stages.engine.registry.Lazy`), so a rerun whose every stage
is a cache hit imports no xarray: :mod:`.netcdf` finds the key from
:mod:`.where` and :mod:`.scanmemo`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gridsolve.schemas.kinds.load import DemoLoad, NetCDFLoad
from gridsolve.stages.engine.context import StageContext
from gridsolve.stages.engine.store import Artifact, StageOutput
from gridsolve.stages.load.inputs import _base, _set_facts
from gridsolve.stages.load.scan import Scan, scan_netcdf, scan_source
from gridsolve.stages.load.where import netcdf_config


def run(
    config: NetCDFLoad | DemoLoad, inputs: Mapping[str, Artifact], ctx: StageContext
) -> StageOutput:
    """Checked description of the input plus its coords, design and shared weights."""
    path, nc = netcdf_config(config, ctx)
    if path is not None:
        return scan_netcdf(nc, path).output
    per, digest, store = _set_facts(nc, ctx)
    out = scan_source(nc, _base(nc, per, store), per).output
    # The key covers the files' bytes: the guard compares this run's with them.
    return StageOutput(arrays=out.arrays, meta={**out.meta, "content_hash": digest})


def scan_file(nc: NetCDFLoad, path: str) -> Scan:
    """The scan of one input file (memoised per file state in this process)."""
    return scan_netcdf(nc, path)


def set_digest(nc: NetCDFLoad, ctx: StageContext) -> str:
    """The one content digest of a file set or store (every file's bytes)."""
    return _set_facts(nc, ctx)[1]


def set_location(nc: NetCDFLoad, ctx: StageContext) -> dict[str, Any]:
    """Where a file set or store is this run: its members, their identities and its digest."""
    per, digest, store = _set_facts(nc, ctx)
    base = _base(nc, per, store)
    return {
        "path": base.path,
        "source": base.describe(),
        "files": {f: per[f] for f in (base.files or per)},
        "content": digest,
        "config": nc.key_payload(),
    }
