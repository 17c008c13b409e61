"""Hashing the selected variables and checking their values.

Each variable is hashed (xxh3-128) block by block as tiles read it, so memory
stays flat, while the same pass counts NaN, inf and signs; the value checks
turn those counts into one ContractError listing every unusable value.
"""

from __future__ import annotations

import concurrent.futures
import functools
import os
import threading
from collections.abc import Mapping
from typing import Any

import numpy as np
import xarray as xr

from gridsolve.schemas.errors import ContractError
from gridsolve.schemas.kinds.load import NetCDFLoad
from gridsolve.stages.engine.hashing import (
    ArrayHasher,
)
from gridsolve.stages.load.base import _KEPT_ATTRS, STAGE
from gridsolve.stages.load.coords import _nonfinite
from gridsolve.stages.load.cube import _Cube
from gridsolve.stages.load.masking import MaskCount
from gridsolve.stages.load.patterns import GridPatterns
from gridsolve.stages.load.source import Source, _values

_BLOCK_BYTES = 64 * 2**20


#: One thread beside the scan's (see :func:`_stream`), shared by the process's scans; made
#: on first use, and again in a forked child (the parent's thread is not in it).
_SIDE: concurrent.futures.ThreadPoolExecutor | None = None
_SIDE_LOCK = threading.Lock()


def _forked() -> None:
    global _SIDE, _SIDE_LOCK
    _SIDE_LOCK = threading.Lock()  # another thread of the parent may have held it
    _SIDE = None


os.register_at_fork(after_in_child=_forked)


def _side() -> concurrent.futures.ThreadPoolExecutor:
    global _SIDE
    with _SIDE_LOCK:
        if _SIDE is None:
            _SIDE = concurrent.futures.ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="gridsolve-scan"
            )
        return _SIDE


def _hash_and_patterns(
    hasher: ArrayHasher,
    patterns: GridPatterns | None,
    block: np.ndarray,
    start: int,
    is_finite: np.ndarray | None,
) -> None:
    hasher.update(block)
    if patterns is not None:
        patterns.update(block, start, is_finite)


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
        # One isfinite pass serves the gap patterns and the counts; isinf only where some
        # value is not finite (count_nonzero: a bool array's sum() is several times slower).
        is_finite = np.isfinite(block) if block.dtype.kind == "f" else None
        # The hash and the gap patterns (neither holds the GIL) beside the counts below:
        # the scan is a user's first wait on a new file.
        side = _side().submit(_hash_and_patterns, hasher, patterns, block, start, is_finite)
        if is_finite is not None:
            not_finite = block.size - int(np.count_nonzero(is_finite))
            n_inf = 0
            if not_finite:
                isinf = np.isinf(block)
                n_inf = int(np.count_nonzero(isinf))
            nan += int(not_finite - n_inf)
            if n_inf and first_inf is None:
                idx = np.argwhere(isinf)[0]
                first_inf = (int(idx[0]) + start, *(int(i) for i in idx[1:]))
            inf += int(n_inf)
            finite = np.where(isinf, 0, block) if n_inf else block
        else:
            finite = block
        neg += int(np.count_nonzero(block < 0))
        pos += int(np.count_nonzero(block > 0))
        if finite.size and finite.dtype.kind in "fiu":
            hi, lo = np.fmax.reduce(finite, axis=None), np.fmin.reduce(finite, axis=None)
            abs_max = float(np.fmax(abs_max, np.fmax(abs(float(hi)), abs(float(lo)))))
        side.result()  # in order: the next block's hash follows this one's
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
