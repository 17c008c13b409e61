"""Where the cube is read from, and the sub-cube load.isel / load.select pick.

A :class:`Source` is one NetCDF file, several combined along obs (opened once
per process and kept), or a Zarr store; every read goes through it, so the
scan, the hash and the tile reads see the same sub-cube.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import xarray as xr

from gridsolve.schemas.errors import ContractError, InputError
from gridsolve.schemas.kinds.load import IndexRange, LabelRange, NetCDFLoad
from gridsolve.schemas.pipeline import suggest
from gridsolve.stages.engine.hashing import (
    canonical_json,
    file_identity,
)
from gridsolve.stages.load import files as filesets
from gridsolve.stages.load.base import _OPEN_LOCK, STAGE, _open_raw_file
from gridsolve.stages.load.dims import cf_roles, infer_dims
from gridsolve.stages.load.masking import (
    _SET_MASKS,
    _VALID_ATTRS,
    MaskCount,
    _masked_file,
    _outside,
    valid_bounds,
)
from gridsolve.stages.load.opening import _open_zarr, local, open_netcdf


@dataclass(frozen=True)
class Source:
    """Where the cube is and the positions of each dim it uses (load.isel/select resolved).

    The cube is a NetCDF file, several combined along obs, or a Zarr store.

    Every read goes through :meth:`open_selected`, so the scan, the hash and the
    tile reads all see the same sub-cube. A dim with one position (an int) is
    dropped; a tuple of positions keeps the dim.
    """

    path: str
    positions: tuple[tuple[str, int | tuple[int, ...]], ...] = ()
    #: NetCDF files combined along ``obs_dim``, in observation order (empty: ``path`` alone)
    files: tuple[str, ...] = ()
    obs_dim: str = ""
    zarr: bool = False
    #: ``load.storage_options`` as canonical JSON, for URLs (never credentials)
    options: str = ""

    def __str__(self) -> str:
        if len(self.files) > 1:
            return f"{self.files[0]} (1 of {len(self.files)} files)"
        return self.path

    def describe(self) -> dict[str, Any]:
        """The source without its positions, as JSON (``files`` and ``zarr`` only when set)."""
        out: dict[str, Any] = {"path": self.path}
        if self.files:
            out.update(files=list(self.files), obs_dim=self.obs_dim)
        if self.zarr:
            out["zarr"] = True
        if self.options:
            out["options"] = self.options
        return out

    @classmethod
    def from_description(cls, d: Mapping[str, Any], positions: Any = ()) -> Source:
        """The inverse of :meth:`describe`, with ``positions`` as stored in metadata."""
        return cls(
            path=str(d["path"]),
            positions=tuple((k, p if isinstance(p, int) else tuple(p)) for k, p in positions),
            files=tuple(d.get("files") or ()),
            obs_dim=str(d.get("obs_dim", "")),
            zarr=bool(d.get("zarr", False)),
            options=str(d.get("options", "")),
        )

    def indexers(self) -> dict[str, Any]:
        """The positions as ``.isel`` indexers (runs of equal steps as slices)."""
        return {d: p if isinstance(p, int) else _as_slice(p) for d, p in self.positions}

    def apply(self, ds: xr.Dataset) -> xr.Dataset:
        """``ds`` cut to the selected sub-cube (lazily)."""
        return ds.isel(self.indexers()) if self.positions else ds

    def open(self, raw: bool = False) -> xr.Dataset:
        """The whole dataset, decoded or (``raw``) as stored; close with :meth:`close`."""
        if self.zarr:
            return _open_zarr(self.path, raw, self.storage_options)
        if len(self.files) > 1:
            return _open_files(self.files, self.obs_dim, raw, self.options)
        path = local(self.path, self.storage_options)
        return _open_raw_file(path) if raw else open_netcdf(path)

    @property
    def storage_options(self) -> dict[str, Any]:
        """``load.storage_options`` of the URLs."""
        return dict(json.loads(self.options)) if self.options else {}

    def open_selected(self, raw: bool = False) -> xr.Dataset:
        """The selected sub-cube, decoded or (``raw``) as stored; close with :meth:`close`."""
        return self.apply(self.open(raw))

    def close(self, ds: xr.Dataset) -> None:
        """Close a dataset :meth:`open` gave (combined file sets stay open for later tiles)."""
        if len(self.files) <= 1:
            ds.close()


#: Combined file sets opened in this process: (files, raw, identities) → dataset.
_OPENED: dict[tuple[tuple[str, ...], bool, str], xr.Dataset] = {}


def _open_files(files: tuple[str, ...], obs_dim: str, raw: bool, options: str = "") -> xr.Dataset:
    given = files
    opts = json.loads(options) if options else {}
    files = tuple(local(f, opts) for f in files)  # per object version: a new one, a new path
    ident = canonical_json([file_identity(f) for f in files])
    key = (files, raw, ident)
    with _OPEN_LOCK:
        if key not in _OPENED:
            while len(_OPENED) >= 4:
                _OPENED.pop(next(iter(_OPENED))).close()
            parts: list[xr.Dataset] = []
            counts: dict[str, MaskCount] = {}
            try:
                for f in files:
                    parts.append(_open_raw_file(f, chunks={}) if raw else _masked_file(f, counts))
            except BaseException:
                for part in parts:
                    part.close()
                raise
            combined = filesets.concat(parts, range(len(parts)), obs_dim)
            if not raw:
                while len(_SET_MASKS) >= 8:
                    _SET_MASKS.pop(next(iter(_SET_MASKS)))
                _SET_MASKS[given] = counts
            # Interleaved files are read in observation order; raw reads take the order of
            # the decoded times (raw numbers may count from another date in each file).
            obs = combined[obs_dim].values if not raw else _decoded_obs(files, obs_dim)
            sort = filesets.obs_sort(np.asarray(obs))
            if sort is not None:
                from dask.array import PerformanceWarning

                with warnings.catch_warnings():
                    # dask warns that the out-of-order take makes more chunks: it must
                    warnings.simplefilter("ignore", PerformanceWarning)
                    combined = combined.isel({obs_dim: sort})

            def close_parts(parts: list[xr.Dataset] = parts) -> None:
                for part in parts:
                    part.close()

            # Closing the combined set closes its files (xarray reopens a closed file
            # on the next read, so a tile still holding it reads on).
            combined.set_close(close_parts)
            _OPENED[key] = combined
        return _OPENED[key]


def _decoded_obs(files: tuple[str, ...], obs_dim: str) -> np.ndarray:
    """The files' decoded obs coordinates, one after the other."""
    values = []
    for f in files:
        with open_netcdf(f, chunks={}) as ds:
            values.append(np.asarray(ds[obs_dim].values))
    return np.concatenate(values)


def _as_slice(positions: tuple[int, ...]) -> slice | list[int]:
    steps = {b - a for a, b in itertools.pairwise(positions)}
    if len(positions) == 1:
        return slice(positions[0], positions[0] + 1)
    if len(steps) == 1 and (step := steps.pop()) > 0:
        return slice(positions[0], positions[-1] + 1, step)
    return list(positions)


def _spec(value: Any) -> Any:
    """A config selection value as ``.isel``/``.sel`` takes it."""
    if isinstance(value, IndexRange):
        return slice(value.start, value.stop, value.step)
    if isinstance(value, LabelRange):
        return slice(value.start, value.stop)
    return value


def _shown(value: Any) -> str:
    if isinstance(value, IndexRange | LabelRange):
        return json.dumps(value.model_dump(exclude_none=True))
    return json.dumps(value)


def resolve_selection(ds: xr.Dataset, var: str, config: NetCDFLoad, base: Source) -> Source:
    """The positions load.isel, then load.select, pick in ``var``'s dims; ContractError if none.

    Labels are matched on the decoded coordinates (dates as text work, like
    xarray's ``.sel``); the result is positions, so raw and decoded reads agree.
    """
    if not (config.isel or config.select):
        return base
    if var not in ds.variables:
        return base  # the cube checks say what is missing
    dims = [str(d) for d in ds[var].dims]
    problems = [
        f"load.{field}: {dim!r} is not a dim of {var!r} (its dims are {dims}){suggest(dim, dims)}"
        for field, sel in (("isel", config.isel), ("select", config.select))
        for dim in sel
        if dim not in dims
    ]
    if problems:
        raise ContractError(
            "the selection names dims the cube does not have",
            stage=STAGE,
            violations=problems,
            fix="name the cube's own dims in load.isel / load.select",
        )
    positions: list[tuple[str, int | tuple[int, ...]]] = []
    for dim in dict.fromkeys([*config.isel, *config.select]):
        n = int(ds.sizes[dim])
        index = xr.DataArray(np.arange(n), dims=dim)
        if dim in ds.indexes:
            index = index.assign_coords({dim: ds.indexes[dim]})
        try:
            if dim in config.isel:
                index = index.isel({dim: _spec(config.isel[dim])})
            if dim in config.select:
                if dim not in ds.indexes:
                    raise KeyError(f"{dim!r} has no coordinate to select labels from")
                index = index.sel({dim: _spec(config.select[dim])})
        except (KeyError, IndexError, ValueError, TypeError) as exc:
            coord = ds.indexes.get(dim)
            span = f"{coord[0]} … {coord[-1]}" if coord is not None and len(coord) else "none"
            asked = {"isel": config.isel.get(dim), "select": config.select.get(dim)}
            wanted = ", ".join(
                f"load.{k}.{dim}={_shown(v)}" for k, v in asked.items() if v is not None
            )
            raise ContractError(
                f"the selection along {dim!r} matches nothing in the file",
                stage=STAGE,
                found=f"{wanted}; {dim!r} has {n} values ({span})",
                fix=f"give load.isel.{dim} positions below {n} or load.select.{dim} labels "
                "that the coordinate holds",
            ) from exc
        values = np.asarray(index.values)
        if values.ndim == 0:
            positions.append((dim, int(values)))
        elif values.size == 0:
            raise ContractError(
                f"the selection along {dim!r} keeps no values",
                stage=STAGE,
                fix=f"widen load.isel.{dim} / load.select.{dim}",
            )
        else:
            positions.append((dim, tuple(int(v) for v in values)))
    dropped = [d for d, p in positions if isinstance(p, int)]
    obs, y, x, _ = infer_dims(
        tuple(dims), config.obs_dim, config.y_dim, config.x_dim, cf_roles(ds[var])
    )
    lost = [f"{role} dim {d!r}" for role, d in (("obs", obs), ("y", y), ("x", x)) if d in dropped]
    if lost:
        raise ContractError(
            f"the selection keeps a single value of the {' and '.join(lost)}, so it drops "
            "a dim the fit needs",
            stage=STAGE,
            fix="select a range or a list (e.g. [label]) along it, or name the dims with "
            "load.obs_dim / load.y_dim / load.x_dim",
        )
    return dataclasses.replace(base, positions=tuple(positions))


def _read(da: xr.DataArray, what: str, path: Source) -> np.ndarray:
    try:
        # Combined file sets are dask-backed: read them here, not on a cluster's scheduler.
        with _OPEN_LOCK:
            return np.asarray(da.compute(scheduler="synchronous").values)
    except Exception as exc:
        raise InputError(
            f"reading {what} from {path} failed: the file is corrupt or truncated",
            stage=STAGE,
            found=f"{type(exc).__name__}: {exc}",
            fix="re-create or re-download the file",
        ) from exc


def _values(
    da: xr.DataArray,
    select: Callable[[xr.DataArray], xr.DataArray],
    what: str,
    path: Source,
    count: MaskCount | None = None,
) -> np.ndarray:
    """Decoded values of ``select(da)``, values outside the CF valid range as NaN.

    ``da`` is a variable of a dataset opened by :func:`open_netcdf` (from
    ``path``). A variable that declares a valid range always comes back as
    floats (integers as float64), masked or not. ``count``, when given, counts
    what the valid range masked.
    """
    values = _read(select(da), what, path)
    if len(path.files) > 1 or not any(k in da.attrs for k in _VALID_ATTRS):
        return values  # a file set is masked file by file when opened (_open_files)
    raw_ds = path.open_selected(raw=True)
    try:
        raw_da = raw_ds[da.name]
        bounds = valid_bounds(raw_da.attrs, raw_da.dtype, str(da.name))
        raw = None if bounds is None or bounds.unpacked else _read(select(raw_da), what, path)
    finally:
        path.close(raw_ds)
    if values.dtype.kind != "f":
        values = values.astype(np.float64)
    if bounds is None:
        return values
    invalid = _outside(values if raw is None else raw, raw_da.attrs, bounds)
    if count is not None:
        count.add(bounds, int(np.count_nonzero(invalid & ~np.isnan(values))), values.size)
    return np.where(invalid, np.nan, values).astype(values.dtype, copy=False)
