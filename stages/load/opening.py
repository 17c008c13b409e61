"""Opening the input: a NetCDF file (checked before xarray sees it), a URL, a Zarr store.

Each failure is one InputError that says what is wrong with the input and how
to fix it.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import xarray as xr
from xarray import SerializationWarning

from gridsolve.schemas.errors import InputError
from gridsolve.stages.engine import storage
from gridsolve.stages.load.base import _OPEN_LOCK, STAGE, say_once
from gridsolve.stages.load.timeaxis import _undecodable_times
from gridsolve.stages.load.where import relative_paths

_MAGIC = (b"CDF\x01", b"CDF\x02", b"CDF\x05", b"\x89HDF\r\n\x1a\n")


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
            fix=f"check load.path ({relative_paths()})",
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
