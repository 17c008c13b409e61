"""The ``write`` stage: one NetCDF file with the output contract, written atomically.

Coordinates and the design matrix are written first with xarray (which knows
how to encode datetimes and strings); the large variables are then created
with netCDF4 and filled tile by tile, so memory stays at one tile. Everything
goes to a temporary file beside the target, renamed over it only when complete:
a crash or an error never leaves a half file under the final name.

The file's content is a pure function of the input content and the config (no
timestamps), so reruns give bit-identical files; run-specific facts (flow run,
timings) go to the Prefect artifacts instead.
"""

from __future__ import annotations

import errno
import json
import os
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import netCDF4
import numpy as np
import xarray as xr

from gridsolve.schemas.config import NetCDFWrite
from gridsolve.schemas.contracts import MODEL_STATUS_FLAGS, STATUS_FLAGS
from gridsolve.schemas.errors import ContractError, GridsolveError, OutputError
from gridsolve.stages.engine.context import StageContext
from gridsolve.stages.engine.hashing import file_digest
from gridsolve.stages.engine.paths import ensure_allowed, owner_is_dead, writer_tag
from gridsolve.stages.engine.registry import SOURCE, StageDecl, register
from gridsolve.stages.engine.store import Artifact, StageOutput, TiledArtifact
from gridsolve.stages.engine.versions import package_versions

VERSION = "1"
STAGE = "write/netcdf"
DEFAULT_CHUNK_Y = 128
DEFAULT_CHUNK_X = 256


def _free_bytes(folder: Path) -> int:
    try:
        st = os.statvfs(folder)
    except OSError:
        return 2**62
    return st.f_bavail * st.f_frsize


def _sweep_dead_temporaries(final: Path) -> None:
    """Remove temporary files that killed writers left beside ``final``."""
    for tmp in final.parent.glob(f".{final.name}.gridsolve~*.tmp"):
        tag = tmp.name.split("~", 1)[1].rsplit("~", 1)[0]
        if owner_is_dead(tag):
            tmp.unlink(missing_ok=True)


def check_output_path(path: str, overwrite: bool) -> Path:
    """The output path, its folder created if missing; OutputError if it cannot be written."""
    p = ensure_allowed(path, "output file", STAGE)
    parent = p.parent
    if parent.exists() and not parent.is_dir():
        raise OutputError(f"output folder {parent} is a file", stage=STAGE, fix="fix write.path")
    try:
        parent.mkdir(
            parents=True, exist_ok=True
        )  # like mkdir -p: nightly runs write into new folders
    except OSError as exc:
        raise OutputError(
            f"cannot create the output folder {parent}: {exc.strerror or exc}",
            stage=STAGE,
            fix="set write.path to a writable location, or create the folder first",
        ) from exc
    if not os.access(parent, os.W_OK | os.X_OK):
        raise OutputError(
            f"output folder {parent} is not writable",
            stage=STAGE,
            fix="set write.path to a writable folder, or fix its permissions",
        )
    if p.is_dir():
        raise OutputError(
            f"output path {p} is a folder", stage=STAGE, fix="set write.path to a file name"
        )
    if p.exists() and not overwrite:
        raise OutputError(
            f"output file {p} exists and write.overwrite is false",
            stage=STAGE,
            fix="remove it, set write.overwrite: true, or template write.path with {flow_run_name}",
        )
    return p


def _chunks(
    dims: Sequence[str], shape: Sequence[int], y_dim: str, x_dim: str, cfg: NetCDFWrite
) -> list[int]:
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


def chunk_alignment(cfg: NetCDFWrite, y_dim: str, x_dim: str) -> tuple[int, int]:
    """Rows and columns of one output chunk: tiles align to them so chunks are written once."""
    chunks = cfg.chunks or {}
    return chunks.get(y_dim, DEFAULT_CHUNK_Y), chunks.get(x_dim, DEFAULT_CHUNK_X)


def _variables(load: Artifact, solve: TiledArtifact, model: TiledArtifact) -> list[dict[str, Any]]:
    """Name, source array, dims and attrs of every tiled output variable."""
    y, x = load.meta["y_dim"], load.meta["x_dim"]
    units = load.meta["attrs"].get("units")
    m = model.meta
    obj = "sum of outputs" if m["objective"] == "sum" else "mean squared error against the target"
    flags = sorted(STATUS_FLAGS)
    model_flags = sorted(MODEL_STATUS_FLAGS)
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
    first_model_tile = model.tiles[0][1] if model.tiles else None
    return [
        v
        for v in out
        if v["src"][0] == "solve"
        or (first_model_tile is not None and v["src"][1] in first_model_tile)
    ]


def _skeleton(load: Artifact, design: Artifact, attrs: Mapping[str, Any]) -> xr.Dataset:
    meta = load.meta
    obs_dim, y, x = meta["obs_dim"], meta["y_dim"], meta["x_dim"]
    ca = meta["coord_attrs"]
    cols = design.meta["columns"]
    coords = {
        obs_dim: (obs_dim, np.asarray(load.array("obs")), ca["obs"]),
        y: (y, np.asarray(load.array("y")), ca["y"]),
        x: (x, np.asarray(load.array("x")), ca["x"]),
        "coef": ("coef", np.array(cols, dtype=str), {"long_name": "design column"}),
    }
    design_attrs = {
        "long_name": "design matrix used for the fit",
        "basis": design.meta.get("basis", ""),
        "condition_number": float(design.meta["cond"]),
        "rank": int(design.meta["rank"]),
    }
    for k in ("t_centre", "t_scale", "t_units", "period"):
        if k in design.meta:
            design_attrs[k] = design.meta[k]
    ds = xr.Dataset(
        {"design": ((obs_dim, "coef"), np.asarray(design.array("A")), design_attrs)},
        coords=coords,
        attrs=dict(attrs),
    )
    return ds


def write_netcdf(
    config: NetCDFWrite,
    load: Artifact,
    design: Artifact,
    solve: TiledArtifact,
    model: TiledArtifact,
    attrs: Mapping[str, Any],
    ctx: StageContext,
) -> Path:
    """Write the output file atomically and return its path."""
    final = check_output_path(config.path, config.overwrite)
    _sweep_dead_temporaries(final)
    tmp = final.with_name(f".{final.name}.gridsolve~{writer_tag()}~{uuid.uuid4().hex[:12]}.tmp")
    y_dim, x_dim = load.meta["y_dim"], load.meta["x_dim"]
    ny, nx = int(load.meta["ny"]), int(load.meta["nx"])
    variables = _variables(load, solve, model)
    try:
        _skeleton(load, design, attrs).to_netcdf(tmp, engine="netcdf4", format="NETCDF4")
        with netCDF4.Dataset(tmp, "a") as nc:
            sizes = {y_dim: ny, x_dim: nx, **{d: len(v) for d, v in nc.dimensions.items()}}
            first = {"solve": solve.tiles[0][1], "model": model.tiles[0][1]}
            for v in variables:
                arr = first[v["src"][0]].array(v["src"][1])
                for d, n in zip(v["dims"][:-2], arr.shape[:-2], strict=True):
                    if sizes.setdefault(d, n) != n:
                        raise ContractError(
                            f"dim {d!r} would have two sizes in the output ({sizes[d]} and {n})",
                            stage=STAGE,
                            fix="rename the model's dims (gridsolve_dims) so they do not "
                            "clash with the input's",
                        )
                    if d not in nc.dimensions:
                        nc.createDimension(d, n)
                shape = [sizes[d] for d in v["dims"]]
                fill = np.nan if arr.dtype.kind == "f" else None
                var = nc.createVariable(  # type: ignore[call-overload]
                    v["name"],
                    arr.dtype,
                    v["dims"],
                    zlib=config.zlib and config.complevel > 0,
                    complevel=config.complevel or 1,
                    shuffle=config.shuffle,
                    chunksizes=_chunks(v["dims"], shape, y_dim, x_dim, config),
                    fill_value=fill,
                )
                var.setncatts(v["attrs"])
            for (tile, s_art), (_, m_art) in zip(solve.tiles, model.tiles, strict=True):
                arts = {"solve": s_art, "model": m_art}
                ys, xs = slice(tile.y0, tile.y1), slice(tile.x0, tile.x1)
                for v in variables:
                    data = arts[v["src"][0]].array(v["src"][1])
                    nc.variables[v["name"]][(..., ys, xs)] = data
        os.replace(tmp, final)
    except GridsolveError:
        raise
    except (OSError, RuntimeError) as exc:
        # HDF5 reports a full disk or a size limit as a generic "HDF error".
        space = isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT)
        if space or "HDF error" in str(exc) or _free_bytes(final.parent) < 2**20:
            raise OutputError(
                f"writing {final} failed: no space left (disk full, quota or file size limit)",
                stage=STAGE,
                found=f"{type(exc).__name__}: {exc}",
                fix="free disk space or write to a larger disk; "
                "nothing was written under the final name",
            ) from exc
        raise OutputError(
            f"writing {final} failed",
            stage=STAGE,
            found=f"{type(exc).__name__}: {exc}",
            fix="check write.path; nothing was written under the final name",
        ) from exc
    finally:
        if tmp.exists():
            tmp.unlink()
    return final


def run(config: NetCDFWrite, inputs: Mapping[str, Any], ctx: StageContext) -> StageOutput:
    """Write the output NetCDF; the stored artifact records its size and checksum."""
    configs: dict[str, Any] = {}
    keys: dict[str, str] = {}
    for kind in ("load", "design", "normal_equations", "solve", "model"):
        art = inputs[kind]
        made = art.prepared.info if isinstance(art, TiledArtifact) else art.info
        # Keys leave input file paths out (they cover the content); the file records
        # the paths this run read, which are part of this stage's key (records_sources).
        paths = (art.meta.get(SOURCE) or {}).get("paths", {})
        configs[kind] = {"impl": made["impl"], **made["config"], **paths}
        keys[kind] = art.key
    configs["write"] = config.key_payload()
    keys["write"] = ctx.key
    attrs = provenance(configs, keys, inputs["load"].meta["content_hash"])
    path = write_netcdf(
        config, inputs["load"], inputs["design"], inputs["solve"], inputs["model"], attrs, ctx
    )
    return StageOutput(
        meta={"path": str(path), "size": path.stat().st_size, "xxh3": file_digest(path)}
    )


def still_valid(meta: Mapping[str, Any]) -> bool:
    """Whether the file a stored write artifact describes is still there, unchanged."""
    p = Path(meta["path"])
    try:
        return bool(p.stat().st_size == meta["size"] and file_digest(p) == meta["xxh3"])
    except OSError:
        return False


def provenance(
    config_json: Mapping[str, Any], keys: Mapping[str, str], input_hash: str
) -> dict[str, str]:
    """Global attributes that let anyone trace and reproduce a file."""
    return {
        "Conventions": "CF-1.10",
        "title": "gridsolve per-pixel least squares and per-sample model gradients",
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
        inputs=("load", "design", "normal_equations", "solve", "model"),
        verify=still_valid,
        records_sources=True,
        summary="one NetCDF file, atomically",
    )
)
