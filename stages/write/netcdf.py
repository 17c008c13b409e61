"""The ``write`` stage: one NetCDF file with the output contract, written atomically.

Coordinates and the design matrix are written first with xarray (which knows
how to encode datetimes and strings); the large variables are then created
with netCDF4 and filled tile by tile, so memory stays at one tile, as chunks
compressed on every core and stored directly (:mod:`.direct`). Everything
goes to a temporary file beside the target, renamed over it only when complete:
a crash or an error never leaves a half file under the final name. An output
for a bucket is the same file written in a private local folder, which the
storage layer then uploads and publishes (:meth:`Location.staged_file
<gridsolve.stages.engine.storage.Location.staged_file>`): the writer never asks
where its output goes.

The file's content is a pure function of the input content and the config (no
timestamps), so reruns give bit-identical files; run-specific facts (flow run,
timings) go to the Prefect artifacts instead.
"""

from __future__ import annotations

import errno
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import netCDF4
import numpy as np

from gridsolve.schemas.errors import ContractError, GridsolveError, OutputError
from gridsolve.schemas.kinds.write import NetCDFWrite
from gridsolve.schemas.metadata import LoadMeta
from gridsolve.stages.engine import storage
from gridsolve.stages.engine.context import StageContext
from gridsolve.stages.engine.outputs import Extension, OutputVariable
from gridsolve.stages.engine.paths import atomic_file, sweep_dead_temporaries
from gridsolve.stages.engine.registry import StageDecl, register
from gridsolve.stages.engine.store import Artifact, StageOutput, TiledArtifact
from gridsolve.stages.write.direct import ChunkWriter
from gridsolve.stages.write.layout import (
    chunk_alignment,
    chunk_sizes,
    dim_labels,
    extensions,
    file_dims,
    flat_labels,
    output_variables,
    run_attrs,
    side_files,
    skeleton,
    tile_plan,
    write_side_files,
)
from gridsolve.stages.write.target import free_bytes, side_facts, still_valid

VERSION = "2"
STAGE = "write/netcdf"


def _label_var(
    nc: netCDF4.Dataset, name: str, dim: str, labels: Sequence[str], long_name: str
) -> None:
    """A CF label variable ``name(dim, <name>_strlen)`` of chars."""
    raw = np.array([s.encode() for s in labels])
    strlen = f"{name}_strlen"
    nc.createDimension(strlen, max(1, raw.dtype.itemsize))
    var = nc.createVariable(name, "S1", (dim, strlen))
    var.long_name = long_name
    var.setncattr("_Encoding", "utf-8")  # how xarray and NCO read it back as text
    var[:] = netCDF4.stringtochar(raw.astype(f"S{max(1, raw.dtype.itemsize)}"))


def _keep_obs_units(nc: netCDF4.Dataset, load: Artifact) -> None:
    """The obs coordinate's units attribute spelt as in the input."""
    meta = LoadMeta.of(load)
    obs_dim = meta.obs_dim
    cf = meta.coord_cf.get("obs") or {}
    units = (cf.get("encoding") or {}).get("units")
    var = nc.variables[obs_dim]
    if units and "units" in var.ncattrs() and _same_time_units(str(var.units), str(units)):
        # xarray normalises the reference date's spelling; keep the input's. (Only when it
        # is a respelling: values that did not fit the input's units were written in others.)
        var.units = units


def _same_time_units(a: str, b: str) -> bool:
    """Whether CF time units ``a`` and ``b`` name the same unit and reference instant."""
    import cftime

    try:
        same_unit = a.split()[0].lower().rstrip("s") == b.split()[0].lower().rstrip("s")
        return same_unit and bool(
            cftime.num2date(0, a, "proleptic_gregorian")
            == cftime.num2date(0, b, "proleptic_gregorian")
        )
    except (ValueError, IndexError):
        return False


def _define(
    nc: netCDF4.Dataset,
    v: OutputVariable,
    first: np.ndarray,
    sizes: dict[str, int],
    config: NetCDFWrite,
    yx: tuple[str, str],
    lead_dims: Sequence[str] = (),
) -> None:
    """Create variable ``v`` (and its dims, index and label variables) from its first tile."""
    lead = first.shape[:-2]
    if v.flat_from is not None:
        labels = flat_labels(v, lead)
        lead = (len(labels),)
    for d, n in zip(v.dims[:-2], lead, strict=True):
        if sizes.setdefault(d, n) != n:
            raise ContractError(
                f"dim {d!r} would have two sizes in the output ({sizes[d]} and {n})",
                stage=STAGE,
                fix="rename the model's dims (gridsolve_dims) so they do not clash with the "
                "input's",
            )
        if d not in nc.dimensions:
            nc.createDimension(d, n)
    if v.flat_from is not None:
        index = v.dims[0]
        coord = nc.createVariable(index, "i4", (index,))
        coord.long_name = f"position in the flattened dims of {v.name}"
        coord.units = "1"
        coord[:] = np.arange(lead[0], dtype=np.int32)
        what = f"{', '.join(v.flat_from)} of each element of {v.name}"
        _label_var(nc, f"{v.name}_label", index, labels, what)
    dims = file_dims(v, lead_dims)
    shape = [sizes[d] for d in dims]
    var = nc.createVariable(  # type: ignore[call-overload]
        v.name,
        first.dtype,
        dims,
        zlib=config.zlib and config.complevel > 0,
        complevel=config.complevel or 1,
        shuffle=config.shuffle,
        chunksizes=chunk_sizes(dims, shape, *yx, config),
        fill_value=np.nan if first.dtype.kind == "f" else None,
    )
    var.setncatts(v.attrs)


def _block(
    data: np.ndarray, window: Mapping[str, Any], lead_dims: Sequence[str], yx: tuple[str, str]
) -> tuple[tuple[slice, ...], np.ndarray]:
    """Where one tile of a variable goes in the file (a slice per dim), and its data so shaped."""
    own = data.shape[:-2]  # the variable's own leading dims, whole
    index = [slice(0, n) for n in own]
    index += [slice(int(window[d]), int(window[d]) + 1) for d in lead_dims]
    index += [window[yx[0]], window[yx[1]]]
    shaped = data.reshape(*own, *([1] * len(lead_dims)), *data.shape[-2:])
    return tuple(index), shaped


def _write_failure(exc: OSError | RuntimeError, final: Path) -> OutputError:
    """The user error for a write that failed: no permission, no space, or another cause."""
    if isinstance(exc, PermissionError) or (
        isinstance(exc, OSError) and exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS)
    ):
        # before the free-space test: a folder one may not write (/proc) has none free
        return OutputError(
            f"writing {final} failed: not allowed to write there",
            stage=STAGE,
            found=f"{type(exc).__name__}: {exc}",
            fix="choose a write.path in a folder you may write to; "
            "nothing was written under the final name",
        )
    # HDF5 reports a full disk or a size limit as a generic "HDF error".
    space = isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT)
    if space or "HDF error" in str(exc) or free_bytes(final.parent) < 2**20:
        return OutputError(
            f"writing {final} failed: no space left (disk full, quota or file size limit)",
            stage=STAGE,
            found=f"{type(exc).__name__}: {exc}",
            fix="free disk space or write to a larger disk; "
            "nothing was written under the final name",
        )
    return OutputError(
        f"writing {final} failed",
        stage=STAGE,
        found=f"{type(exc).__name__}: {exc}",
        fix="check write.path; nothing was written under the final name",
    )


def write_netcdf(
    config: NetCDFWrite,
    load: Artifact,
    design: Artifact | None,
    tiled: Mapping[str, TiledArtifact],
    attrs: Mapping[str, Any],
    extras: Sequence[Extension] = (),
) -> dict[str, Any]:
    """Write the output file, whole or not at all, and return the facts of what was written.

    ``tiled`` holds every tiled input by kind (all on the same tile plan); each
    output variable is filled tile by tile, so memory stays at one tile.
    ``extras``: what whole input kinds add (variables, attributes, side files).
    The facts (size and checksum, or the ETag) are what a cache hit checks.
    """
    options = config.storage_options
    where = storage.at(config.path, options)
    where = where.check_output(config.overwrite, folder=False, stage=STAGE)
    sides = list(side_files(extras))

    def describe() -> dict[str, Any]:
        return {**where.facts(), **side_facts(where.text, sides, options)}

    # A local output is written where it goes; one for a bucket in a private local
    # folder, then uploaded and published (the location knows which).
    with where.staged_file(sides, describe) as staged:
        _write_file(staged.path, config, load, design, tiled, attrs, extras)
    return staged.facts


def _write_file(
    final: Path,
    config: NetCDFWrite,
    load: Artifact,
    design: Artifact | None,
    tiled: Mapping[str, TiledArtifact],
    attrs: Mapping[str, Any],
    extras: Sequence[Extension],
) -> None:
    """The file at the local path ``final`` (a temporary file renamed over it), then its sides."""
    sweep_dead_temporaries(final)
    variables = output_variables(load, design, tiled, config.layout)
    grid = LoadMeta.of(load)
    yx = (grid.y_dim, grid.x_dim)
    plan = tile_plan(tiled)
    try:
        with atomic_file(final) as tmp:
            base = skeleton(load, design, attrs, dim_labels(tiled))
            for extra in extras:
                extra.add(base)
            base.to_netcdf(tmp, engine="netcdf4", format="NETCDF4")
            with netCDF4.Dataset(tmp, "a") as nc:
                _keep_obs_units(nc, load)
                sizes = {yx[0]: grid.ny, yx[1]: grid.nx}
                sizes.update({d: len(dim) for d, dim in nc.dimensions.items()})
                first = {kind: art.tiles[0][1] for kind, art in tiled.items()}
                lead_dims = list(grid.lead_dims)
                for v in variables:
                    _define(nc, v, v.data(first), sizes, config, yx, lead_dims)
            # The data: compressed chunks on every core, written straight into the file.
            with ChunkWriter(tmp) as out:
                for i, tile in enumerate(plan):
                    arts = {kind: art.tiles[i][1] for kind, art in tiled.items()}
                    window = grid.plane_window(tile)
                    for v in variables:
                        data = v.data(arts)
                        if v.flat_from is not None:
                            data = data.reshape(-1, *data.shape[-2:])
                        out.write(v.name, *_block(data, window, lead_dims, yx))
        write_side_files(extras, final)
    except GridsolveError:
        raise
    except (OSError, RuntimeError) as exc:
        raise _write_failure(exc, final) from exc


def run(config: NetCDFWrite, inputs: Mapping[str, Any], ctx: StageContext) -> StageOutput:
    """Write the output NetCDF; the stored artifact records its size and checksum."""
    attrs = run_attrs(config, inputs, ctx)
    tiled = {k: a for k, a in inputs.items() if isinstance(a, TiledArtifact)}
    meta = write_netcdf(
        config, inputs["load"], inputs.get("design"), tiled, attrs, extensions(inputs)
    )
    return StageOutput(meta=meta)


register(
    StageDecl(
        kind="write",
        impl="netcdf",
        version=VERSION,
        config=NetCDFWrite,
        run=run,
        inputs=("load", "solve"),
        # design and normal_equations: none under solve: curvefit
        optional_inputs=("design", "normal_equations", "model", "train"),
        verify=still_valid,
        records_sources=True,
        writes_outputs=True,
        alignment=lambda cfg, grid: chunk_alignment(cfg, grid["y_dim"], grid["x_dim"]),
        summary="one NetCDF file, atomically",
    )
)
