"""CF valid ranges: the values outside ``valid_range`` / ``valid_min`` / ``valid_max`` as NaN.

xarray masks ``_FillValue`` and ``missing_value`` but not the valid range;
this module does, on a raw read of the same selection (see the notes below),
and counts what it masked for one warning per scan.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import xarray as xr

from gridsolve.schemas.errors import ContractError
from gridsolve.stages.load.base import STAGE, _jsonable, _open_raw_file, log, say_once
from gridsolve.stages.load.opening import open_netcdf

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
