"""The scan: check every contract of the input and hash its content, once per file state.

The scan's result (:class:`Scan`) is the load stage's output: the small parts
(coords, design, shared weights) and the metadata later stages read. It is
memoised per file state, refusals included.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import xarray as xr

from gridsolve.schemas.errors import GridsolveError
from gridsolve.schemas.kinds.load import NetCDFLoad
from gridsolve.stages.engine.hashing import (
    canonical_json,
    file_identity,
    hash_text,
)
from gridsolve.stages.engine.store import StageOutput
from gridsolve.stages.load.base import _KEPT_ATTRS, _jsonable
from gridsolve.stages.load.content import _check_values, _hash_variables
from gridsolve.stages.load.coords import _extra_coords, _read_coords
from gridsolve.stages.load.cube import _aux_info, _Cube, _cube, _cube_name
from gridsolve.stages.load.masking import _SET_MASKS
from gridsolve.stages.load.source import Source, _values, resolve_selection


@dataclass
class Scan:
    """Result of checking and hashing one input file."""

    digest: str
    output: StageOutput
    #: the file's identity (``file_identity``) when its scan began
    identity: dict[str, int] = dataclasses.field(default_factory=dict)
    #: when the scan began (ns since the epoch), just after its identity was taken
    began_ns: int = 0


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
    began = time.time_ns()
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
    return dataclasses.replace(scan, identity=json.loads(ident_json), began_ns=began)


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
