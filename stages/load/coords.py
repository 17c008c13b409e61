"""The cube's coordinates: values, kept attributes, CF conventions and digests.

The obs, y, x and batch coordinates (with their bounds), scalar coordinates and
the 2-D auxiliary coordinates of a curvilinear grid; the output copies them, so
they are part of the content the load key covers.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import xarray as xr

from gridsolve.schemas.errors import ContractError
from gridsolve.stages.engine.hashing import (
    ArrayHasher,
    canonical_json,
    hash_text,
)
from gridsolve.stages.load.base import _KEPT_ATTRS, STAGE, _jsonable, _open_raw_file
from gridsolve.stages.load.cube import _Cube
from gridsolve.stages.load.masking import _VALID_ATTRS
from gridsolve.stages.load.source import Source, _read
from gridsolve.stages.load.timeaxis import is_cftime


def _stored_time(path: Source, name: str, what: str) -> tuple[np.ndarray, dict[str, str]]:
    """A time variable's stored numbers and its ``units``/``calendar``, as in the file."""
    raw_ds = path.open_selected(raw=True)
    try:
        raw = raw_ds[name]
        values = _read(raw, what, path)
        attrs = {k: str(raw.attrs[k]) for k in ("units", "calendar") if k in raw.attrs}
    finally:
        path.close(raw_ds)
    if len(path.files) > 1 and raw.dims and str(raw.dims[0]) == path.obs_dim:
        units = set()
        for f in path.files:
            with _open_raw_file(f) as one:
                units.add(str(one[name].attrs.get("units")))
        if len(units) > 1:
            raise ContractError(
                f"the input files store {name!r} in different units: {sorted(units)}",
                stage=STAGE,
                fix="write every file's times with the same units (e.g. cdo setreftime)",
            )
    attrs.setdefault("calendar", "standard")
    return values, attrs


def _coord(
    ds: xr.Dataset, da: xr.DataArray, dim: str, path: Source
) -> tuple[np.ndarray, dict[str, Any]]:
    """A dim's coordinate values and kept attributes.

    Times in calendars numpy's datetime64 cannot hold (``noleap``, ``360_day``,
    ``gregorian`` before 1582, …) are kept as the file stores them, numbers with
    their ``units`` and ``calendar``: the output writes them back unchanged and
    generated designs read them as days (see ``design.builtin.obs_axis``).
    """
    if dim in da.coords:
        c = da.coords[dim]
        values = _read(c, f"coordinate {dim!r}", path)
        attrs = {k: _jsonable(v) for k, v in c.attrs.items() if k in _KEPT_ATTRS}
        if is_cftime(values):
            values, time_attrs = _stored_time(path, dim, f"coordinate {dim!r}")
            attrs.update(time_attrs)
    else:
        values = np.arange(da.sizes[dim])
        attrs = {}
    if values.dtype == object:
        values = values.astype(str)
    return values, attrs


def _coord_cf(
    ds: xr.Dataset, da: xr.DataArray, dim: str, values: np.ndarray, path: Source
) -> tuple[dict[str, Any], np.ndarray | None]:
    """How the input writes ``dim``'s coordinate (attrs, time encoding, bounds), and its bounds.

    The writer copies this so the output keeps the input's conventions. Attributes
    that describe stored rather than decoded values (``_FillValue``, packing,
    ``valid_*``) are left out: they do not apply to the values the output writes.
    """
    info: dict[str, Any] = {"attrs": {}, "attr_dtypes": {}, "encoding": {}, "bounds": None}
    if dim not in da.coords:
        return info, None
    c = da.coords[dim]
    for k, v in c.attrs.items():
        if k.startswith("_") or k in _VALID_ATTRS:
            continue
        info["attrs"][k] = _jsonable(v)
        kind = np.asarray(v).dtype
        if isinstance(v, np.ndarray | np.generic) and kind.kind in "biuf":
            # JSON has one number type: keep the attribute's own (CF wants it to match).
            info["attr_dtypes"][k] = kind.str
    if values.dtype.kind == "M":
        for k in ("units", "calendar"):
            if k in c.encoding:
                info["encoding"][k] = str(c.encoding[k])
        if "dtype" in c.encoding:
            info["encoding"]["dtype"] = np.dtype(c.encoding["dtype"]).str
    stored_time = "units" in c.encoding and is_cftime(np.asarray(c.values[:1]))
    if stored_time:  # kept as stored numbers: the time attributes go with them
        info["attrs"]["units"] = str(c.encoding["units"])
        info["attrs"]["calendar"] = str(c.encoding.get("calendar", "standard"))
    name = c.attrs.get("bounds")
    if not isinstance(name, str) or name not in ds.variables:
        return info, None
    b = ds[name]
    bounds = _stored_time(path, name, f"bounds {name!r}")[0] if stored_time else None
    bounds_kind = bounds.dtype.kind if bounds is not None else b.dtype.kind
    if b.ndim != 2 or str(b.dims[0]) != dim or bounds_kind != values.dtype.kind:
        return info, None  # not bounds this coordinate's values can use
    info["bounds"] = {"name": name, "dims": [str(d) for d in b.dims]}
    return info, bounds if bounds is not None else _read(b, f"bounds {name!r}", path)


def _nonfinite(values: np.ndarray) -> tuple[int, int, str] | None:
    """(count, first index, kind) of NaT / NaN / inf coordinate values; None if all finite."""
    if values.dtype.kind in "mM":
        bad, what = np.isnat(values), "NaT"
    elif values.dtype.kind in "fc":
        bad, what = ~np.isfinite(values), "non-finite (NaN or infinite)"
    else:
        return None
    count = int(np.count_nonzero(bad))
    return (count, int(np.flatnonzero(bad)[0]), what) if count else None


def _coord_digest(
    role: str,
    dname: str,
    values: np.ndarray,
    bounds: np.ndarray | None,
    attrs: dict[str, Any],
    cf: dict[str, Any],
) -> str:
    """The content digest of one coordinate: its values, bounds, kept attrs and CF conventions."""
    h = ArrayHasher()
    h.header({"coord": role, "name": dname, "dtype": values.dtype.str, "attrs": attrs, "cf": cf})
    h.update(values)
    if bounds is not None:
        h.update(bounds)
    return h.hexdigest()


def _read_coords(
    ds: xr.Dataset, cube: _Cube, path: Source
) -> tuple[
    dict[str, np.ndarray], dict[str, dict[str, Any]], dict[str, dict[str, Any]], dict[str, str]
]:
    """The obs, y, x and batch coords (and ``<role>_bounds``), kept attrs, CF info and digests.

    A batch dim's role is ``lead:<dim>``.
    """
    arrays: dict[str, np.ndarray] = {}
    coord_attrs: dict[str, dict[str, Any]] = {}
    coord_cf: dict[str, dict[str, Any]] = {}
    digests: dict[str, str] = {}
    roles = [("obs", cube.obs_dim), ("y", cube.y_dim), ("x", cube.x_dim)]
    roles += [(f"lead:{d}", d) for d in cube.lead]
    for role, dname in roles:
        arrays[role], coord_attrs[role] = _coord(ds, cube.da, dname, path)
        coord_cf[role], bounds = _coord_cf(ds, cube.da, dname, arrays[role], path)
        if bounds is not None:
            arrays[f"{role}_bounds"] = bounds
        digests[f"coord_{role}"] = _coord_digest(
            role, dname, arrays[role], bounds, coord_attrs[role], coord_cf[role]
        )
    return arrays, coord_attrs, coord_cf, digests


def _scalar_value(c: xr.DataArray) -> tuple[Any, str] | None:
    """A 0-d coordinate's value as JSON and its kind (a dtype, 'datetime' or 'str')."""
    v = np.asarray(c.values)
    if v.dtype.kind == "M":
        return str(v.astype("datetime64[ns]")), "datetime"
    if v.dtype.kind in "iub":
        return int(v), v.dtype.str
    if v.dtype.kind == "f":
        return float(v), v.dtype.str
    if v.dtype.kind == "S":
        return bytes(v.item()).decode("utf-8", "replace"), "str"
    if v.dtype.kind == "U" or isinstance(v.item(), str):
        return str(v.item()), "str"
    return None  # cftime dates and other objects: not carried


def _extra_coords(
    cube: _Cube, path: Source
) -> tuple[dict[str, np.ndarray], dict[str, Any], dict[str, str]]:
    """The cube's coordinates the output keeps besides its dims' own: arrays, meta, digests.

    Scalar coordinates (a level a selection kept, ``height: 2 m``) and auxiliary
    coordinates on the grid (the 2-D ``lat``/``lon`` of a curvilinear grid), with their
    kept attributes; both are part of the content (the output copies them).
    """
    arrays: dict[str, np.ndarray] = {}
    scalars: dict[str, Any] = {}
    grid: dict[str, Any] = {}
    plane = {cube.y_dim, cube.x_dim}
    for name, c in cube.da.coords.items():
        attrs = {k: _jsonable(v) for k, v in c.attrs.items() if k in _KEPT_ATTRS}
        if c.ndim == 0 and (found := _scalar_value(c)) is not None:
            scalars[str(name)] = {"value": found[0], "kind": found[1], "attrs": attrs}
        elif c.ndim == 2 and set(map(str, c.dims)) == plane and c.dtype.kind in "iuf":
            values = _read(c.transpose(cube.y_dim, cube.x_dim), f"coordinate {name!r}", path)
            arrays[f"aux:{name}"] = values
            grid[str(name)] = {"attrs": attrs, "dtype": values.dtype.str}
    meta: dict[str, Any] = {}
    digests: dict[str, str] = {}
    if scalars:
        meta["scalar_coords"] = scalars
        digests["scalar_coords"] = hash_text(canonical_json(scalars))
    if grid:
        meta["grid_coords"] = grid
        for name in grid:
            h = ArrayHasher()
            h.header({"coord": name, **grid[name]})
            h.update(arrays[f"aux:{name}"])
            digests[f"grid_coord:{name}"] = h.hexdigest()
    return arrays, meta, digests
