"""The ``write`` stage as a Zarr store: the NetCDF output's contract, for object stores and Dask.

Same variables, dims, coordinates and attributes as ``write.impl: netcdf``
(both write what :mod:`~gridsolve.stages.write.layout` describes),
value for value. The store is built in a temporary folder beside ``write.path``:
its metadata first (from xarray, so ``xarray.open_zarr`` reads it back with the
CF decoding), then each tile's data into the chunks it covers, then the
consolidated metadata (``.zmetadata``), written last; only then is the folder
renamed to ``write.path``. A reader therefore finds the previous store or the
complete new one, or for an instant none (``stages.engine.paths.atomic_folder``);
a store without ``.zmetadata`` is not a complete gridsolve output. A bucket has
no rename: there the store is written in place, the old one's ``.zmetadata``
deleted first and the new one's written last. The storage layer does either
(:meth:`Location.staged_store <gridsolve.stages.engine.storage.Location.staged_store>`):
the writer never asks where its output goes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from gridsolve.schemas.errors import ContractError
from gridsolve.schemas.kinds.write import ZarrWrite
from gridsolve.schemas.metadata import LoadMeta, WriteMeta
from gridsolve.stages.engine import storage
from gridsolve.stages.engine.context import StageContext
from gridsolve.stages.engine.registry import StageDecl, register
from gridsolve.stages.engine.storage import Location

if TYPE_CHECKING:
    import xarray as xr
    import zarr

# zarr and dask are imported where a store is written, not here: every run imports
# this module (it registers the writer), and they cost a third of a second.
from gridsolve.stages.engine.outputs import Extension, OutputVariable
from gridsolve.stages.engine.store import Artifact, StageOutput, TiledArtifact
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
)
from gridsolve.stages.write.target import side_facts, sides_unchanged

STAGE = "write/zarr"
VERSION = "2"
#: Zarr format 2: consolidated metadata (``.zmetadata``) and text arrays are part of its
#: specification (in format 3 both are still extensions that zarr-python warns about).
ZARR_FORMAT: Literal[2] = 2


def _template(
    config: ZarrWrite,
    load: Artifact,
    variables: list[OutputVariable],
    first: Mapping[str, Artifact],
    base: xr.Dataset,
) -> xr.Dataset:
    """``base`` plus every tiled variable as an unwritten (lazy) array of its full shape."""
    meta = LoadMeta.of(load)
    yx = (meta.y_dim, meta.x_dim)
    sizes: dict[str, int] = {yx[0]: meta.ny, yx[1]: meta.nx}
    sizes.update({str(d): int(n) for d, n in base.sizes.items()})
    lead_dims = meta.lead_dims
    sizes.update(zip(lead_dims, meta.lead_shape, strict=True))
    out = base.copy()
    for v in variables:
        data = v.data(first)
        own = data.shape[:-2]
        if v.flat_from is not None:
            labels = flat_labels(v, own)
            own = (len(labels),)
            index = v.dims[0]
            out.coords[index] = (
                index,
                np.arange(own[0], dtype=np.int32),
                {"long_name": f"position in the flattened dims of {v.name}", "units": "1"},
            )
            out.coords[f"{v.name}_label"] = (
                index,
                np.array(labels, dtype=str),
                {"long_name": f"{', '.join(v.flat_from)} of each element of {v.name}"},
            )
        for d, n in zip(v.dims[:-2], own, strict=True):
            if sizes.setdefault(d, n) != n:
                raise ContractError(
                    f"dim {d!r} would have two sizes in the output ({sizes[d]} and {n})",
                    stage=STAGE,
                    fix="rename the model's dims (gridsolve_dims) so they do not clash with "
                    "the input's",
                )
        dims = file_dims(v, lead_dims)
        shape = [sizes[d] for d in dims]
        chunks = chunk_sizes(dims, shape, *yx, config)
        fill = np.nan if data.dtype.kind == "f" else 0
        import dask.array as dsa

        lazy = dsa.full(shape, fill, dtype=data.dtype, chunks=chunks)  # type: ignore[no-untyped-call]
        out[v.name] = (dims, lazy, v.attrs)
        out[v.name].encoding.update(
            chunks=tuple(chunks), _FillValue=np.nan if data.dtype.kind == "f" else None
        )
    for name in list(out.variables):
        # NetCDF's char label encoding does not apply to Zarr, which stores text as is.
        for key in ("char_dim_name", "dtype"):
            if out[name].dtype.kind == "U":
                out[name].encoding.pop(key, None)
    return out


def _write_tiles(
    group: zarr.Group,
    variables: list[OutputVariable],
    tiled: Mapping[str, TiledArtifact],
    plan: list[Any],
    meta: LoadMeta,
) -> None:
    """Each tile's data into the store's arrays, every chunk written (even all-zero ones).

    Zarr leaves a chunk that equals the fill value unwritten; integer variables
    (status flags) have no fill value, and a reader would then make up values.
    """
    import zarr

    yx = (meta.y_dim, meta.x_dim)
    lead_dims = meta.lead_dims

    def write(v: OutputVariable, arts: Mapping[str, Artifact], at: tuple[Any, ...]) -> None:
        data = v.data(arts)
        if v.flat_from is not None:
            data = data.reshape(-1, *data.shape[-2:])
        array = arrays[v.name]
        assert isinstance(array, zarr.Array)
        array[at] = data

    # The variables of a tile are written at once (each is its own array, so no two
    # writes share a chunk; two tiles may share one, so tiles go one after the other).
    with (
        zarr.config.set({"array.write_empty_chunks": True}),
        ThreadPoolExecutor(max_workers=min(8, len(variables))) as pool,
    ):
        # Opened inside the setting: zarr reads write_empty_chunks when an array is opened.
        arrays = {v.name: group[v.name] for v in variables}
        for i, tile in enumerate(plan):
            arts = {kind: art.tiles[i][1] for kind, art in tiled.items()}
            window = meta.plane_window(tile)
            at = (..., *(window[d] for d in lead_dims), window[yx[0]], window[yx[1]])
            for done in [pool.submit(write, v, arts, at) for v in variables]:
                done.result()


def write_zarr(
    config: ZarrWrite,
    load: Artifact,
    design: Artifact | None,
    tiled: Mapping[str, TiledArtifact],
    attrs: Mapping[str, Any],
    extras: Sequence[Extension] = (),
) -> Location:
    """Write the output store (whole before it appears under its name) and return where it is."""
    where = storage.at(config.path, config.storage_options)
    where = where.check_output(config.overwrite, folder=True, stage=STAGE)
    tile_plan(tiled)  # before the old store is touched
    # Renamed into place on a disk; written in place in a bucket (the location knows which).
    with where.staged_store(side_files(extras), STAGE) as store:
        _fill(store, where.open_options(), config, load, design, tiled, attrs, extras)
    return where


def _fill(
    store: str,
    options: dict[str, Any] | None,
    config: ZarrWrite,
    load: Artifact,
    design: Artifact | None,
    tiled: Mapping[str, TiledArtifact],
    attrs: Mapping[str, Any],
    extras: Sequence[Extension],
) -> None:
    """Metadata, then every tile's chunks, then the consolidated metadata (last) into ``store``.

    ``options``: the ``storage_options`` to open it with (None: a local folder).
    """
    variables = output_variables(load, design, tiled, config.layout)
    plan = tile_plan(tiled)
    base = skeleton(load, design, attrs, dim_labels(tiled))
    for extra in extras:
        extra.add(base)
    first = {kind: art.tiles[0][1] for kind, art in tiled.items()}
    template = _template(config, load, variables, first, base)
    import zarr

    with zarr.config.set({"array.write_empty_chunks": True}):  # the coordinates' chunks too
        template.to_zarr(
            store,
            mode="w",
            compute=False,
            consolidated=False,
            zarr_format=ZARR_FORMAT,
            storage_options=options,
        )
    group = zarr.open_group(store, mode="r+", zarr_format=ZARR_FORMAT, storage_options=options)
    _write_tiles(group, variables, tiled, plan, LoadMeta.of(load))
    # Last: the mark of a complete store.
    zarr.consolidate_metadata(group.store, zarr_format=ZARR_FORMAT)


def still_valid(meta: Mapping[str, Any]) -> bool:
    """Whether the store (and its side files) a stored write artifact describes are intact."""
    typed = WriteMeta.of(meta)
    where = storage.at(typed.path, typed.storage_options)
    return where.folder_unchanged(meta) and sides_unchanged(meta)


def run(config: ZarrWrite, inputs: Mapping[str, Any], ctx: StageContext) -> StageOutput:
    """Write the output Zarr store; the stored artifact records its size and checksum."""
    attrs = run_attrs(config, inputs, ctx)
    tiled = {k: a for k, a in inputs.items() if isinstance(a, TiledArtifact)}
    extras = extensions(inputs)
    where = write_zarr(config, inputs["load"], inputs.get("design"), tiled, attrs, extras)
    sides = side_facts(where.text, side_files(extras), config.storage_options)
    return StageOutput(meta={**where.folder_facts(), **sides})


register(
    StageDecl(
        kind="write",
        impl="zarr",
        version=VERSION,
        config=ZarrWrite,
        run=run,
        inputs=("load", "solve"),
        # design and normal_equations: none under solve: curvefit
        optional_inputs=("design", "normal_equations", "model", "train"),
        verify=still_valid,
        records_sources=True,
        writes_outputs=True,
        alignment=lambda cfg, grid: chunk_alignment(cfg, grid["y_dim"], grid["x_dim"]),
        summary="a Zarr store, complete before it appears",
    )
)
