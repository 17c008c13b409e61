"""Which dims of the cube are obs, y and x, never guessed from their positions.

From the config, then the CF attributes of the dims' coordinate variables
(``axis``, ``standard_name``, time or degree units), then conventional names,
then by elimination (:func:`infer_dims`).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import xarray as xr

from gridsolve.schemas.pipeline import suggest
from gridsolve.stages.load.timeaxis import is_cftime

Y_NAMES = ("y", "lat", "latitude", "row", "rows", "northing", "south_north", "nlat", "j")


OBS_NAMES = ("time", "t", "obs", "date", "band", "wavelength", "frequency", "sample", "step")


X_NAMES = ("x", "lon", "longitude", "col", "cols", "column", "easting", "west_east", "nlon", "i")


#: CF ``axis`` values and ``standard_name``s of coordinate variables, and the role they give
#: their dim (CF 4.1–4.4; ``Z`` is a vertical axis: a batch dim, never obs or the map).
_CF_AXES = {"T": "obs", "Y": "y", "X": "x", "Z": "z"}


_CF_NAMES = {
    "time": "obs",
    "latitude": "y",
    "grid_latitude": "y",
    "projection_y_coordinate": "y",
    "longitude": "x",
    "grid_longitude": "x",
    "projection_x_coordinate": "x",
}


#: The units CF 4.1 and 4.2 accept for latitude and longitude (lowercased).
_LAT_UNITS = frozenset(
    ("degrees_north", "degree_north", "degree_n", "degrees_n", "degreen", "degreesn")
)


_LON_UNITS = frozenset(
    ("degrees_east", "degree_east", "degree_e", "degrees_e", "degreee", "degreese")
)


def _cf_role(c: xr.DataArray) -> str | None:
    """The role ("obs", "y", "x", "z") a coordinate variable's CF attributes give its dim."""
    axis = str(c.attrs.get("axis", "")).strip().upper()
    if axis in _CF_AXES:
        return _CF_AXES[axis]
    standard = str(c.attrs.get("standard_name", "")).strip().lower()
    if standard in _CF_NAMES:
        return _CF_NAMES[standard]
    # Decoded times keep their units in the encoding; undecoded ones in the attributes.
    units = str(c.attrs.get("units", c.encoding.get("units", ""))).strip().lower()
    if c.dtype.kind == "M" or " since " in f" {units} " or is_cftime(np.asarray(c.values[:1])):
        return "obs"
    if units in _LAT_UNITS:
        return "y"
    if units in _LON_UNITS:
        return "x"
    return None


def cf_roles(da: xr.DataArray) -> dict[str, str]:
    """Dim → role ("obs", "y", "x", "z") from the CF attributes of each dim's coordinate variable.

    Dims without a coordinate variable, or whose attributes say nothing, are left out.
    """
    roles: dict[str, str] = {}
    for dim in da.dims:
        if dim in da.coords and (role := _cf_role(da.coords[dim])) is not None:
            roles[str(dim)] = role
    return roles


def _pick(names: tuple[str, ...], dims: list[str]) -> str | None:
    lowered = {d.lower(): d for d in dims}
    for n in names:
        if n in lowered:
            return lowered[n]
    return None


def _shape_text(dims: tuple[str, ...], sizes: Mapping[str, int] | None) -> str:
    if not sizes:
        return f"({', '.join(dims)})"
    return "(" + ", ".join(f"{d}={sizes[d]}" if d in sizes else d for d in dims) + ")"


def infer_dims(
    dims: tuple[str, ...],
    obs: str | None,
    y: str | None,
    x: str | None,
    roles: Mapping[str, str] | None = None,
    sizes: Mapping[str, int] | None = None,
) -> tuple[str, str, str, list[str]]:
    """(obs, y, x) dim names, never guessed from positions; violations if they cannot be told.

    In order: load.obs_dim / y_dim / x_dim; the CF ``roles`` of the dims'
    coordinate variables (:func:`cf_roles`: ``axis``, ``standard_name``, time or
    degree units), each claimed by one dim; conventional names (``time``,
    ``lat``, ``x``, …; one obs-like name, never a choice among several); then
    by elimination: with y and x known, the one dim left is obs, and with obs
    known, the dims left (exactly as many as are missing) are y then x in the
    variable's order (they only lay out the maps: the fits are per series).
    Any other dim is a batch dim. ``sizes`` only make the messages say more.
    """
    problems = _unknown_dims(dims, obs, y, x)
    if problems or len(dims) < 3:
        return "", "", "", problems
    roles = roles or {}
    found: dict[str, str | None] = {"obs": obs, "y": y, "x": x}
    taken = {d for d in found.values() if d is not None}
    _claim_by_roles(dims, roles, found, taken)
    _claim_by_names(dims, roles, found, taken)
    rest = [d for d in dims if d not in taken and roles.get(d) != "z"]
    if found["obs"] is None and None not in (found["y"], found["x"]) and len(rest) == 1:
        found["obs"] = rest[0]
        taken.add(rest[0])
    shape = _shape_text(dims, sizes)
    rival = _eliminate_map_dims(dims, obs, found, rest, shape)
    if rival is not None:
        problems.append(rival)
        return "", "", "", problems
    unknown = _unidentified(dims, found, shape)
    if unknown is not None:
        problems.append(unknown)
        return "", "", "", problems
    o, yy, xx = found["obs"], found["y"], found["x"]
    assert o is not None and yy is not None and xx is not None
    if len({o, yy, xx}) != 3:
        problems.append(
            f"load.obs_dim / y_dim / x_dim name the same dim twice (obs={o!r}, y={yy!r}, "
            f"x={xx!r}); the variable's dims are {shape}"
        )
        return "", "", "", problems
    return o, yy, xx, problems


def _unknown_dims(
    dims: tuple[str, ...], obs: str | None, y: str | None, x: str | None
) -> list[str]:
    """How load.obs_dim / y_dim / x_dim name dims the variable does not have."""
    return [
        f"{field} {name!r} is not a dim of the variable (its dims are {list(dims)})"
        f"{suggest(name, dims)}"
        for field, name in (("load.obs_dim", obs), ("load.y_dim", y), ("load.x_dim", x))
        if name is not None and name not in dims
    ]


def _claim_by_roles(
    dims: tuple[str, ...],
    roles: Mapping[str, str],
    found: dict[str, str | None],
    taken: set[str],
) -> None:
    """Give each role still unknown the one untaken dim whose CF role it is (if one)."""
    for role in ("obs", "y", "x"):
        claims = [d for d in dims if roles.get(d) == role and d not in taken]
        if found[role] is None and len(claims) == 1:
            found[role] = claims[0]
            taken.add(claims[0])


def _claim_by_names(
    dims: tuple[str, ...],
    roles: Mapping[str, str],
    found: dict[str, str | None],
    taken: set[str],
) -> None:
    """Give y, x, then obs (one obs-like name only) the untaken dim named like it."""
    for role, names in (("y", Y_NAMES), ("x", X_NAMES)):
        free = [d for d in dims if d not in taken and roles.get(d) in (None, role)]
        if found[role] is None and (name := _pick(names, free)) is not None:
            found[role] = name
            taken.add(name)
    named = [d for d in dims if d not in taken and roles.get(d) in (None, "obs")]
    named = [d for d in named if d.lower() in OBS_NAMES]
    if found["obs"] is None and len(named) == 1:
        found["obs"] = named[0]
        taken.add(named[0])


def _eliminate_map_dims(
    dims: tuple[str, ...],
    obs: str | None,
    found: dict[str, str | None],
    rest: list[str],
    shape: str,
) -> str | None:
    """With obs known, the dims ``rest`` left are y then x; the problem if one is named obs."""
    missing = [r for r in ("y", "x") if found[r] is None]
    if found["obs"] is None or not missing or len(rest) != len(missing):
        return None
    rivals = [d for d in rest if d.lower() in OBS_NAMES]
    if obs is None and rivals:
        # a dim named like the observations would become a map axis by elimination:
        # two dims claim to be obs (one by its coordinate, one by its name)
        return (
            f"cannot tell which dim is the observation dim: the variable's dims are "
            f"{shape}; {found['obs']!r} has a coordinate that says it is time, but "
            f"{rivals[0]!r} is named like an observation dim too; set load.obs_dim, "
            f"e.g. the line `obs_dim: {found['obs']}` (or `obs_dim: {rivals[0]}`) in the "
            "config's load section"
        )
    found.update(zip(missing, rest, strict=True))
    return None


def _unidentified(dims: tuple[str, ...], found: Mapping[str, str | None], shape: str) -> str | None:
    """The problem if obs, or y and x, are still unknown; None if all three are known."""
    missing = [r for r in ("y", "x") if found[r] is None]
    free = [d for d in dims if d not in {v for v in found.values() if v}]
    if found["obs"] is None:
        example = free[-1] if free else dims[-1]
        return (
            f"cannot tell which dim is the observation dim: the variable's dims are {shape}, "
            f"none is named like one ({', '.join(OBS_NAMES)}) or has a coordinate variable "
            "that says so (CF axis: T, standard_name: time, or units like 'days since …'); "
            f"set load.obs_dim to the dim of the observations, e.g. the line `obs_dim: {example}` "
            "in the config's load section"
        )
    if missing:
        pair = (free + list(dims))[:2] if len(free) < 2 else free[-2:]
        return (
            f"cannot tell which dims are the map's rows and columns: the variable's dims are "
            f"{shape}, obs is {found['obs']!r}, and of {free} none is named like y / x "
            "(lat, lon, y, x, …) or has a coordinate variable that says so (CF axis: Y / X, "
            "standard_name, units degrees_north / degrees_east); set load.y_dim and "
            f"load.x_dim, e.g. the lines `y_dim: {pair[0]}` and `x_dim: {pair[1]}` in "
            "the config's load section"
        )
    return None
