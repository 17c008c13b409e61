"""The cube contract: which variable is the cube, its dims, and how helper variables fit it.

Helper variables are the design, the weights and the target the config names;
each violation is collected and reported together in one ContractError.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import xarray as xr

from gridsolve.schemas.contracts import numeric_kind
from gridsolve.schemas.errors import ContractError
from gridsolve.schemas.kinds.load import NetCDFLoad
from gridsolve.schemas.pipeline import suggest
from gridsolve.stages.load.base import STAGE
from gridsolve.stages.load.dims import cf_roles, infer_dims


@dataclass(frozen=True)
class _Cube:
    """The cube variable and which of its dims are obs, y and x."""

    name: str
    da: xr.DataArray
    dims: tuple[str, ...]
    obs_dim: str
    y_dim: str
    x_dim: str
    #: the batch dims other than y and x (member, level, …), in the variable's order
    lead: tuple[str, ...] = ()


def _cube_name(config: NetCDFLoad, ds: xr.Dataset) -> str:
    """The cube's variable name: load.variable, else the file's one numeric variable of ≥ 3 dims."""
    if config.variable is not None:
        return config.variable
    names = [str(n) for n in ds.data_vars]
    cubes = [n for n in names if ds[n].ndim >= 3 and numeric_kind(ds[n].dtype)]
    if len(cubes) != 1 and len(names) == 1:
        cubes = names  # the only variable: its own checks say what is wrong with it
    if len(cubes) != 1:
        raise ContractError(
            "cannot tell which variable is the cube",
            stage=STAGE,
            expected="exactly one numeric data variable with ≥ 3 dims, or load.variable set",
            found=f"numeric variables with ≥ 3 dims {cubes}; all variables {names}",
            fix="set load.variable to the cube's name",
        )
    return cubes[0]


def _check_names(config: NetCDFLoad, ds: xr.Dataset, var: str) -> None:
    """Raise a ContractError if a variable the config names (cube ``var`` included) is missing."""
    names = [str(n) for n in ds.data_vars]
    problems = [
        f"{field}: variable {name!r} is not in the file "
        f"(variables: {', '.join(names)}).{suggest(name, names)}"
        for field, name in (
            ("load.variable", var),
            ("load.design", config.design),
            ("load.weights", config.weights),
            ("load.target", config.target),
        )
        if name is not None and name not in ds.variables
    ]
    if problems:
        raise ContractError(
            "variables named in the config are missing",
            stage=STAGE,
            violations=problems,
            fix="correct the names in the load section",
        )


def _cube(config: NetCDFLoad, ds: xr.Dataset, var: str) -> _Cube:
    """Cube ``var`` and its (obs, y, x) dims; ContractError if it breaks the cube contract."""
    _check_names(config, ds, var)
    da = ds[var]
    if da.ndim < 3:
        raise ContractError(
            f"variable {var!r} must have at least 3 dims (obs, y, x)",
            stage=STAGE,
            found=f"{da.ndim} dims {list(da.dims)} with shape {da.shape}"
            + (" after load.isel / load.select" if config.isel or config.select else ""),
            fix="select a variable with dims (obs, …, y, x); a one-element list in "
            "load.select / load.isel keeps a dim",
        )
    dims = tuple(str(d) for d in da.dims)
    sizes = {str(d): int(n) for d, n in da.sizes.items()}
    obs_dim, y_dim, x_dim, problems = infer_dims(
        dims, config.obs_dim, config.y_dim, config.x_dim, cf_roles(da), sizes
    )
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
            expected="a numeric variable with dims (obs, …, y, x), each of size ≥ 1",
            fix="set load.variable / load.obs_dim / load.y_dim / load.x_dim",
        )
    lead = tuple(d for d in dims if d not in (obs_dim, y_dim, x_dim))
    return _Cube(var, da, dims, obs_dim, y_dim, x_dim, lead)


def _design_info(d: xr.DataArray, name: str, cube: _Cube) -> tuple[dict[str, Any], list[str]]:
    """The design's aux entry, and how its dims fail to fit the cube."""
    obs_dim, n_obs = cube.obs_dim, cube.da.sizes[cube.obs_dim]
    problems: list[str] = []
    if d.ndim != 2:
        problems.append(f"design {name!r}: expected 2 dims ({obs_dim}, coef), found {list(d.dims)}")
    elif obs_dim not in d.dims:
        rows = ", ".join(f"{k}={v}" for k, v in d.sizes.items())
        problems.append(
            f"design {name!r}: expected dims ({obs_dim}, coef) with {n_obs} rows "
            f"(one per observation), found ({rows})"
        )
    elif d.sizes[obs_dim] != n_obs:
        problems.append(
            f"design {name!r}: has {d.sizes[obs_dim]} rows along {obs_dim!r}, "
            f"the cube has {n_obs} observations"
        )
    return {"name": name, "dims": [str(x) for x in d.dims]}, problems


def _weights_info(w: xr.DataArray, name: str, cube: _Cube) -> tuple[dict[str, Any], list[str]]:
    """The weights' aux entry (shared: one weight per observation), and how they misfit."""
    obs_dim, da = cube.obs_dim, cube.da
    problems: list[str] = []
    wd = tuple(str(x) for x in w.dims)
    shared = wd == (obs_dim,)
    if not shared and set(wd) != set(cube.dims):
        problems.append(
            f"weights {name!r}: expected dims ({obs_dim},) or the cube's "
            f"({', '.join(cube.dims)}), found {list(wd)}"
        )
    for dname in wd:
        if dname in da.sizes and w.sizes[dname] != da.sizes[dname]:
            problems.append(
                f"weights {name!r}: dim {dname!r} has size {w.sizes[dname]}, "
                f"the cube has {da.sizes[dname]}"
            )
    return {"name": name, "dims": list(wd), "shared": shared}, problems


def _target_info(t: xr.DataArray, name: str, cube: _Cube) -> tuple[dict[str, Any], list[str]]:
    """The target's aux entry (its output dim and count), and how its dims misfit.

    Besides y and x the target may have any of the cube's batch dims (a dim it
    lacks is shared along it) and one output dim of its own.
    """
    y_dim, x_dim, da = cube.y_dim, cube.x_dim, cube.da
    problems: list[str] = []
    td = tuple(str(x) for x in t.dims)
    out_dims = [d for d in td if d not in (y_dim, x_dim, *cube.lead)]
    if not {y_dim, x_dim} <= set(td) or len(out_dims) > 1 or cube.obs_dim in td:
        problems.append(
            f"target {name!r}: expected dims ({y_dim}, {x_dim}) or "
            f"(output, {y_dim}, {x_dim}), optionally with the cube's "
            f"{list(cube.lead) or 'batch dims'}, found {list(td)}"
        )
    else:
        for dname in (y_dim, x_dim, *cube.lead):
            if dname in t.sizes and t.sizes[dname] != da.sizes[dname]:
                problems.append(
                    f"target {name!r}: dim {dname!r} has size {t.sizes[dname]}, "
                    f"the cube has {da.sizes[dname]}"
                )
    info = {
        "name": name,
        "dims": list(td),
        "out_dim": out_dims[0] if out_dims else None,
        "n_out": int(t.sizes[out_dims[0]]) if out_dims else 1,
    }
    return info, problems


def _aux_info(config: NetCDFLoad, ds: xr.Dataset, cube: _Cube) -> dict[str, dict[str, Any]]:
    """Role → description of each helper variable; ContractError if one does not fit the cube."""
    aux: dict[str, dict[str, Any]] = {}
    problems: list[str] = []
    for role, name, describe in (
        ("design", config.design, _design_info),
        ("weights", config.weights, _weights_info),
        ("target", config.target, _target_info),
    ):
        if name is not None:
            aux[role], found = describe(ds[name], name, cube)
            problems += found
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
    return aux
