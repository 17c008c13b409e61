"""What every part of the load stage shares: its name, the lock around opens and reads.

HDF5 is not thread-safe, so every open and read of the input takes one lock
(:data:`_OPEN_LOCK`); a warning about an input is said once per process
(:func:`say_once`). Also the raw open (values as stored) that the other
modules build on.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import numpy as np
import xarray as xr

STAGE = "load"


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


def _jsonable(v: Any) -> Any:
    if isinstance(v, np.generic):
        return v.item()
    if isinstance(v, np.ndarray):
        return v.tolist()
    return v
