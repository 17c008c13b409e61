"""The ``write`` stage: one NetCDF file with the output contract, written atomically.

Coordinates and the design matrix are written first with xarray (which knows
how to encode datetimes and strings); the large variables are then created
with netCDF4 and filled tile by tile, so memory stays at one tile, as chunks
compressed on every core and stored directly (:mod:`.direct`). Everything
goes to a temporary file beside the target, renamed over it only when complete:
a crash or an error never leaves a half file under the final name.

The file's content is a pure function of the input content and the config (no
timestamps), so reruns give bit-identical files; run-specific facts (flow run,
timings) go to the Prefect artifacts instead.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import netCDF4
import numpy as np
import xarray as xr

from gridsolve.schemas.contracts import MODEL_STATUS_FLAGS, STATUS_CODES, STATUS_FLAGS
from gridsolve.schemas.errors import ContractError, GridsolveError, OutputError
from gridsolve.schemas.kinds.write import NetCDFWrite, ZarrWrite
from gridsolve.stages.engine import remote
from gridsolve.stages.engine.context import StageContext
from gridsolve.stages.engine.contract import contract_of
from gridsolve.stages.engine.hashing import canonical_json, file_digest, hash_text
from gridsolve.stages.engine.paths import (
    atomic_file,
    ensure_allowed,
    ensure_allowed_url,
    sweep_dead_temporaries,
)
from gridsolve.stages.engine.provenance import MARK_KEY, MARK_VALUE, is_gridsolve_output
from gridsolve.stages.engine.registry import SOURCE, StageDecl, register
from gridsolve.stages.engine.store import Artifact, StageOutput, TiledArtifact
from gridsolve.stages.engine.versions import package_versions
from gridsolve.stages.load.contract import plane_window
from gridsolve.stages.load.files import ZARR_MARKERS
from gridsolve.stages.write.direct import ChunkWriter

VERSION = "2"
STAGE = "write/netcdf"
DEFAULT_CHUNK_Y = 128
DEFAULT_CHUNK_X = 256
#: CF version the file follows (and the checkers know).
CONVENTIONS = "CF-1.8"
#: Output variables that are pure numbers whatever the data's units.
DIMENSIONLESS = ("n_valid", "dof", "r2", "t_value", "p_value")
#: Output variables in the coefficients' units.
COEF_LIKE = ("coefficients", "coef_stderr")


#: The output variable holding the design matrix (obs, coef) of the fit.
DESIGN_VARIABLE = "design"


def _free_bytes(folder: Path) -> int:
    try:
        st = os.statvfs(folder)
    except OSError:
        return 2**62
    return st.f_bavail * st.f_frsize


def check_output_url(
    url: str,
    overwrite: bool,
    options: Mapping[str, Any],
    folder: bool = False,
    stage: str = STAGE,
) -> str:
    """The output URL; OutputError if its bucket is missing or refuses us, or it is not replaceable.

    ``folder``: the output is a prefix (a Zarr store), replaced as a whole.
    """
    url = ensure_allowed_url(url.rstrip("/"), "output URL", stage)
    # A store is probed inside its own prefix: a policy that refuses writes there is
    # found before the previous store is touched.
    where = url if folder else url.rsplit("/", 1)[0]
    remote.probe_writable(where, options, "output", OutputError, stage, shown=url)
    with remote.translated(url, "output", OutputError, stage, options):
        objects = remote.find(url, options)
        # a complete store, or what a killed gridsolve writer left (its marker object)
        is_store = f"{url}/.gridsolve-writing" in objects or (
            f"{url}/.zmetadata" in objects and _store_is_ours(url, options)
        )
        is_object = url in objects
    if folder and is_object:
        raise OutputError(
            f"output URL {url} is an object, not a Zarr store",
            stage=stage,
            fix="set write.path to a new name (e.g. s3://bucket/out.zarr), or remove the object",
        )
    if objects and not is_object and not (folder and is_store):
        raise OutputError(
            f"output URL {url} is a prefix holding objects that are not "
            f"{'a gridsolve Zarr store' if folder else 'one file'}; they are left as they are",
            stage=stage,
            fix="set write.path to a new name",
        )
    if objects and not overwrite:
        raise OutputError(
            f"output {url} exists and write.overwrite is false",
            stage=stage,
            fix="remove it, set write.overwrite: true, or template write.path with {flow_run_name}",
        )
    return url


def _store_is_ours(url: str, options: Mapping[str, Any]) -> bool:
    """Whether the consolidated Zarr store at ``url`` carries gridsolve's provenance."""
    try:
        raw = remote.filesystem(url, options).cat_file(f"{url}/.zmetadata")
        attrs = json.loads(raw).get("metadata", {}).get(".zattrs", {})
    except (OSError, ValueError, AttributeError):
        return False
    return isinstance(attrs, dict) and "gridsolve_config" in attrs


def check_write_target(config: Any) -> None:
    """Before any work: a bucket output's bucket exists, takes our writes, may be replaced.

    Local outputs are checked by the writer (their folder is made then); a
    plugin writer's config without ``path``/``overwrite`` is left to the plugin.
    """
    if isinstance(config, NetCDFWrite | ZarrWrite) and remote.is_url(config.path):
        check_output_url(
            config.path,
            config.overwrite,
            config.storage_options,
            folder=isinstance(config, ZarrWrite),
            stage=f"write/{config.impl}",
        )


def check_output_path(path: str, overwrite: bool, folder: bool = False, stage: str = STAGE) -> Path:
    """The output path, its folder created if missing; OutputError if it cannot be written.

    ``folder``: the output is itself a folder (a Zarr store), replaced as a whole.
    Only a previous gridsolve output is ever replaced (see :func:`refuse_foreign`).
    """
    p = ensure_allowed(path, "output file", stage)
    parent = p.parent
    if parent.exists() and not parent.is_dir():
        raise OutputError(f"output folder {parent} is a file", stage=stage, fix="fix write.path")
    try:
        parent.mkdir(
            parents=True, exist_ok=True
        )  # like mkdir -p: nightly runs write into new folders
    except OSError as exc:
        raise OutputError(
            f"cannot create the output folder {parent}: {exc.strerror or exc}",
            stage=stage,
            fix="set write.path to a writable location, or create the folder first",
        ) from exc
    if not os.access(parent, os.W_OK | os.X_OK):
        raise OutputError(
            f"output folder {parent} is not writable",
            stage=stage,
            fix="set write.path to a writable folder, or fix its permissions",
        )
    if p.is_dir() and not folder:
        raise OutputError(
            f"output path {p} is a folder", stage=stage, fix="set write.path to a file name"
        )
    if folder and p.exists() and not p.is_dir():
        raise OutputError(
            f"output path {p} is a file, not a Zarr store",
            stage=stage,
            fix="set write.path to a new name (e.g. out.zarr), or remove the file",
        )
    if p.exists() and not overwrite:
        raise OutputError(
            f"output file {p} exists and write.overwrite is false",
            stage=stage,
            fix="remove it, set write.overwrite: true, or template write.path with {flow_run_name}",
        )
    refuse_foreign(p, folder, stage)
    return p


def refuse_foreign(p: Path, folder: bool, stage: str) -> None:
    """OutputError when ``p`` exists and is not an output gridsolve wrote (it is never replaced).

    Replacing means deleting, so both writers replace only what carries the
    provenance every gridsolve output has (``gridsolve_config``; see
    :func:`~gridsolve.stages.write.retention.is_gridsolve_output`): a Zarr
    store of either format version, a NetCDF file, or anything else without it
    (someone's data, an input) is left as it is. An empty file or folder holds
    nothing to lose and is replaced.
    """
    if folder and p.is_dir():
        if not any(p.iterdir()) or is_gridsolve_output(p):
            return
        if any((p / m).exists() for m in ZARR_MARKERS):
            raise OutputError(
                f"output path {p} is a Zarr store that gridsolve did not write (its attributes "
                "carry no gridsolve provenance); it is left as it is",
                stage=stage,
                fix="set write.path to a new name (e.g. out.zarr); only a previous gridsolve "
                "output is replaced",
            )
        raise OutputError(
            f"output path {p} is a folder that is not a Zarr store; it is left as it is",
            stage=stage,
            fix="set write.path to a new name (e.g. out.zarr) or to an existing store",
        )
    if not folder and p.is_file() and p.stat().st_size > 0 and not is_gridsolve_output(p):
        raise OutputError(
            f"output file {p} exists and is not a gridsolve output (no gridsolve_config "
            "attribute); it is left as it is",
            stage=stage,
            fix="set write.path to a new name, or remove that file yourself if it may go; only "
            "a previous gridsolve output is replaced",
        )


def chunk_sizes(
    dims: Sequence[str], shape: Sequence[int], y_dim: str, x_dim: str, cfg: NetCDFWrite | ZarrWrite
) -> list[int]:
    """Chunk length along each of ``dims``: write.chunks, else 256 × 256 spatially, 1 elsewhere."""
    out = []
    for d, n in zip(dims, shape, strict=True):
        if cfg.chunks and d in cfg.chunks:
            c = cfg.chunks[d]
        elif d == y_dim:
            c = DEFAULT_CHUNK_Y
        elif d == x_dim:
            c = DEFAULT_CHUNK_X
        else:
            c = 1
        out.append(max(1, min(c, n)))
    return out


def chunk_alignment(cfg: NetCDFWrite | ZarrWrite, y_dim: str, x_dim: str) -> tuple[int, int]:
    """Rows and columns of one output chunk: tiles align to them so chunks are written once."""
    chunks = cfg.chunks or {}
    return chunks.get(y_dim, DEFAULT_CHUNK_Y), chunks.get(x_dim, DEFAULT_CHUNK_X)


_PLAIN_UNIT = re.compile(r"[A-Za-z0-9 .^-]+")
_SYMBOL_POWER = re.compile(r"([A-Za-z]+)(-?\d*)")


def per_unit(units: str | None, per: str | None) -> str | None:
    """``units`` divided by ``per`` in UDUNITS syntax (``K``, ``day`` → ``K day-1``).

    None when either is unknown, or ``units`` is a time reference (``… since …``).
    """
    if units is None or per is None or "since" in units or "since" in per:
        return None
    if per == "1":
        return units
    m = _SYMBOL_POWER.fullmatch(per)
    inverse = f"{m[1]}{-int(m[2] or 1)}" if m else f"({per})-1"
    if units == "1":
        return inverse
    return f"{units} {inverse}" if _PLAIN_UNIT.fullmatch(units) else f"({units}) {inverse}"


def coefficient_units(load: Artifact, design: Artifact) -> list[str | None]:
    """Units of each coefficient: the data's units over its design column's (None: unknown)."""
    units = load.meta["attrs"].get("units")
    cols = design.meta.get("column_units") or [None] * len(design.meta["columns"])
    return [per_unit(units, c) for c in cols]


def _cf_attrs(v: dict[str, Any], coef_units: list[str | None], data_units: str | None) -> None:
    """Units for variables whose units follow from their name, where not yet set."""
    attrs = v["attrs"]
    if "units" in attrs or "flag_values" in attrs or "flag_masks" in attrs:
        return
    name = v["name"]
    if name in DIMENSIONLESS:
        attrs["units"] = "1"
    elif name in COEF_LIKE or name == "coef_cov":
        uniform = coef_units[0] if len(set(coef_units)) == 1 else None
        if uniform is not None and name != "coef_cov":
            attrs["units"] = uniform
        elif uniform is not None and _PLAIN_UNIT.fullmatch(uniform):
            attrs["units"] = f"({uniform})2" if " " in uniform else f"{uniform}2"
    elif name == "residual_rms" and data_units:
        attrs["units"] = data_units
    elif name == "prediction" or name.startswith(("grad_", "jac_")):
        attrs["units"] = "1"  # the model declares no units


def _uncertainty_variables(solve: TiledArtifact, y: str, x: str) -> list[dict[str, Any]]:
    """The solve's per-pixel uncertainty variables, where it made them (solve.uncertainty).

    A table of CF attributes per variable, hence its length.
    """
    first = solve.tiles[0][1] if solve.tiles else None
    if first is None or "coef_stderr" not in first:
        return []
    from gridsolve.stages.solve.lstsq import (  # imports torch
        UNCERTAINTY_FLAGS,
        p_values,
        t_values,
    )

    def t_of(solved: Artifact) -> np.ndarray:
        return t_values(solved.array("coefficients"), solved.array("coef_stderr"))

    scaled = solve.meta.get("cov_scale", "residual") == "residual"
    how = (
        "scaled by the residual variance sum(w*r^2)/dof"
        if scaled
        else "unscaled (weights taken as 1/variance of known errors)"
    )
    dist = "Student t with dof degrees of freedom" if scaled else "standard normal"
    out: list[dict[str, Any]] = [
        {
            "name": "coef_stderr",
            "src": ("solve", "coef_stderr"),
            "dims": ("coef", y, x),
            "attrs": {
                "long_name": "standard error of the least-squares coefficients",
                "comment": f"covariance {how}; NaN where a coefficient is not identifiable",
            },
        },
        {
            "name": "t_value",
            "src": ("solve", "coef_stderr"),  # its shape and dtype
            # derived data, computed here (stages.solve.lstsq.t_values)
            "from_tile": lambda arts: t_of(arts["solve"]),
            "dims": ("coef", y, x),
            "attrs": {"long_name": "t-statistic of the coefficients (coefficient / stderr)"},
        },
        {
            "name": "p_value",
            "src": ("solve", "coef_stderr"),  # its shape (float64: float32 underflows small p)
            # a function of t and dof alone, computed here (stages.solve.lstsq.p_values)
            "from_tile": lambda arts: p_values(
                t_of(arts["solve"]), arts["solve"].array("dof"), scaled
            ),
            "dims": ("coef", y, x),
            "attrs": {
                "long_name": "two-sided p-value of the coefficients being zero",
                "comment": f"from the {dist} distribution",
            },
        },
        {
            "name": "dof",
            "src": ("solve", "dof"),
            "dims": (y, x),
            "attrs": {
                "long_name": "residual degrees of freedom",
                "comment": "valid observations minus the effective rank (trace of the hat "
                "matrix under ridge)",
            },
        },
        {
            "name": "r2",
            "src": ("solve", "r2"),
            "dims": (y, x),
            "attrs": {
                "long_name": "coefficient of determination",
                "comment": "centred where the pixel's design spans a constant, else uncentred",
            },
        },
        {
            "name": "uncertainty_flags",
            "src": ("solve", "uncertainty_flags"),
            "dims": (y, x),
            "attrs": {
                "long_name": "uncertainty flags",
                "flag_masks": np.array(sorted(UNCERTAINTY_FLAGS), dtype=np.int8),
                "flag_meanings": " ".join(UNCERTAINTY_FLAGS[k] for k in sorted(UNCERTAINTY_FLAGS)),
            },
        },
    ]
    for v in out[1:5]:
        v["attrs"]["units"] = "1"
    if "coef_cov" in first:
        out.insert(
            1,
            {
                "name": "coef_cov",
                "src": ("solve", "coef_cov"),
                "dims": ("coef", "coef2", y, x),
                "attrs": {
                    "long_name": "covariance of the least-squares coefficients",
                    "comment": f"{how}; coef2 indexes the design columns as coef does",
                },
            },
        )
    return out


def _contract_variables(
    tiled: Mapping[str, TiledArtifact], described: list[dict[str, Any]], y: str, x: str
) -> list[dict[str, Any]]:
    """Variables for the tile arrays a kind's contract declares that this writer does not describe.

    A new tiled kind's arrays reach the file without an edit here: named after
    the array, with the contract's dims (y and x renamed to the input's) and its
    description as long_name.
    """
    have = {tuple(v["src"]) for v in described}
    out = []
    for kind, art in tiled.items():
        contract = contract_of(kind)
        if contract is None or not art.tiles:
            continue
        for name, spec in contract.part("tile").arrays.items():
            if (kind, name) in have or name not in art.tiles[0][1]:
                continue
            dims = tuple({"y": y, "x": x}.get(d, d) for d in spec.dims)
            attrs = {"long_name": spec.description} if spec.description else {}
            out.append({"name": name, "src": (kind, name), "dims": dims, "attrs": attrs})
    return out


def _undetermined_nan(
    values: np.ndarray,
    arts: Mapping[str, Artifact],
    shared: Sequence[int],
    *columns: np.ndarray | int,
) -> np.ndarray:
    """``values`` NaN where the pixel's valid rows do not determine the ``columns``.

    ``values`` (float64) has a value per ``columns`` entry and pixel. A tile with
    gaps has the solve's ``undetermined`` (coef, y, x) mask where one of its pixels
    is ``underdetermined``; in a gap-free tile every such pixel lacks the shared
    design's ``shared`` columns (the solve's prepared meta).
    """
    solved = arts["solve"]
    if "undetermined" in solved:
        und = np.asarray(solved.array("undetermined")) != 0
    elif shared:
        status = np.asarray(solved.array("status"))
        top = max(int(np.max(c)) for c in (shared, *columns)) + 1
        und = np.zeros((top, *status.shape), dtype=bool)
        und[list(shared)] = status == STATUS_CODES["underdetermined"]
    else:
        return values
    hit = np.zeros(values.shape, dtype=bool)
    for col in columns:
        hit |= und[col]
    return np.where(hit, np.nan, values)


def _harmonic_variables(
    design: Artifact, units: str | None, y: str, x: str, shared: Sequence[int] = ()
) -> list[dict[str, Any]]:
    """Amplitude and peak time of each harmonic of a harmonic design, from its cos/sin pair.

    ``c cos w + s sin w = A cos(w - φ)`` with ``A = hypot(c, s)``, ``φ = atan2(s, c)``
    and ``w = 2πk (v - t_centre) / period``: the maximum is at
    ``v = t_centre + φ period / (2πk)``, given within one period of the harmonic.
    """
    harmonics = design.meta.get("harmonics") or []
    if not harmonics:
        return []
    cos_i = np.array([h["cos"] for h in harmonics])
    sin_i = np.array([h["sin"] for h in harmonics])
    ks = np.array([h["k"] for h in harmonics], dtype=np.float64)[:, None, None]
    period = float(design.meta["period"])
    step = design.meta.get("axis_step")

    def amplitude(arts: Mapping[str, Artifact]) -> np.ndarray:
        a = arts["solve"].array("coefficients")
        c, s = a[cos_i].astype(np.float64), a[sin_i].astype(np.float64)
        out = _undetermined_nan(np.hypot(c, s), arts, shared, cos_i, sin_i)
        return out.astype(a.dtype)

    def peak(arts: Mapping[str, Artifact]) -> np.ndarray:
        a = arts["solve"].array("coefficients")
        c, s = a[cos_i].astype(np.float64), a[sin_i].astype(np.float64)
        phi = np.mod(np.arctan2(s, c), 2 * np.pi)
        out = _undetermined_nan(phi * period / (2 * np.pi * ks), arts, shared, cos_i, sin_i)
        return out.astype(a.dtype)

    return [
        {
            "name": "amplitude",
            "src": ("solve", "coefficients"),
            "from_tile": amplitude,
            "dims": ("harmonic", y, x),
            "attrs": {
                "long_name": "amplitude of each harmonic: hypot of its cos and sin coefficients",
                **({"units": units} if units else {}),
            },
        },
        {
            "name": "peak_offset",
            "src": ("solve", "coefficients"),
            "from_tile": peak,
            "dims": ("harmonic", y, x),
            "attrs": {
                "long_name": "time of each harmonic's maximum after the design's t_centre, "
                "within one period of the harmonic (period / harmonic)",
                **({"units": step} if step else {}),
            },
        },
    ]


def output_variables(
    load: Artifact,
    design: Artifact,
    tiled: Mapping[str, TiledArtifact],
    layout: str = "nested",
) -> list[dict[str, Any]]:
    """Name, source array, dims and attrs of every tiled output variable.

    The described variables are a table of CF attributes per output (why this is
    long); arrays of tiled kinds it does not know come from their contracts.
    """
    solve, model = tiled["solve"], tiled.get("model")
    y, x = load.meta["y_dim"], load.meta["x_dim"]
    # the shared design's undetermined coefficients (see _undetermined_nan)
    shared = [int(j) for j in solve.meta.get("undetermined_columns") or ()]
    units = load.meta["attrs"].get("units")
    flags = sorted(STATUS_FLAGS)
    out: list[dict[str, Any]] = [
        {
            "name": "coefficients",
            "src": ("solve", "coefficients"),
            "dims": ("coef", y, x),
            "attrs": {"long_name": "least-squares coefficients of the design columns"},
        },
        {
            "name": "residual_rms",
            "src": ("solve", "residual_rms"),
            "dims": (y, x),
            "attrs": {
                "long_name": "root mean square of the residuals over valid observations",
                **({"units": units} if units else {}),
            },
        },
        {
            "name": "n_valid",
            "src": ("solve", "n_valid"),
            "dims": (y, x),
            "attrs": {"long_name": "number of valid observations", "units": "1"},
        },
        {
            "name": "status",
            "src": ("solve", "status"),
            "dims": (y, x),
            "attrs": {
                "long_name": "solve status",
                "flag_values": np.array(flags, dtype=np.int8),
                "flag_meanings": " ".join(STATUS_FLAGS[k] for k in flags),
            },
        },
        *_uncertainty_variables(solve, y, x),
    ]
    if model is not None:  # model: none writes nothing of a model
        out += _model_variables(model, y, x)
    out += _trend_variables(design, units, y, x, shared)
    out += _harmonic_variables(design, units, y, x, shared)
    # Optional outputs (gradients w.r.t. what wrt excludes, the Jacobian) where made.
    kept = [
        v for v in out if tiled[v["src"][0]].tiles and v["src"][1] in tiled[v["src"][0]].tiles[0][1]
    ]
    kept += _contract_variables(tiled, out, y, x)
    coef_units = coefficient_units(load, design)
    for v in kept:
        _cf_attrs(v, coef_units, units)
        if "coef" in v["dims"]:
            v["attrs"]["coordinates"] = " ".join(_coef_labels(coef_units))
        if layout == "flat" and len(v["dims"]) > 3:
            # One extra dim per variable: what CDO and Panoply read.
            v["flat_from"] = v["dims"][:-2]
            v["dims"] = (f"{v['name']}_index", y, x)
            v["attrs"]["coordinates"] = f"{v['name']}_label"
    return kept


def _model_variables(model: TiledArtifact, y: str, x: str) -> list[dict[str, Any]]:
    """The model's output variables: prediction, status, per-sample gradients and Jacobians."""
    m = model.meta
    obj = "sum of outputs" if m["objective"] == "sum" else "mean squared error against the target"
    model_flags = sorted(MODEL_STATUS_FLAGS)
    out: list[dict[str, Any]] = [
        {
            "name": "prediction",
            "src": ("model", "prediction"),
            "dims": ("output", y, x),
            "attrs": {"long_name": "model output per pixel"},
        },
        {
            "name": "model_status",
            "src": ("model", "model_status"),
            "dims": (y, x),
            "attrs": {
                "long_name": "model stage status",
                "flag_values": np.array(model_flags, dtype=np.int8),
                "flag_meanings": " ".join(MODEL_STATUS_FLAGS[k] for k in model_flags),
            },
        },
    ]
    for kind, label in (
        ("grad", "per-sample gradient"),
        ("jac", "per-sample Jacobian of the outputs"),
    ):
        for name, dims in m["param_dims"].items():
            src = f"{kind}:{name}"
            lead = ("output",) if kind == "jac" else ()
            # A parameter dim named like the Jacobian's own (the bias's "output")
            # gets a name of its own: one dim may not appear twice in a variable.
            dims = tuple(f"{d}_wrt" if d in lead else d for d in dims)
            out.append(
                {
                    "name": f"{kind}_{name.replace('.', '_')}",
                    "src": ("model", src),
                    "dims": (*lead, *dims, y, x),
                    "attrs": {
                        "long_name": f"{label} with respect to parameter {name}"
                        + (f" of the {obj}" if kind == "grad" else "")
                    },
                }
            )
        out.append(
            {
                "name": f"{kind}_input",
                "src": ("model", f"{kind}:input"),
                "dims": (*(("output",) if kind == "jac" else ()), *m["input_dims"], y, x),
                "attrs": {
                    "long_name": f"{label} with respect to the input (the coefficients)"
                    + (f" of the {obj}" if kind == "grad" else "")
                },
            }
        )
    return out


def _trend_variables(
    design: Artifact, units: str | None, y: str, x: str, shared: list[int]
) -> list[dict[str, Any]]:
    """``trend``, where the design has a trend column: its coefficient per raw obs unit."""
    out: list[dict[str, Any]] = []
    trend = design.meta.get("trend")
    if trend is not None:
        col, scale = int(trend["column"]), float(trend["scale"])

        def trend_of(arts: Mapping[str, Artifact]) -> np.ndarray:
            a = arts["solve"].array("coefficients")
            trend = a[col].astype(np.float64) / scale
            return _undetermined_nan(trend, arts, shared, col).astype(a.dtype)

        out.append(
            {
                "name": "trend",
                "src": ("solve", "coefficients"),
                # NaN where the pixel's valid rows do not determine the trend column
                "from_tile": trend_of,
                "dims": (y, x),
                "attrs": {
                    "coefficient": str(design.meta["columns"][col]),
                    "long_name": f"linear trend: coefficient of column "
                    f"{design.meta['columns'][col]!r} per raw obs axis unit "
                    "(the column's coefficient divided by the design's t_scale)",
                    **({"units": u} if (u := per_unit(units, trend.get("per"))) else {}),
                },
            }
        )
    return out


def _coef_labels(coef_units: list[str | None]) -> list[str]:
    """The label variables of the coef dim: names, and per-column units where they differ."""
    return ["coef_name"] if len(set(coef_units)) == 1 else ["coef_name", "coef_units"]


def _coord_attrs(info: Mapping[str, Any]) -> dict[str, Any]:
    """The input coordinate's attributes, numbers in their own dtype again."""
    dtypes = info.get("attr_dtypes", {})
    return {
        k: np.asarray(v, dtype=dtypes[k]) if k in dtypes else v
        for k, v in info.get("attrs", {}).items()
    }


def _design_attrs(design: Artifact) -> dict[str, Any]:
    """Attributes of the design variable: basis, conditioning, units, the time scaling."""
    design_attrs: dict[str, Any] = {
        "long_name": "design matrix used for the fit",
        "basis": design.meta.get("basis", ""),
        "condition_number": float(design.meta["cond"]),
        "rank": int(design.meta["rank"]),
    }
    col_units = design.meta.get("column_units") or []
    if col_units and len(set(col_units)) == 1 and col_units[0] is not None:
        design_attrs["units"] = col_units[0]
    for k in ("t_centre", "t_scale", "t_units", "period"):
        if k in design.meta:
            design_attrs[k] = design.meta[k]
    if "t_centre" in design.meta:
        design_attrs["comment"] = (
            "columns are functions of t = (v - t_centre) / t_scale, v the obs coordinate "
            "in t_units; a coefficient per unit of v is the coefficient / t_scale**power"
        )
    return design_attrs


def skeleton(load: Artifact, design: Artifact, attrs: Mapping[str, Any]) -> xr.Dataset:
    """Coordinates, bounds, coef labels and the design matrix, encoded as CF wants them."""
    meta = load.meta
    obs_dim, y, x = meta["obs_dim"], meta["y_dim"], meta["x_dim"]
    cf = meta.get("coord_cf") or {}
    cols = design.meta["columns"]
    coords: dict[str, Any] = {}
    bounds: dict[str, Any] = {}
    roles = [("obs", obs_dim), ("y", y), ("x", x)]
    roles += [(f"lead:{d}", d) for d in meta.get("lead_dims") or []]
    for role, dim in roles:
        info = cf.get(role) or {"attrs": meta["coord_attrs"][role]}
        coords[dim] = (dim, np.asarray(load.array(role)), _coord_attrs(info))
        if info.get("bounds") and f"{role}_bounds" in load:
            b = info["bounds"]
            bounds[b["name"]] = (tuple(b["dims"]), np.asarray(load.array(f"{role}_bounds")))
    coords["coef"] = (
        "coef",
        np.arange(len(cols), dtype=np.int32),
        {"long_name": "design column", "units": "1"},
    )
    coords["coef_name"] = ("coef", np.array(cols, dtype=str), {"long_name": "design column name"})
    n_harmonics = len(design.meta.get("harmonics") or [])
    if n_harmonics:
        coords["harmonic"] = (
            "harmonic",
            np.arange(1, n_harmonics + 1, dtype=np.int32),
            {
                "long_name": "harmonic number k (its period is the design's period / k)",
                "units": "1",
            },
        )
    coef_units = coefficient_units(load, design)
    if "coef_units" in _coef_labels(coef_units):
        coords["coef_units"] = (
            "coef",
            np.array([u or "" for u in coef_units], dtype=str),
            {"long_name": "units of the coefficient of each design column (empty: unknown)"},
        )
    design_attrs = _design_attrs(design)
    ds = xr.Dataset(
        {
            DESIGN_VARIABLE: ((obs_dim, "coef"), np.asarray(design.array("A")), design_attrs),
            **{name: (dims, values, {}) for name, (dims, values) in bounds.items()},
        },
        coords=coords,
        attrs=dict(attrs),
    )
    # CF 2.5.1: coordinate variables (and their bounds) carry no _FillValue.
    for name in (*coords, *bounds):
        ds[name].encoding["_FillValue"] = None
    for name in ("coef_name", "coef_units"):
        if name in ds:
            ds[name].encoding.update(dtype="S1", char_dim_name=f"{name}_strlen")
    enc = (cf.get("obs") or {}).get("encoding") or {}
    if enc and np.issubdtype(ds[obs_dim].dtype, np.datetime64):
        # The input's time encoding: units, calendar and dtype (bounds share it, CF 7.1).
        time_enc = {k: (np.dtype(v) if k == "dtype" else v) for k, v in enc.items()}
        ds[obs_dim].encoding.update(time_enc)
        obs_bounds = (cf.get("obs") or {}).get("bounds")
        if obs_bounds and obs_bounds["name"] in ds:
            ds[obs_bounds["name"]].encoding.update(time_enc)
    return ds


def _label_var(
    nc: netCDF4.Dataset, name: str, dim: str, labels: Sequence[str], long_name: str
) -> None:
    """A CF label variable ``name(dim, <name>_strlen)`` of chars."""
    raw = np.array([s.encode() for s in labels])
    strlen = f"{name}_strlen"
    nc.createDimension(strlen, max(1, raw.dtype.itemsize))
    var = nc.createVariable(name, "S1", (dim, strlen))
    var.long_name = long_name
    var.setncattr("_Encoding", "utf-8")  # how xarray and NCO read it back as text
    var[:] = netCDF4.stringtochar(raw.astype(f"S{max(1, raw.dtype.itemsize)}"))


def _keep_obs_units(nc: netCDF4.Dataset, load: Artifact) -> None:
    """The obs coordinate's units attribute spelt as in the input."""
    obs_dim = load.meta["obs_dim"]
    cf = (load.meta.get("coord_cf") or {}).get("obs") or {}
    units = (cf.get("encoding") or {}).get("units")
    var = nc.variables[obs_dim]
    if units and "units" in var.ncattrs() and _same_time_units(str(var.units), str(units)):
        # xarray normalises the reference date's spelling; keep the input's. (Only when it
        # is a respelling: values that did not fit the input's units were written in others.)
        var.units = units


def _same_time_units(a: str, b: str) -> bool:
    """Whether CF time units ``a`` and ``b`` name the same unit and reference instant."""
    import cftime

    try:
        same_unit = a.split()[0].lower().rstrip("s") == b.split()[0].lower().rstrip("s")
        return same_unit and bool(
            cftime.num2date(0, a, "proleptic_gregorian")
            == cftime.num2date(0, b, "proleptic_gregorian")
        )
    except (ValueError, IndexError):
        return False


def tile_data(arts: Mapping[str, Artifact], v: Mapping[str, Any]) -> np.ndarray:
    """One tile's data of output variable ``v`` (``arts``: that tile of each tiled input)."""
    if "from_tile" in v:
        made: np.ndarray = v["from_tile"](arts)
        return made
    kind, name = v["src"]
    data: np.ndarray = arts[kind].array(name)
    if "fn" in v:
        data = v["fn"](data)
    return data


def flat_labels(v: Mapping[str, Any], lead: tuple[int, ...]) -> list[str]:
    """``dim=i dim=j`` labels of each element of a flattened variable's leading dims."""
    return [
        " ".join(f"{d}={i}" for d, i in zip(v["flat_from"], ix, strict=True))
        for ix in np.ndindex(*lead)
    ]


def _define(
    nc: netCDF4.Dataset,
    v: Mapping[str, Any],
    first: np.ndarray,
    sizes: dict[str, int],
    config: NetCDFWrite,
    yx: tuple[str, str],
    lead_dims: Sequence[str] = (),
) -> None:
    """Create variable ``v`` (and its dims, index and label variables) from its first tile."""
    lead = first.shape[:-2]
    if "flat_from" in v:
        labels = flat_labels(v, lead)
        lead = (len(labels),)
    for d, n in zip(v["dims"][:-2], lead, strict=True):
        if sizes.setdefault(d, n) != n:
            raise ContractError(
                f"dim {d!r} would have two sizes in the output ({sizes[d]} and {n})",
                stage=STAGE,
                fix="rename the model's dims (gridsolve_dims) so they do not clash with the "
                "input's",
            )
        if d not in nc.dimensions:
            nc.createDimension(d, n)
    if "flat_from" in v:
        index = v["dims"][0]
        coord = nc.createVariable(index, "i4", (index,))
        coord.long_name = f"position in the flattened dims of {v['name']}"
        coord.units = "1"
        coord[:] = np.arange(lead[0], dtype=np.int32)
        what = f"{', '.join(v['flat_from'])} of each element of {v['name']}"
        _label_var(nc, f"{v['name']}_label", index, labels, what)
    dims = file_dims(v, lead_dims)
    shape = [sizes[d] for d in dims]
    var = nc.createVariable(  # type: ignore[call-overload]
        v["name"],
        first.dtype,
        dims,
        zlib=config.zlib and config.complevel > 0,
        complevel=config.complevel or 1,
        shuffle=config.shuffle,
        chunksizes=chunk_sizes(dims, shape, *yx, config),
        fill_value=np.nan if first.dtype.kind == "f" else None,
    )
    var.setncatts(v["attrs"])


def _block(
    data: np.ndarray, window: Mapping[str, Any], lead_dims: Sequence[str], yx: tuple[str, str]
) -> tuple[tuple[slice, ...], np.ndarray]:
    """Where one tile of a variable goes in the file (a slice per dim), and its data so shaped."""
    own = data.shape[:-2]  # the variable's own leading dims, whole
    index = [slice(0, n) for n in own]
    index += [slice(int(window[d]), int(window[d]) + 1) for d in lead_dims]
    index += [window[yx[0]], window[yx[1]]]
    shaped = data.reshape(*own, *([1] * len(lead_dims)), *data.shape[-2:])
    return tuple(index), shaped


def file_dims(v: Mapping[str, Any], lead_dims: Sequence[str]) -> tuple[str, ...]:
    """Dims of output variable ``v`` in the file: its own, the cube's batch dims, then y, x."""
    dims = tuple(v["dims"])
    return (*dims[:-2], *lead_dims, *dims[-2:])


def _write_failure(exc: OSError | RuntimeError, final: Path) -> OutputError:
    """The user error for a write that failed: no permission, no space, or another cause."""
    if isinstance(exc, PermissionError) or (
        isinstance(exc, OSError) and exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS)
    ):
        # before the free-space test: a folder one may not write (/proc) has none free
        return OutputError(
            f"writing {final} failed: not allowed to write there",
            stage=STAGE,
            found=f"{type(exc).__name__}: {exc}",
            fix="choose a write.path in a folder you may write to; "
            "nothing was written under the final name",
        )
    # HDF5 reports a full disk or a size limit as a generic "HDF error".
    space = isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT)
    if space or "HDF error" in str(exc) or _free_bytes(final.parent) < 2**20:
        return OutputError(
            f"writing {final} failed: no space left (disk full, quota or file size limit)",
            stage=STAGE,
            found=f"{type(exc).__name__}: {exc}",
            fix="free disk space or write to a larger disk; "
            "nothing was written under the final name",
        )
    return OutputError(
        f"writing {final} failed",
        stage=STAGE,
        found=f"{type(exc).__name__}: {exc}",
        fix="check write.path; nothing was written under the final name",
    )


def add_training(ds: xr.Dataset, train: Artifact, load: Artifact) -> None:
    """Add the loss per epoch, the gradient-norm map and the training's provenance."""
    n = len(train.array("train_loss"))
    ds.coords["epoch"] = (
        "epoch",
        np.arange(1, n + 1, dtype=np.int32),
        {"long_name": "training epoch", "units": "1"},
    )
    ds["epoch"].encoding["_FillValue"] = None
    for name, what in (("train_loss", "training"), ("val_loss", "validation")):
        ds[name] = (
            "epoch",
            np.asarray(train.array(name)),
            {
                "long_name": f"mean squared error of the model over the {what} pixels",
                "comment": f"mean over the {what} pixels of each pixel's mean squared error, "
                "with the weights at the end of the epoch, without clipping or noise",
            },
        )
    meta = load.meta
    lead, lead_shape = list(meta.get("lead_dims") or []), list(meta.get("lead_shape") or [])
    ds["grad_norm"] = (
        (*lead, meta["y_dim"], meta["x_dim"]),
        np.asarray(train.array("grad_norm")).reshape(*lead_shape, meta["ny"], meta["nx"]),
        {
            "long_name": "L2 norm of the per-pixel gradient of the training loss with respect "
            "to all model parameters, at the trained weights",
            "comment": "before clipping; NaN where the pixel was not used for training or "
            "validation. Large values mark the pixels that pull hardest on the weights.",
        },
    )
    meta = dict(train.meta)
    ds.attrs["gridsolve_train_epochs"] = int(meta["epochs_run"])
    ds.attrs["gridsolve_train_steps"] = int(meta["steps"])
    ds.attrs["gridsolve_train_pixels"] = json.dumps(meta["counts"], sort_keys=True)
    if meta.get("best_epoch") is not None:  # None: no validation pixels
        ds.attrs["gridsolve_train_best_epoch"] = int(meta["best_epoch"])
    ds.attrs["gridsolve_train_weights_epoch"] = int(meta["weights_epoch"])
    ds.attrs["gridsolve_train_weights_from"] = (
        "best validation epoch (early stopping restored it)"
        if meta["weights_from"] == "best"
        else "last epoch (no early stopping)"
    )
    if meta.get("epsilon") is not None:
        ds.attrs["gridsolve_train_epsilon"] = float(meta["epsilon"])
        ds.attrs["gridsolve_train_delta"] = float(meta["delta"])


def weights_path(output: Path) -> Path:
    """Where the trained weights go: beside the output, ``<output>.weights.safetensors``."""
    return output.with_name(f"{output.name}.weights.safetensors")


def write_weights(train: Artifact, output: Path) -> None:
    """The trained weights as safetensors beside the output (atomically)."""
    from safetensors.numpy import save_file

    tensors = {
        name.removeprefix("param:"): np.ascontiguousarray(arr)
        for name, arr in train.arrays().items()
        if name.startswith("param:")
    }
    with atomic_file(weights_path(output)) as tmp:
        save_file(tensors, str(tmp), metadata={MARK_KEY: MARK_VALUE})


def tile_plan(tiled: Mapping[str, TiledArtifact]) -> list[Any]:
    """The tile plan every tiled input shares; ContractError if they differ."""
    plans = [[tile for tile, _ in art.tiles] for art in tiled.values()]
    if any(p != plans[0] for p in plans):
        raise ContractError(
            "the tiled inputs of the writer were computed on different tile plans",
            stage=STAGE,
            fix="rerun: every tiled stage of one run uses the run's tile plan",
        )
    return plans[0]


def write_netcdf(
    config: NetCDFWrite,
    load: Artifact,
    design: Artifact,
    tiled: Mapping[str, TiledArtifact],
    attrs: Mapping[str, Any],
    train: Artifact | None = None,
    staged_locally: bool = False,
) -> Path:
    """Write the output file atomically and return its path.

    ``tiled`` holds every tiled input by kind (all on the same tile plan); each
    output variable is filled tile by tile, so memory stays at one tile.
    ``staged_locally``: the file is gridsolve's local copy of an output bound for
    a bucket (a fresh private folder): not checked against the allowed roots.
    """
    final = (
        Path(config.path) if staged_locally else check_output_path(config.path, config.overwrite)
    )
    sweep_dead_temporaries(final)
    variables = output_variables(load, design, tiled, config.layout)
    yx = (load.meta["y_dim"], load.meta["x_dim"])
    plan = tile_plan(tiled)
    try:
        with atomic_file(final) as tmp:
            base = skeleton(load, design, attrs)
            if train is not None:
                add_training(base, train, load)
            base.to_netcdf(tmp, engine="netcdf4", format="NETCDF4")
            with netCDF4.Dataset(tmp, "a") as nc:
                _keep_obs_units(nc, load)
                sizes = {yx[0]: int(load.meta["ny"]), yx[1]: int(load.meta["nx"])}
                sizes.update({d: len(dim) for d, dim in nc.dimensions.items()})
                first = {kind: art.tiles[0][1] for kind, art in tiled.items()}
                lead_dims = list(load.meta.get("lead_dims") or [])
                for v in variables:
                    _define(nc, v, tile_data(first, v), sizes, config, yx, lead_dims)
            # The data: compressed chunks on every core, written straight into the file.
            with ChunkWriter(tmp) as out:
                for i, tile in enumerate(plan):
                    arts = {kind: art.tiles[i][1] for kind, art in tiled.items()}
                    window = plane_window(load.meta, tile)
                    for v in variables:
                        data = tile_data(arts, v)
                        if "flat_from" in v:
                            data = data.reshape(-1, *data.shape[-2:])
                        out.write(v["name"], *_block(data, window, lead_dims, yx))
        if train is not None:
            write_weights(train, final)
    except GridsolveError:
        raise
    except (OSError, RuntimeError) as exc:
        raise _write_failure(exc, final) from exc
    return final


def run_attrs(
    config: NetCDFWrite | ZarrWrite, inputs: Mapping[str, Any], ctx: StageContext
) -> dict[str, str]:
    """The output's global attributes: provenance of this run (see :func:`provenance`)."""
    configs: dict[str, Any] = {}
    keys: dict[str, str] = {}
    for kind, art in inputs.items():
        made = art.prepared.info if isinstance(art, TiledArtifact) else art.info
        # Keys leave input file paths out (they cover the content); the file records
        # the paths this run read, which are part of this stage's key (records_sources).
        paths = (art.meta.get(SOURCE) or {}).get("paths", {})
        configs[kind] = {"impl": made["impl"], **made["config"], **paths}
        keys[kind] = art.key
    configs["write"] = config.key_payload()
    keys["write"] = ctx.key
    return provenance(
        configs,
        keys,
        inputs["load"].meta["content_hash"],
        history=inputs["load"].meta.get("history", ""),
    )


def run(config: NetCDFWrite, inputs: Mapping[str, Any], ctx: StageContext) -> StageOutput:
    """Write the output NetCDF; the stored artifact records its size and checksum."""
    attrs = run_attrs(config, inputs, ctx)
    tiled = {k: a for k, a in inputs.items() if isinstance(a, TiledArtifact)}
    if remote.is_url(config.path):
        return _run_to_url(config, inputs, tiled, attrs)
    path = write_netcdf(config, inputs["load"], inputs["design"], tiled, attrs, inputs.get("train"))
    meta: dict[str, Any] = file_facts(path)
    if "train" in inputs:
        meta["weights"] = file_facts(weights_path(path))
    return StageOutput(meta=meta)


def _run_to_url(
    config: NetCDFWrite,
    inputs: Mapping[str, Any],
    tiled: Mapping[str, TiledArtifact],
    attrs: Mapping[str, Any],
) -> StageOutput:
    """Write the output locally, upload it (and the weights) verified, then publish both.

    Both objects are uploaded to temporary keys and checked before either is
    copied into place, so a failed upload leaves the previous output (and
    weights) as they were.
    """
    options = config.storage_options
    url = check_output_url(config.path, config.overwrite, options)
    targets = [url] + ([f"{url}.weights.safetensors"] if "train" in inputs else [])
    staging = Path(tempfile.mkdtemp(prefix="write-", dir=staging_root()))
    local = staging / url.rsplit("/", 1)[-1]
    staged: list[str] = []
    published: list[str] = []
    try:
        path = write_netcdf(
            config.model_copy(update={"path": str(local)}),
            inputs["load"],
            inputs["design"],
            tiled,
            attrs,
            inputs.get("train"),
            staged_locally=True,
        )
        files = [path, weights_path(path)][: len(targets)]
        staged = [
            remote.stage_upload(f, t, options, what)
            for f, t, what in zip(files, targets, ("output file", "trained weights"), strict=False)
        ]
        for tmp, target in zip(staged, targets, strict=True):
            remote.publish(tmp, target, options, "output file")
            published.append(target)
        meta: dict[str, Any] = url_facts(url, options)
        if "train" in inputs:
            meta["weights"] = url_facts(targets[1], options)
    except BaseException:
        for done in published:  # a run that failed leaves no half-published output behind
            with contextlib.suppress(Exception):
                remote.remove(done, options)
        raise
    finally:
        for tmp in staged:
            with contextlib.suppress(Exception):
                remote.remove(tmp, options)
        shutil.rmtree(staging, ignore_errors=True)
    return StageOutput(meta=meta)


def staging_root() -> Path:
    """The local folder of the private folders that outputs for a bucket are written in."""
    root = remote.mirror_root() / "outputs"
    root.mkdir(parents=True, exist_ok=True)
    return root


def url_facts(url: str, options: Mapping[str, Any]) -> dict[str, Any]:
    """URL, size and ETag of an object the writer made, and how to reach it (no credentials)."""
    ident = remote.object_identity(url, options)
    return {"path": url, **ident, "storage_options": dict(options)}


def file_facts(path: Path) -> dict[str, Any]:
    """Path, size and xxh3 of a file the writer made (what ``still_valid`` checks)."""
    return {"path": str(path), "size": path.stat().st_size, "xxh3": file_digest(path)}


def _unchanged(facts: Mapping[str, Any]) -> bool:
    if remote.is_url(facts["path"]):
        try:
            now = remote.object_identity(facts["path"], facts.get("storage_options"))
        except Exception:  # gone, or unreachable: write it again
            return False
        return bool(now == {k: facts.get(k) for k in now})
    p = Path(facts["path"])
    try:
        return bool(p.stat().st_size == facts["size"] and file_digest(p) == facts["xxh3"])
    except OSError:
        return False


def still_valid(meta: Mapping[str, Any]) -> bool:
    """Whether the files a stored write artifact describes are still there, unchanged."""
    return _unchanged(meta) and ("weights" not in meta or _unchanged(meta["weights"]))


def history_line(config_json: Mapping[str, Any]) -> str:
    """The run's CF history line: gridsolve's version, the stages run, the config's hash.

    No time and no command line: the same input and config give the same bytes.
    """
    version = package_versions().get("gridsolve", "unknown")
    chain = " -> ".join(f"{kind}/{cfg.get('impl', '?')}" for kind, cfg in config_json.items())
    digest = hash_text(canonical_json(dict(config_json)))
    return f"gridsolve {version}: gridsolve run {chain} (config xxh3 {digest})"


def provenance(
    config_json: Mapping[str, Any],
    keys: Mapping[str, str],
    input_hash: str,
    history: str = "",
) -> dict[str, str]:
    """Global attributes that let anyone trace and reproduce a file.

    ``history`` is the input's; this run's line is appended to it (CF 2.6.2).
    """
    line = history_line(config_json)
    return {
        "Conventions": CONVENTIONS,
        "history": f"{history.rstrip()}\n{line}" if history.strip() else line,
        "title": "gridsolve per-pixel least squares"
        + (" and per-sample model gradients" if "model" in config_json else ""),
        "source": "gridsolve",
        "gridsolve_config": json.dumps(config_json, sort_keys=True),
        "gridsolve_keys": json.dumps(dict(keys), sort_keys=True),
        "gridsolve_input_hash": input_hash,
        "gridsolve_versions": json.dumps(package_versions(), sort_keys=True),
    }


register(
    StageDecl(
        kind="write",
        impl="netcdf",
        version=VERSION,
        config=NetCDFWrite,
        run=run,
        inputs=("load", "design", "normal_equations", "solve"),
        optional_inputs=("model", "train"),
        verify=still_valid,
        records_sources=True,
        alignment=lambda cfg, grid: chunk_alignment(cfg, grid["y_dim"], grid["x_dim"]),
        summary="one NetCDF file, atomically",
    )
)
