"""What an output holds, whatever its format: the variables, the skeleton, the provenance.

Both writers (NetCDF and Zarr) write what this module describes: the tiled
variables as their kinds declare them (:func:`output_variables`), the
coordinates, coef labels and design matrix (:func:`skeleton`), what whole kinds
add (:func:`extensions`: the training's curves and weights), the provenance
attributes, and how variables are chunked. It knows no
kind's arrays by name.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from gridsolve.schemas.errors import ContractError
from gridsolve.schemas.kinds.write import NetCDFWrite, ZarrWrite
from gridsolve.schemas.metadata import DesignMeta, Labelled, LoadMeta
from gridsolve.stages.engine import registry
from gridsolve.stages.engine.context import StageContext
from gridsolve.stages.engine.contract import contract_of
from gridsolve.stages.engine.hashing import canonical_json, hash_text
from gridsolve.stages.engine.outputs import (
    GRID_ROLES,
    Extension,
    OutputContext,
    OutputVariable,
    coefficient_units,
    contract_variables,
)
from gridsolve.stages.engine.registry import SOURCE
from gridsolve.stages.engine.store import Artifact, TiledArtifact
from gridsolve.stages.engine.versions import package_versions

if TYPE_CHECKING:  # imported to build the output: a run whose write hits needs none
    import xarray as xr

DEFAULT_CHUNK_Y = 128


DEFAULT_CHUNK_X = 256


#: CF version the file follows (and the checkers know).
CONVENTIONS = "CF-1.8"


#: The output variable holding the design matrix (obs, coef) of the fit.
DESIGN_VARIABLE = "design"


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


def output_variables(
    load: Artifact,
    design: Artifact | None,
    tiled: Mapping[str, TiledArtifact],
    layout: str = "nested",
) -> list[OutputVariable]:
    """Every tiled output variable, as the tiled kinds describe them, dims named as in the input.

    Each kind's contract describes its variables (``KindContract.variables``), an
    implementation those of the arrays it adds (``StageDecl.variables``);
    those whose array the run did not make are left out, and arrays no variable
    describes come from the kind's contract. ``layout: flat`` folds each
    variable's leading dims into one (what CDO and Panoply read).
    """
    grid = LoadMeta.of(load)
    y, x = grid.y_dim, grid.x_dim
    described: list[OutputVariable] = []
    for kind, art in tiled.items():
        ctx = OutputContext(load, design, art)
        contract = contract_of(kind)
        if contract is not None and contract.variables is not None:
            described += contract.variables(ctx)
        decl = registry.get(kind, art.prepared.info["impl"])
        if decl.variables is not None:  # what this implementation adds to its kind's
            described += decl.variables(ctx)
    # copies: the dims and attributes are rewritten below, the kinds' objects stay theirs
    kept = [dataclasses.replace(v, attrs=dict(v.attrs)) for v in described if v.made(tiled)]
    kept += contract_variables(tiled, described)
    labels = " ".join(_coef_labels(coefficient_units(load, design)))
    dims_named = dim_labels(tiled)
    # the input's scalar and 2-D grid coordinates apply to every variable on the grid
    carried = [*grid.grid_coords, *grid.scalar_coords]
    for v in kept:
        if v.dims[-2:] != GRID_ROLES:
            raise ContractError(
                f"output variable {v.name!r} has dims {v.dims}, not ending in the grid's y, x",
                stage="write",
                fix="declare the variable's dims with 'y', 'x' last",
            )
        v.dims = (*v.dims[:-2], y, x)
        named = [labels] if "coef" in v.dims else []
        named += [f"{d}_name" for d in v.dims if d in dims_named]
        if layout == "flat" and len(v.dims) > 3:
            v.flat_from = v.dims[:-2]
            v.dims = (f"{v.name}_index", y, x)
            named = [f"{v.name}_label"]
        if named or carried:
            v.attrs["coordinates"] = " ".join([*named, *carried])
    return kept


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
    meta = DesignMeta.of(design)
    design_attrs: dict[str, Any] = {
        "long_name": "design matrix used for the fit",
        "basis": meta.basis,
        "condition_number": meta.cond,
        "rank": meta.rank,
    }
    col_units = meta.column_units or []
    if col_units and len(set(col_units)) == 1 and col_units[0] is not None:
        design_attrs["units"] = col_units[0]
    for k in ("t_centre", "t_scale", "t_units", "period"):
        if k in meta.model_fields_set:  # the key was given, as the old "k in meta" test
            design_attrs[k] = getattr(meta, k)
    if "t_centre" in meta.model_fields_set:
        design_attrs["comment"] = (
            "columns are functions of t = (v - t_centre) / t_scale, v the obs coordinate "
            "in t_units; a coefficient per unit of v is the coefficient / t_scale**power"
        )
    return design_attrs


def dim_labels(tiled: Mapping[str, TiledArtifact]) -> dict[str, list[str]]:
    """Names along the dims tiled stages label themselves (curvefit's ``param``).

    From each stage's prepared metadata (``dim_labels``: dim → one name per index).
    """
    out: dict[str, list[str]] = {}
    for art in tiled.values():
        out.update(Labelled.of(art.prepared).dim_labels)
    return out


def skeleton(
    load: Artifact,
    design: Artifact | None,
    attrs: Mapping[str, Any],
    labels: Mapping[str, Sequence[str]] | None = None,
) -> xr.Dataset:
    """Coordinates, bounds, coef labels and the design matrix, encoded as CF wants them.

    A run without a design (``solve: curvefit``) has no coef labels and no design
    matrix. ``labels``: names along dims the stages label (:func:`dim_labels`),
    written as an index coordinate and a ``<dim>_name`` one.
    """
    import xarray as xr

    meta = LoadMeta.of(load)
    obs_dim, y, x = meta.obs_dim, meta.y_dim, meta.x_dim
    cf = meta.coord_cf
    coords: dict[str, Any] = {}
    bounds: dict[str, Any] = {}
    roles = [("obs", obs_dim), ("y", y), ("x", x)]
    roles += [(f"lead:{d}", d) for d in meta.lead_dims]
    for role, dim in roles:
        info = cf.get(role) or {"attrs": meta.coord_attrs[role]}
        coords[dim] = (dim, np.asarray(load.array(role)), _coord_attrs(info))
        if info.get("bounds") and f"{role}_bounds" in load:
            b = info["bounds"]
            bounds[b["name"]] = (tuple(b["dims"]), np.asarray(load.array(f"{role}_bounds")))
    for name, info in meta.scalar_coords.items():
        kind = info["kind"]
        if kind == "datetime":
            value = np.array(np.datetime64(info["value"], "ns"))
        else:
            value = np.array(info["value"], dtype=None if kind == "str" else np.dtype(kind))
        coords[name] = ((), value, dict(info["attrs"]))
    for name, info in meta.grid_coords.items():
        coords[name] = ((y, x), np.asarray(load.array(f"aux:{name}")), dict(info["attrs"]))
    for dim, names in (labels or {}).items():
        coords[dim] = (dim, np.arange(len(names), dtype=np.int32), {"long_name": dim, "units": "1"})
        coords[f"{dim}_name"] = (dim, np.array(names, dtype=str), {"long_name": f"{dim} name"})
    variables: dict[str, Any] = {}
    if design is not None:  # the design first: files keep the variable order they had
        variables[DESIGN_VARIABLE] = _design_coords(load, design, coords)
    variables.update({name: (dims, values, {}) for name, (dims, values) in bounds.items()})
    ds = xr.Dataset(variables, coords=coords, attrs=dict(attrs))
    # CF 2.5.1: coordinate variables (and their bounds) carry no _FillValue.
    for name in (*coords, *bounds):
        ds[name].encoding["_FillValue"] = None
    for name in ("coef_name", "coef_units", *(f"{d}_name" for d in labels or {})):
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


def _design_coords(
    load: Artifact, design: Artifact, coords: dict[str, Any]
) -> tuple[tuple[str, str], np.ndarray, dict[str, Any]]:
    """Add the coef (and harmonic) coordinates to ``coords``; the design matrix variable."""
    cols = DesignMeta.of(design).columns
    coords["coef"] = (
        "coef",
        np.arange(len(cols), dtype=np.int32),
        {"long_name": "design column", "units": "1"},
    )
    coords["coef_name"] = ("coef", np.array(cols, dtype=str), {"long_name": "design column name"})
    n_harmonics = len(DesignMeta.of(design).harmonics)
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
            {"long_name": "units of each design column's coefficient", "comment": "empty: unknown"},
        )
    obs_dim = LoadMeta.of(load).obs_dim
    return (obs_dim, "coef"), np.asarray(design.array("A")), _design_attrs(design)


def flat_labels(v: OutputVariable, lead: tuple[int, ...]) -> list[str]:
    """``dim=i dim=j`` labels of each element of a flattened variable's leading dims."""
    return [
        " ".join(f"{d}={i}" for d, i in zip(v.flat_from or (), ix, strict=True))
        for ix in np.ndindex(*lead)
    ]


def file_dims(v: OutputVariable, lead_dims: Sequence[str]) -> tuple[str, ...]:
    """Dims of output variable ``v`` in the file: its own, the cube's batch dims, then y, x."""
    dims = v.dims
    return (*dims[:-2], *lead_dims, *dims[-2:])


def tile_plan(tiled: Mapping[str, TiledArtifact]) -> list[Any]:
    """The tile plan every tiled input shares; ContractError if they differ."""
    plans = [[tile for tile, _ in art.tiles] for art in tiled.values()]
    if any(p != plans[0] for p in plans):
        raise ContractError(
            "the tiled inputs of the writer were computed on different tile plans",
            stage="write",
            fix="rerun: every tiled stage of one run uses the run's tile plan",
        )
    return plans[0]


def extensions(inputs: Mapping[str, Any]) -> list[Extension]:
    """What the run's whole (untiled) input kinds add to the output (``KindContract.extends``)."""
    out = []
    for kind, art in inputs.items():
        contract = contract_of(kind)
        if isinstance(art, Artifact) and contract is not None and contract.extends is not None:
            out.append(contract.extends(art, inputs["load"]))
    return out


def side_files(extras: Sequence[Extension]) -> dict[str, Callable[[Path], None]]:
    """Suffix → writer of every file the extensions put beside the output."""
    return {suffix: write for e in extras for suffix, write in e.side_files.items()}


def write_side_files(extras: Sequence[Extension], output: Path) -> None:
    """Write every file the extensions put beside ``output`` (``<output><suffix>``)."""
    for suffix, write in side_files(extras).items():
        write(Path(f"{output}{suffix}"))


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
        source = art.meta.get(SOURCE) or {}
        configs[kind] = {"impl": made["impl"], **made["config"], **source.get("paths", {})}
        keys[kind] = art.key
        if kind == "load":
            configs[kind].update(resolved_input(LoadMeta.of(art), source))
    configs["write"] = config.key_payload()
    keys["write"] = ctx.key
    load = LoadMeta.of(inputs["load"])
    return provenance(configs, keys, load.content_hash, history=load.history)


#: Up to this many matched files are listed by name in the provenance; more by digest.
LISTED_FILES = 100


def resolved_input(meta: LoadMeta, source: Mapping[str, Any]) -> dict[str, Any]:
    """What a load config resolved to this run: the dims it used, the files a glob matched.

    A config may leave the dims to CF metadata and name files by a glob; the output
    says which dims and files were read (a long list as a count and a digest of the
    sorted names).
    """
    dims = {"obs": meta.obs_dim, "y": meta.y_dim, "x": meta.x_dim}
    out: dict[str, Any] = {"resolved_dims": {role: d for role, d in dims.items() if d}}
    if meta.lead_dims:
        out["resolved_dims"]["batch"] = list(meta.lead_dims)
    files = sorted(str(f) for f in (source.get("files") or {}))
    if len(files) > LISTED_FILES:
        out["matched_files"] = {"count": len(files), "xxh3": hash_text("\n".join(files))}
    elif files:
        out["matched_files"] = files
    return out


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
