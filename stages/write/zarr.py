"""The ``write`` stage as a Zarr store: the NetCDF output's contract, for object stores and Dask.

Same variables, dims, coordinates and attributes as ``write.impl: netcdf``
(both write what :mod:`~gridsolve.stages.write.layout` describes),
value for value. The store is built in a temporary folder beside ``write.path``:
its metadata first (from xarray, so ``xarray.open_zarr`` reads it back with the
CF decoding), then each tile's data into the chunks it covers, then the
consolidated metadata (``.zmetadata``), written last; only then is the folder
renamed to ``write.path``. A reader therefore finds the previous store or the
complete new one, or for an instant none (``stages.engine.paths.atomic_folder``);
a store without ``.zmetadata`` is not a complete gridsolve output.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from gridsolve.schemas.errors import ContractError, GridsolveError, OutputError
from gridsolve.schemas.kinds.write import ZarrWrite
from gridsolve.schemas.metadata import LoadMeta, WriteMeta
from gridsolve.stages.engine import remote, storage
from gridsolve.stages.engine.context import StageContext
from gridsolve.stages.engine.hashing import canonical_json, file_digest, hash_text
from gridsolve.stages.engine.paths import BESIDE_SUFFIXES, atomic_folder, sweep_dead_temporaries
from gridsolve.stages.engine.registry import StageDecl, register

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
from gridsolve.stages.write.target import (
    check_output_path,
    check_output_url,
    side_facts,
    sides_unchanged,
    staging_root,
)

STAGE = "write/zarr"
VERSION = "2"
#: Zarr format 2: consolidated metadata (``.zmetadata``) and text arrays are part of its
#: specification (in format 3 both are still extensions that zarr-python warns about).
ZARR_FORMAT: Literal[2] = 2
#: The object that marks a store in a bucket as being written by gridsolve (removed last).
WRITING = ".gridsolve-writing"


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
    design: Artifact,
    tiled: Mapping[str, TiledArtifact],
    attrs: Mapping[str, Any],
    extras: Sequence[Extension] = (),
) -> Path | str:
    """Write the output store (complete, then renamed into place) and return its path."""
    if storage.at(config.path).local is None:  # a bucket has no rename: written in place
        return _write_to_url(config, load, design, tiled, attrs, extras)
    final = check_output_path(config.path, config.overwrite, folder=True, stage=STAGE)
    sweep_dead_temporaries(final)
    tile_plan(tiled)
    try:
        with atomic_folder(final) as tmp:
            _fill(str(tmp), None, config, load, design, tiled, attrs, extras)
        write_side_files(extras, final)
    except GridsolveError:
        raise
    except (OSError, RuntimeError) as exc:
        raise OutputError(
            f"writing {final} failed",
            stage=STAGE,
            found=f"{type(exc).__name__}: {exc}",
            fix="check write.path and the free space; nothing was written under the final name",
        ) from exc
    return final


def _fill(
    store: str,
    options: Mapping[str, Any] | None,
    config: ZarrWrite,
    load: Artifact,
    design: Artifact,
    tiled: Mapping[str, TiledArtifact],
    attrs: Mapping[str, Any],
    extras: Sequence[Extension],
) -> None:
    """Metadata, then every tile's chunks, then the consolidated metadata (last) into ``store``."""
    variables = output_variables(load, design, tiled, config.layout)
    plan = tile_plan(tiled)
    base = skeleton(load, design, attrs)
    for extra in extras:
        extra.add(base)
    first = {kind: art.tiles[0][1] for kind, art in tiled.items()}
    template = _template(config, load, variables, first, base)
    so = remote.storage_options(options) if options is not None else None
    import zarr

    with zarr.config.set({"array.write_empty_chunks": True}):  # the coordinates' chunks too
        template.to_zarr(
            store,
            mode="w",
            compute=False,
            consolidated=False,
            zarr_format=ZARR_FORMAT,
            storage_options=so,
        )
    group = zarr.open_group(store, mode="r+", zarr_format=ZARR_FORMAT, storage_options=so)
    _write_tiles(group, variables, tiled, plan, LoadMeta.of(load))
    # Last: the mark of a complete store.
    zarr.consolidate_metadata(group.store, zarr_format=ZARR_FORMAT)


def _write_to_url(
    config: ZarrWrite,
    load: Artifact,
    design: Artifact,
    tiled: Mapping[str, TiledArtifact],
    attrs: Mapping[str, Any],
    extras: Sequence[Extension],
) -> str:
    """Write the store straight into the bucket; ``.zmetadata`` goes first out and last in.

    A bucket has no rename: the old store's ``.zmetadata`` is deleted before
    anything else changes, so from then on readers that honour it (gridsolve,
    ``xarray.open_zarr(consolidated=True)``) see no complete store until the
    new one's ``.zmetadata`` lands, last. A failure deletes what was written.
    """
    options = config.storage_options
    url = check_output_url(config.path, config.overwrite, options, folder=True, stage=STAGE)
    tile_plan(tiled)  # before the old store is touched
    sides = side_files(extras)
    # what describes the old store goes with it
    beside = [f"{url}{suffix}" for suffix in dict.fromkeys((*BESIDE_SUFFIXES, *sides))]
    with remote.translated(url, "output", OutputError, STAGE, options):
        remote.remove(f"{url}/.zmetadata", options)
        remote.remove(url, options)
        for extra in beside:
            remote.remove(extra, options)
        # Marks the prefix as gridsolve's own store being written, so that what a killed
        # writer leaves is replaced by the next run rather than refused as someone's data.
        remote.filesystem(url, options).pipe_file(f"{url}/{WRITING}", b"gridsolve")
        try:
            _fill(url, options, config, load, design, tiled, attrs, extras)
            if sides:
                staging = Path(tempfile.mkdtemp(prefix="write-", dir=staging_root()))
                try:
                    store_name = staging / url.rsplit("/", 1)[-1]
                    for suffix, write in sides.items():
                        write(Path(f"{store_name}{suffix}"))
                        remote.upload(
                            Path(f"{store_name}{suffix}"), f"{url}{suffix}", options, "side file"
                        )
                finally:
                    shutil.rmtree(staging, ignore_errors=True)
            remote.remove(f"{url}/{WRITING}", options)
        except BaseException:
            with contextlib.suppress(Exception):
                remote.remove(f"{url}/.zmetadata", options)
                remote.remove(url, options)
                for suffix in sides:
                    remote.remove(f"{url}{suffix}", options)
            raise
    return url


def _url_facts(url: str, options: Mapping[str, Any]) -> dict[str, Any]:
    """URL, size and a digest of every object's ETag of a store in a bucket."""
    objects = remote.find(url, options)
    digests = [[u[len(url) + 1 :], i["etag"], i["size"]] for u, i in objects.items()]
    return {
        "path": url,
        "size": sum(i["size"] for i in objects.values()),
        "xxh3": hash_text(canonical_json(digests)),
        "storage_options": dict(options),
    }


def _store_facts(path: Path) -> dict[str, Any]:
    """Path, size and a digest of every file of the store (names included)."""
    files = sorted(p for p in path.rglob("*") if p.is_file())
    digests = [[str(p.relative_to(path)), file_digest(p)] for p in files]
    return {
        "path": str(path),
        "size": sum(p.stat().st_size for p in files),
        "xxh3": hash_text(canonical_json(digests)),
    }


def still_valid(meta: Mapping[str, Any]) -> bool:
    """Whether the store (and its side files) a stored write artifact describes are intact."""
    typed = WriteMeta.of(meta)
    if storage.at(typed.path).local is None:
        try:
            if _url_facts(typed.path, typed.storage_options) != dict(
                {k: v for k, v in meta.items() if k != "side_files"}
            ):
                return False
        except Exception:  # gone or unreachable: write it again
            return False
        return sides_unchanged(meta)
    p = Path(typed.path)
    try:
        if not p.is_dir() or _store_facts(p) != {k: meta[k] for k in ("path", "size", "xxh3")}:
            return False
    except OSError:
        return False
    return sides_unchanged(meta)


def run(config: ZarrWrite, inputs: Mapping[str, Any], ctx: StageContext) -> StageOutput:
    """Write the output Zarr store; the stored artifact records its size and checksum."""
    attrs = run_attrs(config, inputs, ctx)
    tiled = {k: a for k, a in inputs.items() if isinstance(a, TiledArtifact)}
    extras = extensions(inputs)
    path = write_zarr(config, inputs["load"], inputs["design"], tiled, attrs, extras)
    options = config.storage_options
    made = _url_facts(path, options) if isinstance(path, str) else _store_facts(path)
    return StageOutput(meta={**made, **side_facts(path, side_files(extras), options)})


register(
    StageDecl(
        kind="write",
        impl="zarr",
        version=VERSION,
        config=ZarrWrite,
        run=run,
        inputs=("load", "design", "normal_equations", "solve"),
        optional_inputs=("model", "train"),
        verify=still_valid,
        records_sources=True,
        writes_outputs=True,
        alignment=lambda cfg, grid: chunk_alignment(cfg, grid["y_dim"], grid["x_dim"]),
        summary="a Zarr store, complete before it appears",
    )
)
