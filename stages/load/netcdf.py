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
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import itertools
import json
import logging
import os
import threading
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import xarray as xr
from xarray import SerializationWarning

from gridsolve.schemas.artifacts import Tile
from gridsolve.schemas.contracts import numeric_kind
from gridsolve.schemas.errors import ContractError, GridsolveError, InputError, StageError
from gridsolve.schemas.kinds.load import DemoLoad, IndexRange, LabelRange, NetCDFLoad
from gridsolve.schemas.metadata import LoadMeta
from gridsolve.schemas.pipeline import suggest
from gridsolve.stages.engine import storage
from gridsolve.stages.engine.context import StageContext
from gridsolve.stages.engine.hashing import (
    ArrayHasher,
    canonical_json,
    file_identity,
    hash_file,
    hash_text,
)
from gridsolve.stages.engine.registry import SOURCE, StageDecl, register
from gridsolve.stages.engine.store import Artifact, StageOutput
from gridsolve.stages.load import files as filesets
from gridsolve.stages.load.demo import demo_file
from gridsolve.stages.load.patterns import GridPatterns

STAGE = "load"
VERSION = "1"

Y_NAMES = ("y", "lat", "latitude", "row", "rows", "northing", "south_north", "nlat", "j")
OBS_NAMES = ("time", "t", "obs", "date", "band", "wavelength", "frequency", "sample", "step")
X_NAMES = ("x", "lon", "longitude", "col", "cols", "column", "easting", "west_east", "nlon", "i")
_MAGIC = (b"CDF\x01", b"CDF\x02", b"CDF\x05", b"\x89HDF\r\n\x1a\n")
_BLOCK_BYTES = 64 * 2**20
_KEPT_ATTRS = ("units", "long_name", "standard_name", "calendar", "axis", "positive")

# HDF5 is not thread-safe; xarray locks its own reads, this guards our opens.
_OPEN_LOCK = threading.RLock()
log = logging.getLogger("gridsolve.load")
#: What this process has said about its inputs: a run opens a file several times (the
#: scan, each tile's reads, the flow's cache check), and a warning about the file is news
#: once. A deployed run has a process of its own, so this is once per run there.
_SAID: set[str] = set()


def say_once(key: str) -> bool:
    """Whether ``key`` (a warning about an input) is new in this process; it is not from now on."""
    with _OPEN_LOCK:
        if key in _SAID:
            return False
        _SAID.add(key)
        return True


# ---------------------------------------------------------------- opening
def open_netcdf(
    path: str | Path, stage: str = STAGE, chunks: dict[str, Any] | None = None
) -> xr.Dataset:
    """Open a NetCDF file lazily, or raise one InputError that says what is wrong with it.

    ``chunks={}`` backs the variables with dask (to combine several files lazily).
    """
    p = Path(path)
    if not p.exists():
        raise InputError(
            f"input file not found: {p.absolute()}",
            stage=stage,
            found=None if p.is_absolute() else f"load.path {str(path)!r}",
            fix=f"check load.path ({filesets.relative_paths()})",
        )
    if not p.is_file():
        raise InputError(
            f"input path is not a file: {p}", stage=stage, fix="point load.path at a .nc file"
        )
    try:
        with open(p, "rb") as f:
            head = f.read(8)
    except OSError as exc:
        raise InputError(
            f"cannot read input file {p}: {exc.strerror}", stage=stage, fix="check its permissions"
        ) from exc
    if not any(head.startswith(m) for m in _MAGIC):
        raise InputError(
            f"input file {p} is not NetCDF",
            stage=stage,
            expected="a NetCDF-3 or NetCDF-4/HDF5 file",
            found=f"a file starting with bytes {head!r}" if head else "an empty file",
            fix="convert the data to NetCDF (e.g. xarray's Dataset.to_netcdf) or fix load.path",
        )
    try:
        with _OPEN_LOCK, warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")  # each one caught here, said once below
            # Times datetime64 cannot hold come back as cftime dates, which are handled
            # (kept as stored numbers, see _coord): xarray's warning about it is noise here.
            warnings.filterwarnings("ignore", "Unable to decode time axis", SerializationWarning)
            ds = xr.open_dataset(
                p, engine="netcdf4", cache=False, decode_timedelta=False, chunks=chunks
            )
        for w in caught:
            if say_once(f"{p.resolve()}: {w.category.__name__}: {w.message}"):
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
        return ds
    except Exception as exc:
        times = _undecodable_times(p, stage, exc)
        if times is not None:
            raise times from exc
        raise InputError(
            f"input file {p} is corrupt or truncated and cannot be opened",
            stage=stage,
            found=f"{type(exc).__name__}: {exc}",
            fix="re-create or re-download the file",
        ) from exc


#: Time units of variable length: CF 4.4 (udunits) makes them fixed lengths, a month
#: 30.436875 days and a year 365.242198781 days, which is rarely what a file means.
_CALENDAR_UNITS = ("month", "months", "year", "years", "common_year", "common_years")


def _undecodable_times(p: Path, stage: str, exc: Exception) -> InputError | None:
    """The InputError for a file that opens but whose times cannot be decoded; None if corrupt."""
    try:
        with _OPEN_LOCK:
            raw = xr.open_dataset(p, engine="netcdf4", cache=False, decode_times=False)
    except Exception:
        return None  # it does not open at all: corrupt or truncated
    try:
        found = [
            (str(name), str(v.attrs["units"]), str(v.attrs.get("calendar", "standard")))
            for name, v in raw.variables.items()
            if " since " in str(v.attrs.get("units", ""))
        ]
    finally:
        raw.close()
    variable = [f for f in found if f[1].split(" since ")[0].strip().lower() in _CALENDAR_UNITS]
    if variable:
        name, units, calendar = variable[0]
        return InputError(
            f"the times in {p} cannot be decoded: {name!r} is in {units!r} "
            f"(calendar {calendar!r}), a unit of variable length",
            stage=stage,
            expected="time units of fixed length: days, hours, minutes or seconds since a date",
            found=f"units {units!r}, calendar {calendar!r}: xarray and cftime decode months "
            "and years only in the 360_day calendar",
            fix=f"rewrite {name!r} in days since a date (e.g. cdo settunits,days, or in xarray: "
            f"open with decode_times=False, turn the month numbers into dates, and write "
            f"them back); CF's month is a fixed 30.436875 days, not a calendar month",
        )
    if not found:
        return None
    name, units, calendar = found[0]
    return InputError(
        f"the times in {p} cannot be decoded",
        stage=stage,
        found=f"{name!r} in {units!r} (calendar {calendar!r}): {type(exc).__name__}: {exc}",
        fix=f"correct the units / calendar attributes of {name!r} (CF 4.4)",
    )


# ---------------------------------------------------------------- selection
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


def local(path: str, options: Mapping[str, Any] | None = None) -> str:
    """``path``, or for a URL a verified local copy of the object (NetCDF needs a file)."""
    return storage.at(path, options).readable()


def _open_zarr(store: str, raw: bool, options: Mapping[str, Any] | None = None) -> xr.Dataset:
    try:
        with _OPEN_LOCK:
            ds: xr.Dataset = xr.open_zarr(
                store,
                storage_options=storage.at(store, options).open_options(),
                chunks=None,
                mask_and_scale=not raw,
                decode_times=not raw,
                decode_timedelta=False,
            )
    except Exception as exc:
        raise InputError(
            f"Zarr store {store} cannot be opened",
            stage=STAGE,
            found=f"{type(exc).__name__}: {exc}",
            fix="check load.path points at a complete Zarr store (its zarr.json / .zgroup)",
        ) from exc
    return ds


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


# ---------------------------------------------------------------- CF valid range
# xarray's CF decoding masks _FillValue and missing_value (on the stored values,
# before unpacking, as CF 2.5.1 asks) but not valid_range, valid_min or
# valid_max; those are applied here, on a raw read of the same selection.
#
# Which values they compare, precisely:
# - CF 2.5.1: the missing values of a packed variable (scale_factor /
#   add_offset) "are interpreted relative to the variable's external values
#   (a.k.a. the packed values …)", checked before the transformation; CF 8.1:
#   valid_min, valid_max and valid_range of packed data "must be of the same
#   data type as the packed data" (the NUG's Appendix A says the same). So an
#   attribute of the packed (stored) type is compared with the stored values.
# - CF says nothing of an attribute of the unpacked type, the type of
#   scale_factor / add_offset (CF 8.1: what packed data unpack to). Such
#   attributes are written in physical units (`valid_range = 15.f, 25.f` on
#   int16 °C): they are compared with the unpacked values, as netCDF-Java
#   does. (netCDF4-python would cast 15., 25. to int16 and mask most values.)
# - An attribute of any other type on packed data breaks CF 8.1: it is
#   compared with the stored values, as CF 2.5.1 says, and said aloud.
# - Unpacked data: stored and unpacked values are the same numbers; the
#   attribute's values are compared as numbers, whatever their type.
# valid_range wins over valid_min / valid_max; no range is implied by
# _FillValue; with `_Unsigned = "true"` stored integers and bounds of their
# type are read as unsigned. One warning per scan of the input (never per tile)
# names the attribute, its values and the share of values it masked, when that
# share is above MASK_WARN_FRACTION or the attribute's type breaks CF 8.1.
_VALID_ATTRS = ("valid_range", "valid_min", "valid_max")
_PACKING = ("scale_factor", "add_offset")
#: Masking by valid_* above this share of a variable's values is reported (1 %).
MASK_WARN_FRACTION = 0.01


@dataclass(frozen=True)
class ValidRange:
    """A variable's CF valid bounds, and whether they compare its unpacked values."""

    lo: Any
    hi: Any
    #: compared with the unpacked (decoded) values, not the stored ones
    unpacked: bool
    #: the attribute(s) as written, e.g. "valid_range = [15.0, 25.0] (float32)"
    text: str
    #: which values it compares, and why (for the warning)
    how: str
    #: why the attribute's type is neither the packed nor the unpacked type ("" if it is one)
    odd: str = ""
    #: the attribute whose minimum is above its maximum ("" if none): every value is
    #: masked, and a variable the run reads is refused (:meth:`MaskCount.report`)
    reversed: str = ""


def _attr_type(value: Any) -> np.dtype | None:
    """The attribute's stored type; None for untyped values (Zarr's JSON attributes)."""
    return value.dtype if isinstance(value, np.ndarray | np.generic) else None


def _same_type(value: Any, dtype: np.dtype) -> bool:
    kind = _attr_type(value)
    if kind is None:  # JSON numbers: an integer matches integers, a float floats
        return np.asarray(value).dtype.kind in ("iu" if dtype.kind in "iu" else "f")
    return kind == dtype


def valid_bounds(
    attrs: Mapping[str, Any], stored: np.dtype, name: str = "the variable"
) -> ValidRange | None:
    """The CF valid bounds a raw variable's ``attrs`` declare (see above); None if none apply.

    ``attrs`` are the variable's attributes as stored (packing included),
    ``stored`` its stored dtype; ``name`` is the variable's, for messages.
    """
    if "valid_range" in attrs and np.asarray(attrs["valid_range"]).size == 2:
        names = ["valid_range"]
        lo, hi = np.asarray(attrs["valid_range"]).reshape(-1)
    else:
        names = [n for n in ("valid_min", "valid_max") if n in attrs]
        vmin = np.asarray(attrs.get("valid_min", [])).reshape(-1)
        vmax = np.asarray(attrs.get("valid_max", [])).reshape(-1)
        lo = vmin[0] if vmin.size else None
        hi = vmax[0] if vmax.size else None
    if lo is None and hi is None:
        return None
    first = attrs[names[0]]
    kind = _attr_type(first)
    text = ", ".join(f"{n} = {_jsonable(attrs[n])}" for n in names)
    text += f" ({kind})" if kind is not None else ""
    packing = [attrs[k] for k in _PACKING if k in attrs]
    unpacked_type = np.asarray(packing[0]).dtype if packing else None
    if unpacked_type is None:
        unpacked, odd, how = False, "", "compared with the values"
    elif _same_type(first, stored):
        unpacked, odd, how = False, "", "compared with the stored (packed) values (CF 2.5.1)"
    elif _same_type(first, unpacked_type):
        unpacked, odd = True, ""
        how = (
            "compared with the unpacked values (it has the type of scale_factor / add_offset, "
            "so it is read in physical units)"
        )
    else:
        unpacked = False
        odd = f"its type is neither the packed {stored} nor the unpacked {unpacked_type}"
        how = (
            f"compared with the stored (packed) values (CF 2.5.1), but {odd} "
            f"(CF 8.1 wants {stored})"
        )
    unsigned = str(attrs.get("_Unsigned", "")).lower() == "true" and stored.kind == "i"
    if unsigned and _same_type(first, stored):  # bounds written as the signed stored type
        as_unsigned = np.dtype(f"u{stored.itemsize}")
        lo = None if lo is None else np.asarray(lo).astype(stored).view(as_unsigned)
        hi = None if hi is None else np.asarray(hi).astype(stored).view(as_unsigned)
        said = [f"{k} {_jsonable(v)}" for k, v in (("min", lo), ("max", hi)) if v is not None]
        text += ", read as unsigned (_Unsigned = true): " + ", ".join(said)
    reversed_ = lo is not None and hi is not None and bool(lo > hi)
    return ValidRange(lo, hi, unpacked, text, how, odd, names[0] if reversed_ else "")


@dataclass
class MaskCount:
    """How many of a variable's values its CF valid range masked, for one report per scan."""

    bounds: ValidRange | None = None
    masked: Any = 0
    size: int = 0
    #: the files of a set whose attributes differ from the first's
    differ: int = 0

    def add(self, bounds: ValidRange, masked: Any, size: int) -> None:
        """Count one block (or file) masked by ``bounds``."""
        if self.bounds is None:
            self.bounds = bounds
        elif bounds.text != self.bounds.text:
            self.differ += 1
        self.masked = self.masked + masked
        self.size += size

    def report(self, name: str, where: str = "") -> None:
        """Warn (once) when the range masked more than MASK_WARN_FRACTION, or its type is odd.

        ContractError for a range whose minimum is above its maximum (it masks every
        value: a mistake in the file, not data that are all invalid).
        """
        b = self.bounds
        if b is not None and b.reversed:
            raise ContractError(
                f"variable {name!r}: {b.text} puts its minimum above its maximum, so every "
                "value would be marked missing",
                stage=STAGE,
                fix="correct or delete the attribute in a copy of the file (e.g. ncatted -a "
                f"{b.reversed},{name},d,, copy.nc): gridsolve never edits its input",
            )
        if b is None or not self.size:
            return
        counted = self.masked  # a file set's counts are lazy (dask): read the files now
        masked = int(
            counted.compute(scheduler="synchronous") if hasattr(counted, "compute") else counted
        )
        share = masked / self.size
        if share <= MASK_WARN_FRACTION and not b.odd:
            return
        if not say_once(f"masked: {where} {name} {b.text} {masked} {self.size} {self.differ}"):
            return
        log.warning(
            "variable %r: %s marks %.1f%% of its values missing (%d of %d), %s%s; check "
            "the attribute if that is not meant",
            name,
            b.text,
            100 * share,
            masked,
            self.size,
            b.how,
            f" (the first file's; {self.differ} other file(s) declare another range)"
            if self.differ
            else "",
        )


def _open_raw_file(path: str, chunks: dict[str, Any] | None = None) -> xr.Dataset:
    with _OPEN_LOCK:
        return xr.open_dataset(
            path,
            engine="netcdf4",
            cache=False,
            mask_and_scale=False,
            decode_times=False,
            decode_timedelta=False,
            chunks=chunks,
        )


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


def _outside(values: Any, attrs: Mapping[str, Any], bounds: ValidRange) -> Any:
    """Where ``values`` (numpy or dask; stored, or unpacked) lie outside ``bounds``."""
    unsigned = str(attrs.get("_Unsigned", "")).lower() == "true"
    if not bounds.unpacked and unsigned and values.dtype.kind == "i":
        values = values.view(f"u{values.dtype.itemsize}")
    invalid = (values != values) & False  # all False, of values' kind (numpy or dask)
    if bounds.lo is not None:
        invalid = invalid | (values < bounds.lo)
    if bounds.hi is not None:
        invalid = invalid | (values > bounds.hi)
    return invalid


#: Per file set (the files as given): variable → what its valid ranges mask, lazily.
_SET_MASKS: dict[tuple[str, ...], dict[str, MaskCount]] = {}


def _masked_file(path: str, counts: dict[str, MaskCount] | None = None) -> xr.Dataset:
    """One file of a set, decoded and dask-backed, values outside its own valid range NaN.

    Each file may declare its own packing and valid range (in its stored
    units), so the mask is made per file, before the files are combined.
    ``counts`` gathers (lazily) what each variable's range masks.
    """
    ds = open_netcdf(path, chunks={})
    raw = _open_raw_file(path, chunks={})
    for name in list(ds.data_vars):
        bounds = valid_bounds(raw[name].attrs, raw[name].dtype, str(name))
        if bounds is None or not any(k in ds[name].attrs for k in _VALID_ATTRS):
            continue
        decoded = ds[name].astype(np.float64) if ds[name].dtype.kind != "f" else ds[name]
        compared = decoded.data if bounds.unpacked else raw[name].data
        invalid = _outside(compared, raw[name].attrs, bounds)
        if counts is not None:
            masked = (invalid & ~np.isnan(decoded.data)).sum()
            counts.setdefault(str(name), MaskCount()).add(bounds, masked, int(decoded.size))
        ds[name] = decoded.where(~invalid)
    return ds


# ---------------------------------------------------------------- dims
#: CF ``axis`` values and ``standard_name``s of coordinate variables, and the role they give
#: their dim (CF 4.1–4.4; ``Z`` is a vertical axis: a batch dim, never obs or the map).
_CF_AXES = {"T": "obs", "Y": "y", "X": "x", "Z": "z"}
_CF_NAMES = {
    "time": "obs",
    "latitude": "y",
    "grid_latitude": "y",
    "projection_y_coordinate": "y",
    "longitude": "x",
    "grid_longitude": "x",
    "projection_x_coordinate": "x",
}
#: The units CF 4.1 and 4.2 accept for latitude and longitude (lowercased).
_LAT_UNITS = frozenset(
    ("degrees_north", "degree_north", "degree_n", "degrees_n", "degreen", "degreesn")
)
_LON_UNITS = frozenset(
    ("degrees_east", "degree_east", "degree_e", "degrees_e", "degreee", "degreese")
)


def _cf_role(c: xr.DataArray) -> str | None:
    """The role ("obs", "y", "x", "z") a coordinate variable's CF attributes give its dim."""
    axis = str(c.attrs.get("axis", "")).strip().upper()
    if axis in _CF_AXES:
        return _CF_AXES[axis]
    standard = str(c.attrs.get("standard_name", "")).strip().lower()
    if standard in _CF_NAMES:
        return _CF_NAMES[standard]
    # Decoded times keep their units in the encoding; undecoded ones in the attributes.
    units = str(c.attrs.get("units", c.encoding.get("units", ""))).strip().lower()
    if c.dtype.kind == "M" or " since " in f" {units} " or is_cftime(np.asarray(c.values[:1])):
        return "obs"
    if units in _LAT_UNITS:
        return "y"
    if units in _LON_UNITS:
        return "x"
    return None


def cf_roles(da: xr.DataArray) -> dict[str, str]:
    """Dim → role ("obs", "y", "x", "z") from the CF attributes of each dim's coordinate variable.

    Dims without a coordinate variable, or whose attributes say nothing, are left out.
    """
    roles: dict[str, str] = {}
    for dim in da.dims:
        if dim in da.coords and (role := _cf_role(da.coords[dim])) is not None:
            roles[str(dim)] = role
    return roles


def _pick(names: tuple[str, ...], dims: list[str]) -> str | None:
    lowered = {d.lower(): d for d in dims}
    for n in names:
        if n in lowered:
            return lowered[n]
    return None


def _shape_text(dims: tuple[str, ...], sizes: Mapping[str, int] | None) -> str:
    if not sizes:
        return f"({', '.join(dims)})"
    return "(" + ", ".join(f"{d}={sizes[d]}" if d in sizes else d for d in dims) + ")"


def infer_dims(
    dims: tuple[str, ...],
    obs: str | None,
    y: str | None,
    x: str | None,
    roles: Mapping[str, str] | None = None,
    sizes: Mapping[str, int] | None = None,
) -> tuple[str, str, str, list[str]]:
    """(obs, y, x) dim names, never guessed from positions; violations if they cannot be told.

    In order: load.obs_dim / y_dim / x_dim; the CF ``roles`` of the dims'
    coordinate variables (:func:`cf_roles`: ``axis``, ``standard_name``, time or
    degree units), each claimed by one dim; conventional names (``time``,
    ``lat``, ``x``, …; one obs-like name, never a choice among several); then
    by elimination: with y and x known, the one dim left is obs, and with obs
    known, the dims left (exactly as many as are missing) are y then x in the
    variable's order (they only lay out the maps: the fits are per series).
    Any other dim is a batch dim. ``sizes`` only make the messages say more.
    """
    problems = [
        f"{field} {name!r} is not a dim of the variable (its dims are {list(dims)})"
        f"{suggest(name, dims)}"
        for field, name in (("load.obs_dim", obs), ("load.y_dim", y), ("load.x_dim", x))
        if name is not None and name not in dims
    ]
    if problems or len(dims) < 3:
        return "", "", "", problems
    roles = roles or {}
    found: dict[str, str | None] = {"obs": obs, "y": y, "x": x}
    taken = {d for d in found.values() if d is not None}
    for role in ("obs", "y", "x"):
        claims = [d for d in dims if roles.get(d) == role and d not in taken]
        if found[role] is None and len(claims) == 1:
            found[role] = claims[0]
            taken.add(claims[0])
    for role, names in (("y", Y_NAMES), ("x", X_NAMES)):
        free = [d for d in dims if d not in taken and roles.get(d) in (None, role)]
        if found[role] is None and (name := _pick(names, free)) is not None:
            found[role] = name
            taken.add(name)
    named = [d for d in dims if d not in taken and roles.get(d) in (None, "obs")]
    named = [d for d in named if d.lower() in OBS_NAMES]
    if found["obs"] is None and len(named) == 1:
        found["obs"] = named[0]
        taken.add(named[0])
    rest = [d for d in dims if d not in taken and roles.get(d) != "z"]
    if found["obs"] is None and None not in (found["y"], found["x"]) and len(rest) == 1:
        found["obs"] = rest[0]
        taken.add(rest[0])
    missing = [r for r in ("y", "x") if found[r] is None]
    shape = _shape_text(dims, sizes)
    if found["obs"] is not None and missing and len(rest) == len(missing):
        rivals = [d for d in rest if d.lower() in OBS_NAMES]
        if obs is None and rivals:
            # a dim named like the observations would become a map axis by elimination:
            # two dims claim to be obs (one by its coordinate, one by its name)
            problems.append(
                f"cannot tell which dim is the observation dim: the variable's dims are "
                f"{shape}; {found['obs']!r} has a coordinate that says it is time, but "
                f"{rivals[0]!r} is named like an observation dim too; set load.obs_dim, "
                f"e.g. the line `obs_dim: {found['obs']}` (or `obs_dim: {rivals[0]}`) in the "
                "config's load section"
            )
            return "", "", "", problems
        found.update(zip(missing, rest, strict=True))
        missing = []
    free = [d for d in dims if d not in {v for v in found.values() if v}]
    if found["obs"] is None:
        example = free[-1] if free else dims[-1]
        problems.append(
            f"cannot tell which dim is the observation dim: the variable's dims are {shape}, "
            f"none is named like one ({', '.join(OBS_NAMES)}) or has a coordinate variable "
            "that says so (CF axis: T, standard_name: time, or units like 'days since …'); "
            f"set load.obs_dim to the dim of the observations, e.g. the line `obs_dim: {example}` "
            "in the config's load section"
        )
    elif missing:
        pair = (free + list(dims))[:2] if len(free) < 2 else free[-2:]
        problems.append(
            f"cannot tell which dims are the map's rows and columns: the variable's dims are "
            f"{shape}, obs is {found['obs']!r}, and of {free} none is named like y / x "
            "(lat, lon, y, x, …) or has a coordinate variable that says so (CF axis: Y / X, "
            "standard_name, units degrees_north / degrees_east); set load.y_dim and "
            f"load.x_dim, e.g. the lines `y_dim: {pair[0]}` and `x_dim: {pair[1]}` in "
            "the config's load section"
        )
    if problems:
        return "", "", "", problems
    o, yy, xx = found["obs"], found["y"], found["x"]
    assert o is not None and yy is not None and xx is not None
    if len({o, yy, xx}) != 3:
        problems.append(
            f"load.obs_dim / y_dim / x_dim name the same dim twice (obs={o!r}, y={yy!r}, "
            f"x={xx!r}); the variable's dims are {shape}"
        )
        return "", "", "", problems
    return o, yy, xx, problems


# ---------------------------------------------------------------- scan
@dataclass
class Scan:
    """Result of checking and hashing one input file."""

    digest: str
    output: StageOutput
    #: the file's identity (``file_identity``) when its scan began
    identity: dict[str, int] = dataclasses.field(default_factory=dict)


def is_cftime(values: np.ndarray) -> bool:
    """Whether ``values`` are cftime dates (times in a calendar numpy cannot hold)."""
    first = values.reshape(-1)[:1]
    return (
        values.dtype == object
        and len(first) == 1
        and type(first[0]).__module__.startswith("cftime")
    )


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


def _jsonable(v: Any) -> Any:
    if isinstance(v, np.generic):
        return v.item()
    if isinstance(v, np.ndarray):
        return v.tolist()
    return v


def _stream(
    da: xr.DataArray,
    hasher: ArrayHasher,
    path: Source,
    what: str,
    patterns: GridPatterns | None = None,
) -> dict[str, Any]:
    """Hash ``da``'s values (as tiles read them) block by block along its first dim.

    Also counts NaN, inf, negative and positive values, finds the first inf and
    the largest finite magnitude, feeds the gap patterns, and counts what the
    valid range masked (``"valid"``, a :class:`MaskCount`).
    """
    count = MaskCount()
    n0 = da.shape[0]
    row_bytes = max(1, int(np.prod(da.shape[1:], dtype=np.int64)) * da.dtype.itemsize)
    step = max(1, _BLOCK_BYTES // row_bytes)
    nan = inf = 0
    first_inf: tuple[int, ...] | None = None
    neg = pos = 0
    abs_max = 0.0
    for start in range(0, n0, step):
        rows = {da.dims[0]: slice(start, start + step)}
        block = _values(da, functools.partial(xr.DataArray.isel, indexers=rows), what, path, count)
        hasher.update(block)
        if patterns is not None:
            patterns.update(block, start)
        if block.dtype.kind == "f":
            isnan = np.isnan(block)
            nan += int(isnan.sum())
            isinf = np.isinf(block)
            n_inf = int(isinf.sum())
            if n_inf and first_inf is None:
                idx = np.argwhere(isinf)[0]
                first_inf = (int(idx[0]) + start, *(int(i) for i in idx[1:]))
            inf += n_inf
            finite = np.where(isinf, 0, block) if n_inf else block
        else:
            finite = block
        neg += int(np.count_nonzero(block < 0))
        pos += int(np.count_nonzero(block > 0))
        if finite.size and finite.dtype.kind in "fiu":
            hi, lo = np.fmax.reduce(finite, axis=None), np.fmin.reduce(finite, axis=None)
            abs_max = float(np.fmax(abs_max, np.fmax(abs(float(hi)), abs(float(lo)))))
    return {
        "nan": nan,
        "inf": inf,
        "first_inf": first_inf,
        "negative": neg,
        "positive": pos,
        "abs_max": abs_max,
        "size": int(da.size),
        "valid": count,
    }


def _where(dims: tuple[str, ...], index: tuple[int, ...] | None) -> str:
    if index is None:
        return ""
    return " (first at " + ", ".join(f"{d}={i}" for d, i in zip(dims, index, strict=True)) + ")"


def scan_netcdf(config: NetCDFLoad, path: str) -> Scan:
    """Check every contract of one input file and hash its content (memoised per file state)."""
    ident = file_identity(path) if Path(path).is_file() else {}
    base = canonical_json(Source(path).describe())
    return _scan_cached(canonical_json(config.key_payload()), base, canonical_json(ident))


def scan_source(config: NetCDFLoad, base: Source, ident: Any) -> Scan:
    """Check every contract of the cube at ``base`` and hash its content (memoised on ``ident``)."""
    payload = canonical_json(config.key_payload())
    return _scan_cached(payload, canonical_json(base.describe()), canonical_json(ident))


def _scan_cached(config_json: str, base_json: str, ident_json: str) -> Scan:
    got = _scan_or_refusal(config_json, base_json, ident_json)
    if isinstance(got, GridsolveError):
        # a fresh copy each time: the remembered one keeps no caller's traceback, and
        # two runs in one process never share (nor relabel) one exception object
        raise copy.copy(got)  # rebuilt from its fields (GridsolveError.__reduce__)
    return got


@functools.lru_cache(maxsize=8)
def _scan_or_refusal(config_json: str, base_json: str, ident_json: str) -> Scan | GridsolveError:
    """The scan, or the error that refused the file.

    A refusal is memoised too (per file state), so the run's second look neither
    reads the file again nor repeats its warnings.
    """
    # key_payload leaves the path out (the key covers the content instead).
    base = Source.from_description(json.loads(base_json))
    config = NetCDFLoad.model_validate({**json.loads(config_json), "path": base.path})
    ds = base.open()
    try:
        var = _cube_name(config, ds)  # on the whole file: the selection may drop dims
        src = resolve_selection(ds, var, config, base)
        scan = _scan(config, src.apply(ds), src, var)
    except GridsolveError as e:
        if e.transient:  # a retry may cure it: not remembered
            raise
        return e.with_traceback(None)
    finally:
        base.close(ds)
    return dataclasses.replace(scan, identity=json.loads(ident_json))


@dataclass(frozen=True)
class _Cube:
    """The cube variable and which of its dims are obs, y and x."""

    name: str
    da: xr.DataArray
    dims: tuple[str, ...]
    obs_dim: str
    y_dim: str
    x_dim: str
    #: the batch dims other than y and x (member, level, …), in the variable's order
    lead: tuple[str, ...] = ()


def _scan(config: NetCDFLoad, ds: xr.Dataset, path: Source, var: str) -> Scan:
    """The checked description and content digest of the variables ``config`` selects in ``ds``."""
    cube = _cube(config, ds, var)
    aux = _aux_info(config, ds, cube)
    digests, stats, patterns = _hash_variables(ds, cube, aux, path)
    _report_masking(cube, aux, stats, path)
    arrays, coord_attrs, coord_cf, coord_digests = _read_coords(ds, cube, path)
    _check_values(config, cube, stats, arrays["obs"])
    digests.update(coord_digests)
    extra_arrays, extra_meta, extra_digests = _extra_coords(cube, path)
    arrays.update(extra_arrays)
    digests.update(extra_digests)
    # The output appends its line to the input's history (CF 2.6.2): part of the content.
    history = str(ds.attrs.get("history", ""))
    if history:
        digests["history"] = hash_text(history)
    design_columns: list[str] | None = None
    if "design" in aux:
        arrays["design"], design_columns = _read_design(ds, aux["design"], cube.obs_dim, path)
        # The labels name the output's coef coordinate: part of the content.
        digests["design_columns"] = hash_text(canonical_json(design_columns))
    if stats["cube"]["nan"]:
        # Gap patterns many pixels share get one factorisation each in the solve stage.
        arrays["gap_patterns"] = patterns.common()
    if "weights" in aux and aux["weights"]["shared"]:
        arrays["weights"] = _values(
            ds[config.weights], lambda v: v, f"variable {config.weights!r}", path
        ).astype(np.float64)
    meta = _meta(cube, coord_attrs, coord_cf, history, stats["cube"], aux, design_columns)
    meta.update(extra_meta)
    selection = [[d, p if isinstance(p, int) else list(p)] for d, p in path.positions]
    meta["selection"] = selection
    if selection:
        # Tiles read these positions: two files with the same selected values at other
        # positions must not share a key (their artifacts would send reads astray).
        digests["selection"] = hash_text(canonical_json(selection))
    meta["digests"] = digests
    digest = hash_text(canonical_json(digests))
    meta["content_hash"] = digest
    return Scan(digest=digest, output=StageOutput(arrays=arrays, meta=meta))


def _report_masking(
    cube: _Cube,
    aux: Mapping[str, Mapping[str, Any]],
    stats: Mapping[str, Mapping[str, Any]],
    path: Source,
) -> None:
    """One warning per selected variable whose valid range masked much, or has an odd type.

    A file set's counts cover its whole files (they are masked file by file).
    """
    selected = {"cube": cube.name, **{role: str(info["name"]) for role, info in aux.items()}}
    sets = _SET_MASKS.get(path.files, {}) if len(path.files) > 1 else {}
    for role, name in selected.items():
        count = sets.get(name) if len(path.files) > 1 else stats[role]["valid"]
        if count is not None:
            count.report(name, str(path))


def _cube_name(config: NetCDFLoad, ds: xr.Dataset) -> str:
    """The cube's variable name: load.variable, else the file's one numeric variable of ≥ 3 dims."""
    if config.variable is not None:
        return config.variable
    names = [str(n) for n in ds.data_vars]
    cubes = [n for n in names if ds[n].ndim >= 3 and numeric_kind(ds[n].dtype)]
    if len(cubes) != 1 and len(names) == 1:
        cubes = names  # the only variable: its own checks say what is wrong with it
    if len(cubes) != 1:
        raise ContractError(
            "cannot tell which variable is the cube",
            stage=STAGE,
            expected="exactly one numeric data variable with ≥ 3 dims, or load.variable set",
            found=f"numeric variables with ≥ 3 dims {cubes}; all variables {names}",
            fix="set load.variable to the cube's name",
        )
    return cubes[0]


def _check_names(config: NetCDFLoad, ds: xr.Dataset, var: str) -> None:
    """Raise a ContractError if a variable the config names (cube ``var`` included) is missing."""
    names = [str(n) for n in ds.data_vars]
    problems = [
        f"{field}: variable {name!r} is not in the file "
        f"(variables: {', '.join(names)}).{suggest(name, names)}"
        for field, name in (
            ("load.variable", var),
            ("load.design", config.design),
            ("load.weights", config.weights),
            ("load.target", config.target),
        )
        if name is not None and name not in ds.variables
    ]
    if problems:
        raise ContractError(
            "variables named in the config are missing",
            stage=STAGE,
            violations=problems,
            fix="correct the names in the load section",
        )


def _cube(config: NetCDFLoad, ds: xr.Dataset, var: str) -> _Cube:
    """Cube ``var`` and its (obs, y, x) dims; ContractError if it breaks the cube contract."""
    _check_names(config, ds, var)
    da = ds[var]
    if da.ndim < 3:
        raise ContractError(
            f"variable {var!r} must have at least 3 dims (obs, y, x)",
            stage=STAGE,
            found=f"{da.ndim} dims {list(da.dims)} with shape {da.shape}"
            + (" after load.isel / load.select" if config.isel or config.select else ""),
            fix="select a variable with dims (obs, …, y, x); a one-element list in "
            "load.select / load.isel keeps a dim",
        )
    dims = tuple(str(d) for d in da.dims)
    sizes = {str(d): int(n) for d, n in da.sizes.items()}
    obs_dim, y_dim, x_dim, problems = infer_dims(
        dims, config.obs_dim, config.y_dim, config.x_dim, cf_roles(da), sizes
    )
    if not numeric_kind(da.dtype):
        problems.append(f"variable {var!r} has dtype {da.dtype}; expected numbers (float or int)")
    for dim, n in da.sizes.items():
        if n == 0:
            problems.append(f"dim {dim!r} of {var!r} has size 0")
    if problems:
        raise ContractError(
            f"variable {var!r} does not fit the cube contract",
            stage=STAGE,
            violations=problems,
            expected="a numeric variable with dims (obs, …, y, x), each of size ≥ 1",
            fix="set load.variable / load.obs_dim / load.y_dim / load.x_dim",
        )
    lead = tuple(d for d in dims if d not in (obs_dim, y_dim, x_dim))
    return _Cube(var, da, dims, obs_dim, y_dim, x_dim, lead)


# ---------------------------------------------------------------- helper variables
def _design_info(d: xr.DataArray, name: str, cube: _Cube) -> tuple[dict[str, Any], list[str]]:
    """The design's aux entry, and how its dims fail to fit the cube."""
    obs_dim, n_obs = cube.obs_dim, cube.da.sizes[cube.obs_dim]
    problems: list[str] = []
    if d.ndim != 2:
        problems.append(f"design {name!r}: expected 2 dims ({obs_dim}, coef), found {list(d.dims)}")
    elif obs_dim not in d.dims:
        rows = ", ".join(f"{k}={v}" for k, v in d.sizes.items())
        problems.append(
            f"design {name!r}: expected dims ({obs_dim}, coef) with {n_obs} rows "
            f"(one per observation), found ({rows})"
        )
    elif d.sizes[obs_dim] != n_obs:
        problems.append(
            f"design {name!r}: has {d.sizes[obs_dim]} rows along {obs_dim!r}, "
            f"the cube has {n_obs} observations"
        )
    return {"name": name, "dims": [str(x) for x in d.dims]}, problems


def _weights_info(w: xr.DataArray, name: str, cube: _Cube) -> tuple[dict[str, Any], list[str]]:
    """The weights' aux entry (shared: one weight per observation), and how they misfit."""
    obs_dim, da = cube.obs_dim, cube.da
    problems: list[str] = []
    wd = tuple(str(x) for x in w.dims)
    shared = wd == (obs_dim,)
    if not shared and set(wd) != set(cube.dims):
        problems.append(
            f"weights {name!r}: expected dims ({obs_dim},) or the cube's "
            f"({', '.join(cube.dims)}), found {list(wd)}"
        )
    for dname in wd:
        if dname in da.sizes and w.sizes[dname] != da.sizes[dname]:
            problems.append(
                f"weights {name!r}: dim {dname!r} has size {w.sizes[dname]}, "
                f"the cube has {da.sizes[dname]}"
            )
    return {"name": name, "dims": list(wd), "shared": shared}, problems


def _target_info(t: xr.DataArray, name: str, cube: _Cube) -> tuple[dict[str, Any], list[str]]:
    """The target's aux entry (its output dim and count), and how its dims misfit.

    Besides y and x the target may have any of the cube's batch dims (a dim it
    lacks is shared along it) and one output dim of its own.
    """
    y_dim, x_dim, da = cube.y_dim, cube.x_dim, cube.da
    problems: list[str] = []
    td = tuple(str(x) for x in t.dims)
    out_dims = [d for d in td if d not in (y_dim, x_dim, *cube.lead)]
    if not {y_dim, x_dim} <= set(td) or len(out_dims) > 1 or cube.obs_dim in td:
        problems.append(
            f"target {name!r}: expected dims ({y_dim}, {x_dim}) or "
            f"(output, {y_dim}, {x_dim}), optionally with the cube's "
            f"{list(cube.lead) or 'batch dims'}, found {list(td)}"
        )
    else:
        for dname in (y_dim, x_dim, *cube.lead):
            if dname in t.sizes and t.sizes[dname] != da.sizes[dname]:
                problems.append(
                    f"target {name!r}: dim {dname!r} has size {t.sizes[dname]}, "
                    f"the cube has {da.sizes[dname]}"
                )
    info = {
        "name": name,
        "dims": list(td),
        "out_dim": out_dims[0] if out_dims else None,
        "n_out": int(t.sizes[out_dims[0]]) if out_dims else 1,
    }
    return info, problems


def _aux_info(config: NetCDFLoad, ds: xr.Dataset, cube: _Cube) -> dict[str, dict[str, Any]]:
    """Role → description of each helper variable; ContractError if one does not fit the cube."""
    aux: dict[str, dict[str, Any]] = {}
    problems: list[str] = []
    for role, name, describe in (
        ("design", config.design, _design_info),
        ("weights", config.weights, _weights_info),
        ("target", config.target, _target_info),
    ):
        if name is not None:
            aux[role], found = describe(ds[name], name, cube)
            problems += found
    for role, info in aux.items():
        if not numeric_kind(ds[info["name"]].dtype):
            problems.append(
                f"{role} {info['name']!r} has dtype {ds[info['name']].dtype}; expected numbers"
            )
    if problems:
        raise ContractError(
            "helper variables do not fit the cube",
            stage=STAGE,
            violations=problems,
            fix="correct load.design / load.weights / load.target or the file",
        )
    return aux


# ---------------------------------------------------------------- content
def _hash_variable(
    v: xr.DataArray, role: str, name: str, path: Source, patterns: GridPatterns | None
) -> tuple[str, dict[str, Any]]:
    """The content digest of one selected variable and its value statistics (:func:`_stream`)."""
    h = ArrayHasher()
    h.header(
        {
            "role": role,
            "name": name,
            "dims": [str(x) for x in v.dims],
            "shape": list(v.shape),
            "dtype": v.dtype.str,
            "attrs": {k: str(val) for k, val in sorted(v.attrs.items()) if k in _KEPT_ATTRS},
        }
    )
    stats = _stream(v, h, path, f"variable {name!r}", patterns)
    return h.hexdigest(), stats


def _hash_variables(
    ds: xr.Dataset, cube: _Cube, aux: Mapping[str, Mapping[str, Any]], path: Source
) -> tuple[dict[str, str], dict[str, dict[str, Any]], GridPatterns]:
    """Digest and value statistics per role (cube, then helpers), and the cube's gap patterns."""
    da = cube.da
    patterns = GridPatterns(
        tuple(str(d) for d in da.dims), cube.obs_dim, {str(k): int(n) for k, n in da.sizes.items()}
    )
    digests: dict[str, str] = {}
    stats: dict[str, dict[str, Any]] = {}
    selected = {"cube": cube.name, **{role: info["name"] for role, info in aux.items()}}
    for role, name in selected.items():
        digests[role], stats[role] = _hash_variable(
            ds[name], role, name, path, patterns if role == "cube" else None
        )
    return digests, stats, patterns


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


# ---------------------------------------------------------------- value checks
def _weights_problem(name: str | None, ws: Mapping[str, Any]) -> tuple[str, str] | None:
    """(problem, fix) if the weights are not all finite and ≥ 0 with one > 0; else None."""
    if ws["nan"] or ws["inf"] or ws["negative"]:
        return (
            f"weights {name!r} must be finite and ≥ 0; found {ws['nan']} NaN, "
            f"{ws['inf']} infinite and {ws['negative']} negative value(s)",
            "give every weight a finite value ≥ 0 (NaN is refused too): "
            "a weight of 0 drops its observation",
        )
    if not ws["positive"]:
        return (
            f"weights {name!r} are all zero: no observation has weight > 0",
            "check load.weights (does it name the right variable?): "
            "at least one observation needs a weight > 0",
        )
    return None


def _stats_problems(
    config: NetCDFLoad, cube: _Cube, stats: Mapping[str, Mapping[str, Any]]
) -> list[tuple[str, str]]:
    """(problem, fix) for each unusable set of values in the cube and helper variables."""
    found: list[tuple[str, str]] = []
    s, var = stats["cube"], cube.name
    if s["inf"]:
        where = _where(cube.dims, s["first_inf"])
        found.append(
            (
                f"cube {var!r} holds {s['inf']} infinite value(s){where}; "
                "gridsolve treats only NaN as missing",
                "replace infinite values by NaN (missing) in the file",
            )
        )
    if s["nan"] == s["size"]:
        found.append(
            (
                f"cube {var!r} is entirely NaN: no pixel has data",
                "check load.variable, and the cube's _FillValue, missing_value and valid_range "
                "attributes (values they exclude are missing)",
            )
        )
    if "design" in stats and (stats["design"]["nan"] or stats["design"]["inf"]):
        found.append(
            (
                f"design {config.design!r} holds {stats['design']['nan']} NaN and "
                f"{stats['design']['inf']} infinite value(s)",
                "give the design finite values everywhere, or use a generated design",
            )
        )
    if "weights" in stats and (bad := _weights_problem(config.weights, stats["weights"])):
        found.append(bad)
    if "target" in stats and stats["target"]["inf"]:
        found.append(
            (
                f"target {config.target!r} holds {stats['target']['inf']} infinite value(s)",
                "replace infinite target values by NaN (missing)",
            )
        )
    return found


def _obs_coord_problem(dname: str, values: np.ndarray) -> tuple[str, str] | None:
    """(problem, fix) if the obs coordinate holds NaT / NaN / inf values; else None."""
    if not (bad := _nonfinite(values)):
        return None
    count, first, what = bad
    return (
        f"obs coordinate {dname!r} holds {count} {what} value(s) (first at {dname}={first})",
        f"give every observation a finite {dname!r} value, or drop the observations "
        f"without one (e.g. ds.sel({dname}=ds[{dname!r}].notnull()))",
    )


def _check_values(
    config: NetCDFLoad, cube: _Cube, stats: Mapping[str, Mapping[str, Any]], obs: np.ndarray
) -> None:
    """Raise a ContractError listing every unusable value and its fix; return if there is none."""
    found = _stats_problems(config, cube, stats)
    if bad := _obs_coord_problem(cube.obs_dim, obs):
        found.append(bad)
    if found:
        raise ContractError(
            "input values are unusable",
            stage=STAGE,
            violations=[problem for problem, _ in found],
            fix="; ".join(fix for _, fix in found),
        )


# ---------------------------------------------------------------- small parts
def _read_design(
    ds: xr.Dataset, info: dict[str, Any], obs_dim: str, path: Source
) -> tuple[np.ndarray, list[str] | None]:
    """The design matrix as float64 (obs, coef) and its column labels (None if it has none).

    Also records the design's coef dim and string units in its aux entry ``info``.
    """
    name = info["name"]
    d = ds[name]
    what = f"variable {name!r}"
    values = _values(d, lambda v: v.transpose(obs_dim, ...), what, path).astype(np.float64)
    coef_dim = next(str(x) for x in d.dims if x != obs_dim)
    columns: list[str] | None = None
    if coef_dim in d.coords:
        columns = [str(c) for c in np.asarray(d.coords[coef_dim].values)]
    info["coef_dim"] = coef_dim
    if isinstance(d.attrs.get("units"), str):
        info["units"] = d.attrs["units"]  # hashed with the design's attrs
    return values, columns


def _meta(
    cube: _Cube,
    coord_attrs: dict[str, dict[str, Any]],
    coord_cf: dict[str, dict[str, Any]],
    history: str,
    cube_stats: Mapping[str, Any],
    aux: dict[str, dict[str, Any]],
    design_columns: list[str] | None,
) -> dict[str, Any]:
    """The load stage's metadata, short of its digests and content hash."""
    da = cube.da
    return {
        "variable": cube.name,
        "dims": list(cube.dims),
        "obs_dim": cube.obs_dim,
        "y_dim": cube.y_dim,
        "x_dim": cube.x_dim,
        "n_obs": int(da.sizes[cube.obs_dim]),
        "ny": int(da.sizes[cube.y_dim]),
        "nx": int(da.sizes[cube.x_dim]),
        "lead_dims": list(cube.lead),
        "lead_shape": [int(da.sizes[d]) for d in cube.lead],
        "dtype": da.dtype.str,
        "attrs": {k: _jsonable(v) for k, v in da.attrs.items() if k in _KEPT_ATTRS},
        "coord_attrs": coord_attrs,
        "coord_cf": coord_cf,
        "history": history,
        "nan_count": int(cube_stats["nan"]),
        "abs_max": cube_stats["abs_max"],
        "aux": aux,
        "design_columns": design_columns,
    }


# ---------------------------------------------------------------- tile reads
# The mid-run guard. The stored load artifact names no file (it is content-
# addressed); the ref's per-run source (``locate``) says where the input is this
# run, its identity (inode, size, mtime, ctime) and the content digest seen
# there when the run began. A tile read whose file still has that identity
# proceeds for the cost of a stat. A different identity alone (touched,
# rsync'd, copied over with the same bytes) is not a change: the content is
# hashed again, once per identity and process, and the read refused only if
# it differs from the content the load key covers. So a real change is caught
# and a touch never fails a run, let alone every later one.
_REVALIDATED: dict[tuple[str, str, str], bool] = {}
_REVALIDATE_LOCK = threading.Lock()


def _same_content(src: Mapping[str, Any], content_hash: str, now: Mapping[str, int]) -> bool:
    memo = (src["path"], canonical_json(now), content_hash)
    with _REVALIDATE_LOCK:  # tiles that find the same new identity wait for one rescan
        if memo not in _REVALIDATED:
            try:
                config = NetCDFLoad.model_validate({**src["config"], "path": src["path"]})
                same = scan_netcdf(config, src["path"]).digest == content_hash
            except GridsolveError:  # unreadable now: half-written or replaced
                same = False
            _REVALIDATED[memo] = same
        return _REVALIDATED[memo]


def _set_changed(src: Mapping[str, Any]) -> str | None:
    """The first file of a file set or Zarr store whose bytes differ from what ``locate`` saw."""
    files: Mapping[str, Any] = src.get("files") or {}
    if any(storage.at(f).local is None for f in files):  # objects: compared by their ETags
        base = Source.from_description(src["source"])
        try:
            store = base.path if base.zarr else None
            listed = filesets.remote_digests(list(files), base.storage_options, store)
        except (InputError, KeyError):
            listed = {}
        for f, seen in files.items():
            if f not in listed or listed[f]["identity"] != seen["identity"]:
                return str(f)
        return None
    for f, seen in files.items():
        try:
            now = file_identity(f)
        except FileNotFoundError:
            return str(f)
        if now == seen["identity"]:
            continue
        memo = (f, canonical_json(now), str(seen["digest"]))
        with _REVALIDATE_LOCK:
            if memo not in _REVALIDATED:
                try:
                    _REVALIDATED[memo] = hash_file(f) == seen["digest"]
                except OSError:
                    _REVALIDATED[memo] = False
            if not _REVALIDATED[memo]:
                return str(f)
    return None


def _check_unchanged(meta: Mapping[str, Any]) -> Source:
    """Where the input is this run; InputError if its content is not the one the key covers."""
    src = meta.get(SOURCE) or {}
    path = src.get("path")
    if not path:
        raise StageError(
            "the load metadata names no input file for this run",
            stage=STAGE,
            fix="open the load stage's output through stages.runner, which attaches "
            "where the input is (stages.load.locate)",
        )
    typed = LoadMeta.of(meta)
    content = typed.content_hash
    if "source" in src:
        base = Source.from_description(src["source"], typed.selection)
        changed = _set_changed(src) if src.get("content") == content else base.path
        unchanged = changed is None
        what = f"input file {changed}" + (f" (in the Zarr store {base.path})" if base.zarr else "")
    else:
        base = Source.from_description({"path": path}, typed.selection)
        try:
            now: dict[str, int] | None = file_identity(path)
        except FileNotFoundError:
            now = None
        unchanged = (
            now is not None
            and src.get("content") == content
            and (now == src.get("file") or _same_content(src, content, now))
        )
        what = f"input file {path}"
    if not unchanged:
        raise InputError(
            f"{what} changed or vanished while the run was using it",
            stage=STAGE,
            fix="rerun once the file is complete; write nightly files under a temporary name "
            "and rename them when done",
        )
    return base


def read_block(meta: Mapping[str, Any], role: str, tile: Tile) -> np.ndarray:
    """Read ``role`` ("cube", "weights", "target") for one tile, as (leading, rows, cols) floats.

    ``meta`` is the load stage's output as the runner opens it, with this run's source.
    """
    path = _check_unchanged(meta)
    typed = LoadMeta.of(meta)
    name = typed.variable if role == "cube" else typed.aux[role].name
    y_dim, x_dim, obs_dim = typed.y_dim, typed.x_dim, typed.obs_dim
    ds = path.open_selected()
    try:
        var = ds[name]
        window = {d: v for d, v in typed.plane_window(tile).items() if d in var.dims}
        lead = [d for d in var.dims if d not in window]
        if role in ("cube", "weights"):
            lead = [obs_dim]
        values = _values(
            var,
            lambda v: v.isel(window).transpose(*lead, y_dim, x_dim),
            f"variable {name!r}",
            path,
        )
    finally:
        path.close(ds)
    if values.ndim == 2:
        values = values[None]
    if values.dtype.kind != "f":
        values = values.astype(np.float64)
    return values


# ---------------------------------------------------------------- where the cube is
def _single(config: NetCDFLoad) -> str | None:
    """The one NetCDF file ``load.path`` names, or None for a file set or a Zarr store."""
    if isinstance(config.path, str) and not filesets.is_glob(config.path):
        if storage.at(config.path).local is None:
            return None  # objects are keyed by their ETags, as a set of one
        path = os.path.abspath(os.path.expanduser(config.path))
        return None if filesets.is_zarr(path) else path
    return None


def _members(config: NetCDFLoad) -> tuple[list[str], str | None]:
    """The files a file set or Zarr store consists of, and the store (None for a file set)."""
    opts = config.storage_options
    found = filesets.expand(config.path, opts)
    if len(found) == 1 and filesets.is_zarr(found[0], opts):
        return filesets.store_files(found[0], opts), found[0]
    stores = [f for f in found if filesets.is_zarr(f, opts)]
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
    single = _single(config)
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


# ---------------------------------------------------------------- the stage
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
