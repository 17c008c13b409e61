"""The ``load`` stage: open a NetCDF cube, check its contract, hash its content.

The load stage does not copy the cube. It checks every contract of the file
(dims, dtypes, values), hashes the decoded values of every selected variable
(xxh3-128, streamed, so memory stays flat), and stores the small parts (coords,
design matrix, shared weights) plus a description that later stages use to
read their own tiles straight from the file. Tile reads check that the file
did not change since it was hashed.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import xarray as xr

from schemas.artifacts import Tile
from schemas.config import DemoLoad, NetCDFLoad, suggest
from schemas.contracts import numeric_kind
from schemas.errors import ContractError, InputError
from stages.context import StageContext
from stages.demo import demo_file
from stages.hashing import ArrayHasher, canonical_json, file_identity, hash_text
from stages.patterns import GridPatterns
from stages.registry import StageDecl, register
from stages.store import Artifact, StageOutput

STAGE = "load"
VERSION = "1"

Y_NAMES = ("y", "lat", "latitude", "row", "rows", "northing", "south_north", "nlat", "j")
X_NAMES = ("x", "lon", "longitude", "col", "cols", "column", "easting", "west_east", "nlon", "i")
_MAGIC = (b"CDF\x01", b"CDF\x02", b"CDF\x05", b"\x89HDF\r\n\x1a\n")
_BLOCK_BYTES = 64 * 2**20
_KEPT_ATTRS = ("units", "long_name", "standard_name", "calendar", "axis", "positive")

# HDF5 is not thread-safe; xarray locks its own reads, this guards our opens.
_OPEN_LOCK = threading.RLock()


# ---------------------------------------------------------------- opening
def open_netcdf(path: str | Path, stage: str = STAGE) -> xr.Dataset:
    """Open a NetCDF file lazily, or raise one InputError that says what is wrong with it."""
    p = Path(path)
    if not p.exists():
        raise InputError(
            f"input file not found: {p}",
            stage=stage,
            fix="check load.path (relative paths are resolved against the config file's folder)",
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
        with _OPEN_LOCK:
            return xr.open_dataset(p, engine="netcdf4", cache=False, decode_timedelta=False)
    except Exception as exc:
        raise InputError(
            f"input file {p} is corrupt or truncated and cannot be opened",
            stage=stage,
            found=f"{type(exc).__name__}: {exc}",
            fix="re-create or re-download the file",
        ) from exc


def _read(da: xr.DataArray, what: str, path: str) -> np.ndarray:
    try:
        with _OPEN_LOCK:
            return np.asarray(da.values)
    except Exception as exc:
        raise InputError(
            f"reading {what} from {path} failed: the file is corrupt or truncated",
            stage=STAGE,
            found=f"{type(exc).__name__}: {exc}",
            fix="re-create or re-download the file",
        ) from exc


# ---------------------------------------------------------------- dims
def _pick(names: tuple[str, ...], dims: tuple[str, ...]) -> str | None:
    lowered = {d.lower(): d for d in dims}
    for n in names:
        if n in lowered:
            return lowered[n]
    return None


def infer_dims(
    dims: tuple[str, ...], obs: str | None, y: str | None, x: str | None
) -> tuple[str, str, str, list[str]]:
    """(obs, y, x) dim names from config or from conventional names; violations if impossible."""
    problems = [
        f"{field} {name!r} is not a dim of the variable (its dims are {list(dims)})"
        f"{suggest(name, dims)}"
        for field, name in (("load.obs_dim", obs), ("load.y_dim", y), ("load.x_dim", x))
        if name is not None and name not in dims
    ]
    if problems or len(dims) != 3:
        return "", "", "", problems
    y = y or _pick(Y_NAMES, tuple(d for d in dims if d not in (obs, x)))
    x = x or _pick(X_NAMES, tuple(d for d in dims if d not in (obs, y)))
    if y is None and x is None and obs is None:
        obs, y, x = dims  # conventional (obs, y, x) order
    rest = [d for d in dims if d not in (y, x)]
    if obs is None and y is not None and x is not None and len(rest) == 1:
        obs = rest[0]
    if None in (obs, y, x) or len({obs, y, x}) != 3:
        problems.append(
            f"cannot tell which of {list(dims)} are obs, y and x "
            f"(got obs={obs!r}, y={y!r}, x={x!r})"
        )
        return "", "", "", problems
    assert obs is not None and y is not None and x is not None
    return obs, y, x, problems


# ---------------------------------------------------------------- scan
@dataclass
class Scan:
    """Result of checking and hashing one input file."""

    digest: str
    output: StageOutput


def _coord(
    ds: xr.Dataset, da: xr.DataArray, dim: str, path: str
) -> tuple[np.ndarray, dict[str, Any]]:
    if dim in da.coords:
        c = da.coords[dim]
        values = _read(c, f"coordinate {dim!r}", path)
        attrs = {k: _jsonable(v) for k, v in c.attrs.items() if k in _KEPT_ATTRS}
    else:
        values = np.arange(da.sizes[dim])
        attrs = {}
    if values.dtype == object:
        values = values.astype(str)
    return values, attrs


def _jsonable(v: Any) -> Any:
    if isinstance(v, np.generic):
        return v.item()
    if isinstance(v, np.ndarray):
        return v.tolist()
    return v


def _stream(
    da: xr.DataArray,
    hasher: ArrayHasher,
    path: str,
    what: str,
    patterns: GridPatterns | None = None,
) -> dict[str, Any]:
    """Hash ``da`` block by block along its first dim; count NaN and inf; gap patterns."""
    n0 = da.shape[0]
    row_bytes = max(1, int(np.prod(da.shape[1:], dtype=np.int64)) * da.dtype.itemsize)
    step = max(1, _BLOCK_BYTES // row_bytes)
    nan = inf = 0
    first_inf: tuple[int, ...] | None = None
    neg = 0
    for start in range(0, n0, step):
        block = _read(da.isel({da.dims[0]: slice(start, start + step)}), what, path)
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
            neg += int((block < 0).sum())
        elif block.dtype.kind in "iu":
            neg += int((block < 0).sum())
    return {"nan": nan, "inf": inf, "first_inf": first_inf, "negative": neg, "size": int(da.size)}


def _where(dims: tuple[str, ...], index: tuple[int, ...] | None) -> str:
    if index is None:
        return ""
    return " (first at " + ", ".join(f"{d}={i}" for d, i in zip(dims, index, strict=True)) + ")"


def scan_netcdf(config: NetCDFLoad, path: str) -> Scan:
    """Check every contract of the input and hash its content (memoised per file state)."""
    ident = file_identity(path) if Path(path).is_file() else {}
    return _scan_cached(canonical_json(config.key_payload()), path, canonical_json(ident))


@functools.lru_cache(maxsize=8)
def _scan_cached(config_json: str, path: str, ident_json: str) -> Scan:
    config = NetCDFLoad.model_validate_json(config_json)
    ds = open_netcdf(path)
    try:
        return _scan(config, ds, path)
    finally:
        ds.close()


def _scan(config: NetCDFLoad, ds: xr.Dataset, path: str) -> Scan:
    problems: list[str] = []
    names = [str(n) for n in ds.data_vars]
    var = config.variable
    if var is None:
        cubes = [n for n in names if ds[n].ndim == 3 and numeric_kind(ds[n].dtype)]
        if len(cubes) != 1 and len(names) == 1:
            cubes = names  # the only variable: its own checks say what is wrong with it
        if len(cubes) != 1:
            raise ContractError(
                "cannot tell which variable is the cube",
                stage=STAGE,
                expected="exactly one numeric 3-D data variable, or load.variable set",
                found=f"3-D numeric variables {cubes}; all variables {names}",
                fix="set load.variable to the cube's name",
            )
        var = cubes[0]
    for field, name in (
        ("load.variable", var),
        ("load.design", config.design),
        ("load.weights", config.weights),
        ("load.target", config.target),
    ):
        if name is not None and name not in ds.variables:
            problems.append(
                f"{field}: variable {name!r} is not in the file "
                f"(variables: {', '.join(names)}).{suggest(name, names)}"
            )
    if problems:
        raise ContractError(
            "variables named in the config are missing",
            stage=STAGE,
            violations=problems,
            fix="correct the names in the load section",
        )
    da = ds[var]
    if da.ndim != 3:
        raise ContractError(
            f"variable {var!r} must have 3 dims (obs, y, x)",
            stage=STAGE,
            found=f"{da.ndim} dims {list(da.dims)} with shape {da.shape}",
            fix="select a 3-D variable, or reduce/expand the data to (obs, y, x) first",
        )
    dims = tuple(str(d) for d in da.dims)
    obs_dim, y_dim, x_dim, dim_problems = infer_dims(
        dims, config.obs_dim, config.y_dim, config.x_dim
    )
    problems += dim_problems
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
            expected="a numeric variable with dims (obs, y, x), each of size ≥ 1",
            fix="set load.variable / load.obs_dim / load.y_dim / load.x_dim",
        )
    n_obs, ny, nx = da.sizes[obs_dim], da.sizes[y_dim], da.sizes[x_dim]

    aux: dict[str, dict[str, Any]] = {}
    if config.design is not None:
        d: xr.DataArray = ds[config.design]
        if d.ndim != 2:
            problems.append(
                f"design {config.design!r}: expected 2 dims ({obs_dim}, coef), found {list(d.dims)}"
            )
        elif obs_dim not in d.dims:
            rows = ", ".join(f"{k}={v}" for k, v in d.sizes.items())
            problems.append(
                f"design {config.design!r}: expected dims ({obs_dim}, coef) with {n_obs} rows "
                f"(one per observation), found ({rows})"
            )
        elif d.sizes[obs_dim] != n_obs:
            problems.append(
                f"design {config.design!r}: has {d.sizes[obs_dim]} rows along {obs_dim!r}, "
                f"the cube has {n_obs} observations"
            )
        aux["design"] = {"name": config.design, "dims": [str(x) for x in d.dims]}
    if config.weights is not None:
        w = ds[config.weights]
        wd = tuple(str(x) for x in w.dims)
        if wd == (obs_dim,):
            shared = True
        elif set(wd) == {obs_dim, y_dim, x_dim} and w.ndim == 3:
            shared = False
        else:
            shared = False
            problems.append(
                f"weights {config.weights!r}: expected dims ({obs_dim},) or "
                f"({obs_dim}, {y_dim}, {x_dim}), found {list(wd)}"
            )
        for dname in wd:
            if dname in da.sizes and w.sizes[dname] != da.sizes[dname]:
                problems.append(
                    f"weights {config.weights!r}: dim {dname!r} has size {w.sizes[dname]}, "
                    f"the cube has {da.sizes[dname]}"
                )
        aux["weights"] = {"name": config.weights, "dims": list(wd), "shared": shared}
    if config.target is not None:
        t = ds[config.target]
        td = tuple(str(x) for x in t.dims)
        if not ({y_dim, x_dim} <= set(td) and t.ndim in (2, 3)):
            problems.append(
                f"target {config.target!r}: expected dims ({y_dim}, {x_dim}) or "
                f"(output, {y_dim}, {x_dim}), found {list(td)}"
            )
        else:
            for dname in (y_dim, x_dim):
                if t.sizes[dname] != da.sizes[dname]:
                    problems.append(
                        f"target {config.target!r}: dim {dname!r} has size {t.sizes[dname]}, "
                        f"the cube has {da.sizes[dname]}"
                    )
        out_dims = [d for d in td if d not in (y_dim, x_dim)]
        aux["target"] = {
            "name": config.target,
            "dims": list(td),
            "out_dim": out_dims[0] if out_dims else None,
            "n_out": int(t.sizes[out_dims[0]]) if out_dims else 1,
        }
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

    # Hash content, check values, in one streamed pass per variable.
    digests: dict[str, str] = {}
    stats: dict[str, dict[str, Any]] = {}
    selected = {"cube": var, **{role: info["name"] for role, info in aux.items()}}
    for role, name in selected.items():
        v = ds[name]
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
        if role == "cube":
            grid = GridPatterns(
                tuple(str(d) for d in v.dims), obs_dim, {str(k): int(n) for k, n in v.sizes.items()}
            )
            stats[role] = _stream(v, h, path, f"variable {name!r}", grid)
        else:
            stats[role] = _stream(v, h, path, f"variable {name!r}")
        digests[role] = h.hexdigest()

    cube_dims = dims
    s = stats["cube"]
    if s["inf"]:
        problems.append(
            f"cube {var!r} holds {s['inf']} infinite value(s){_where(cube_dims, s['first_inf'])}; "
            "gridsolve treats only NaN as missing"
        )
    if s["nan"] == s["size"]:
        problems.append(f"cube {var!r} is entirely NaN: no pixel has data")
    if "design" in stats and (stats["design"]["nan"] or stats["design"]["inf"]):
        problems.append(
            f"design {config.design!r} holds {stats['design']['nan']} NaN and "
            f"{stats['design']['inf']} infinite value(s)"
        )
    if "weights" in stats:
        ws = stats["weights"]
        if ws["nan"] or ws["inf"] or ws["negative"]:
            problems.append(
                f"weights {config.weights!r} must be finite and ≥ 0; found {ws['nan']} NaN, "
                f"{ws['inf']} infinite and {ws['negative']} negative value(s)"
            )
    if "target" in stats and stats["target"]["inf"]:
        problems.append(
            f"target {config.target!r} holds {stats['target']['inf']} infinite value(s)"
        )
    if problems:
        raise ContractError(
            "input values are unusable",
            stage=STAGE,
            violations=problems,
            fix="replace infinite or invalid values by NaN (missing) in the file, "
            "or fix the design/weights",
        )

    arrays: dict[str, np.ndarray] = {}
    coord_attrs: dict[str, dict[str, Any]] = {}
    for role, dname in (("obs", obs_dim), ("y", y_dim), ("x", x_dim)):
        arrays[role], coord_attrs[role] = _coord(ds, da, dname, path)
        h = ArrayHasher()
        h.header(
            {
                "coord": role,
                "name": dname,
                "dtype": arrays[role].dtype.str,
                "attrs": coord_attrs[role],
            }
        )
        h.update(arrays[role])
        digests[f"coord_{role}"] = h.hexdigest()
    design_columns: list[str] | None = None
    if "design" in aux:
        d = ds[aux["design"]["name"]].transpose(obs_dim, ...)
        arrays["design"] = _read(d, f"variable {config.design!r}", path).astype(np.float64)
        coef_dim = str(d.dims[1])
        if coef_dim in d.coords:
            design_columns = [str(c) for c in np.asarray(d.coords[coef_dim].values)]
        aux["design"]["coef_dim"] = coef_dim
    if s["nan"]:
        # Gap patterns many pixels share get one factorisation each in the solve stage.
        arrays["gap_patterns"] = grid.common()
    if "weights" in aux and aux["weights"]["shared"]:
        arrays["weights"] = _read(ds[config.weights], f"variable {config.weights!r}", path).astype(
            np.float64
        )

    meta = {
        "path": str(Path(path).resolve()),
        "file": file_identity(path),
        "variable": var,
        "dims": list(cube_dims),
        "obs_dim": obs_dim,
        "y_dim": y_dim,
        "x_dim": x_dim,
        "n_obs": int(n_obs),
        "ny": int(ny),
        "nx": int(nx),
        "dtype": da.dtype.str,
        "attrs": {k: _jsonable(v) for k, v in da.attrs.items() if k in _KEPT_ATTRS},
        "coord_attrs": coord_attrs,
        "nan_count": int(s["nan"]),
        "aux": aux,
        "design_columns": design_columns,
        "digests": digests,
    }
    digest = hash_text(canonical_json(digests))
    meta["content_hash"] = digest
    return Scan(digest=digest, output=StageOutput(arrays=arrays, meta=meta))


# ---------------------------------------------------------------- tile reads
def _check_unchanged(meta: Mapping[str, Any]) -> None:
    try:
        now = file_identity(meta["path"])
    except FileNotFoundError:
        now = None
    if now != meta["file"]:
        raise InputError(
            f"input file {meta['path']} changed or vanished while the run was using it",
            stage=STAGE,
            fix="rerun once the file is complete; write nightly files under a temporary name "
            "and rename them when done",
        )


def read_block(meta: Mapping[str, Any], role: str, tile: Tile) -> np.ndarray:
    """Read ``role`` ("cube", "weights", "target") for one tile, as (leading, rows, cols) floats."""
    _check_unchanged(meta)
    name = meta["variable"] if role == "cube" else meta["aux"][role]["name"]
    y_dim, x_dim, obs_dim = meta["y_dim"], meta["x_dim"], meta["obs_dim"]
    ds = open_netcdf(meta["path"])
    try:
        da = ds[name].isel({y_dim: slice(tile.y0, tile.y1), x_dim: slice(tile.x0, tile.x1)})
        lead = [d for d in da.dims if d not in (y_dim, x_dim)]
        if role in ("cube", "weights"):
            lead = [obs_dim]
        da = da.transpose(*lead, y_dim, x_dim)
        values = _read(da, f"variable {name!r}", meta["path"])
    finally:
        ds.close()
    if values.ndim == 2:
        values = values[None]
    if values.dtype.kind != "f":
        values = values.astype(np.float64)
    return values


# ---------------------------------------------------------------- the stage
def fingerprint(config: NetCDFLoad | DemoLoad, ctx: StageContext) -> dict[str, str]:
    """Content digest of the selected input variables (what the load key covers)."""
    path, nc = _netcdf_config(config, ctx)
    return {"content": scan_netcdf(nc, path).digest}


def run(
    config: NetCDFLoad | DemoLoad, inputs: Mapping[str, Artifact], ctx: StageContext
) -> StageOutput:
    """Checked description of the input plus its coords, design and shared weights."""
    path, nc = _netcdf_config(config, ctx)
    return scan_netcdf(nc, path).output


def _netcdf_config(config: NetCDFLoad | DemoLoad, ctx: StageContext) -> tuple[str, NetCDFLoad]:
    if isinstance(config, DemoLoad):
        path = demo_file(ctx.store.root, config.size, config.seed, config.nan_fraction)
        return str(path), NetCDFLoad(path=str(path), variable="signal")
    return config.path, config


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
            summary=_summary,
        )
    )
