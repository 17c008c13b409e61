"""CF time axes: times xarray cannot decode, and times numpy cannot hold.

A file whose time units are of variable length (months, years) is refused
with a message that says how to rewrite them; times in calendars numpy's
datetime64 cannot hold (cftime dates) are kept as the numbers the file stores,
with their ``units`` and ``calendar`` (read in :mod:`.coords`).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import xarray as xr

from gridsolve.schemas.errors import InputError
from gridsolve.stages.load.base import _OPEN_LOCK

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


def is_cftime(values: np.ndarray) -> bool:
    """Whether ``values`` are cftime dates (times in a calendar numpy cannot hold)."""
    first = values.reshape(-1)[:1]
    return (
        values.dtype == object
        and len(first) == 1
        and type(first[0]).__module__.startswith("cftime")
    )
