"""What the quick-look maps of an output file show: panels, colour scales, status counts.

The maps are the first coefficient, the residual RMS (or, where that is the
same everywhere, what varies instead: the RMS of the fitted values or the
valid counts, the reason in the title) and, where the output has a trend with
p-values, the trend where it is significant. Each is titled with its
variable's ``long_name`` and ``units`` and drawn on the map dims' coordinates.
A cube with more batch dims than y and x is shown at their first index.
"""

from __future__ import annotations

import textwrap
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import xarray as xr

from gridsolve.stages.engine import storage
from gridsolve.stages.write.layout import DESIGN_VARIABLE

MAX_SIDE = 300
#: The percentiles of the finite values that a map's colour scale spans.
ROBUST_PERCENTILES = (2.0, 98.0)
DIVERGING_CMAP = "RdBu_r"
SEQUENTIAL_CMAP = "viridis"
_TITLE_CHARS = 52  # characters per title line (fits a panel at the title's font size)


def open_output(output: str | Path, options: Mapping[str, Any] | None = None) -> xr.Dataset:
    """An output of gridsolve: a NetCDF file, or a Zarr store (a folder, whatever its name).

    A URL is opened with ``options`` (``write.storage_options``) and the
    credentials of the environment.
    """
    where = storage.at(output, options)
    if where.is_folder(".zmetadata"):  # a Zarr store
        store: xr.Dataset = xr.open_zarr(where.text, storage_options=where.open_options())
        return store
    return xr.open_dataset(where.readable())


def first_plane(ds: xr.Dataset) -> tuple[xr.Dataset, str]:
    """``ds`` at the first index of every batch dim besides the map's two, and which that is.

    The maps show the last two dims of ``residual_rms`` (y, x); a cube with more
    batch dims (member, level, …) is shown at their first index, named in the
    titles, e.g. ``member=1, level=500``.
    """
    batch = [str(d) for d in ds["residual_rms"].dims[:-2]]
    if not batch:
        return ds, ""
    labels = [f"{d}={ds[d].values[0] if d in ds.coords else 0}" for d in batch]
    return ds.isel({d: 0 for d in batch}), ", ".join(labels)


def significant_trend(ds: xr.Dataset, level: float = 0.05) -> tuple[np.ndarray, float] | None:
    """The trend map with pixels whose trend coefficient has p ≥ ``level`` masked (NaN).

    None unless the output has a ``trend`` and p-values (``solve.uncertainty``).
    Also returns the fraction of finite-trend pixels that are significant.
    """
    if "trend" not in ds or "p_value" not in ds or "coef_name" not in ds.coords:
        return None
    names = [str(n) for n in ds["coef_name"].values]
    column = str(ds["trend"].attrs.get("coefficient", ""))
    if column not in names:
        return None
    trend = np.asarray(ds["trend"].values, dtype=np.float64)
    p = np.asarray(ds["p_value"].isel(coef=names.index(column)).values, dtype=np.float64)
    significant = p < level  # NaN p-values (not identifiable) are never significant
    shown = np.where(significant, trend, np.nan)
    finite = np.isfinite(trend)
    fraction = float(significant[finite].mean()) if finite.any() else 0.0
    return shown, fraction


def status_counts(ds: xr.Dataset, name: str = "status") -> list[tuple[str, int]]:
    """How many pixels of the whole file have each status, by its flag meaning, in flag order.

    Read from the ``status`` variable and its ``flag_values``/``flag_meanings``;
    a code without a meaning is named ``code N``, a missing value ``missing``.
    Empty when the file has no such variable.
    """
    if name not in ds:
        return []
    var = ds[name]
    values = np.asarray(var.values).ravel()
    codes = np.atleast_1d(np.asarray(var.attrs.get("flag_values", []))).tolist()
    meanings = str(var.attrs.get("flag_meanings", "")).split()
    named = dict(zip((int(c) for c in codes), meanings, strict=False))
    missing = ~np.isfinite(values) if values.dtype.kind == "f" else np.zeros(values.shape, bool)
    found, counts = np.unique(values[~missing].astype(np.int64), return_counts=True)
    by_code = dict(zip(found.tolist(), counts.tolist(), strict=True))
    order = [c for c in named if c in by_code] + sorted(c for c in by_code if c not in named)
    out = [(named.get(c, f"code {c}"), int(by_code[c])) for c in order]
    if missing.any():
        out.append(("missing", int(missing.sum())))
    return out


def status_text(ds: xr.Dataset, name: str = "status") -> str:
    """``solve status of 4096 pixels: ok 4090, too_few_observations 6``, or '' without one."""
    counts = status_counts(ds, name)
    if not counts:
        return ""
    total = sum(n for _, n in counts)
    label = str(ds[name].attrs.get("long_name", name))
    return f"{label} of {total} pixels: " + ", ".join(f"{k} {n}" for k, n in counts)


# ---------------------------------------------------------------- panels
@dataclass(frozen=True)
class Axis:
    """One map dim as drawn: the values at the (thinned) pixels and the axis label.

    The values are the coordinate's where it is 1-D, numeric and monotonic, else
    the pixel indices.
    """

    values: np.ndarray
    label: str


@dataclass(frozen=True)
class Panel:
    """One map: its (thinned) values and the lines of its title."""

    data: np.ndarray
    title: list[str]


@dataclass(frozen=True)
class Scale:
    """A panel's colour scale and what its title adds about the values."""

    vmin: float
    vmax: float
    cmap: str
    extend: str
    note: str


def _fmt(v: float) -> str:
    return f"{v:.4g}"


def _describe(var: xr.DataArray) -> str:
    """``long_name (units)`` of a variable, or its name."""
    long_name = str(var.attrs.get("long_name", var.name))
    units = var.attrs.get("units")
    return f"{long_name} ({units})" if units not in (None, "") else long_name


def _axis(ds: xr.Dataset, dim: str, n: int) -> Axis:
    """The values and label of map dim ``dim``: its coordinate where 1-D and monotonic."""
    if dim in ds.coords and ds[dim].ndim == 1 and ds[dim].size == n:
        coord = ds[dim]
        values = np.asarray(coord.values)
        if values.dtype.kind in "iuf":
            v = values.astype(np.float64)
            steps = np.diff(v)
            if np.isfinite(v).all() and ((steps > 0).all() or (steps < 0).all()):
                label = str(dim)
                long_name = coord.attrs.get("long_name")
                if long_name and str(long_name) != str(dim):
                    label += f", {long_name}"
                units = coord.attrs.get("units")
                if units not in (None, ""):
                    label += f" ({units})"
                return Axis(v, label)
    return Axis(np.arange(n, dtype=np.float64), f"{dim} (index)")


def _edges(v: np.ndarray) -> np.ndarray:
    """Cell edges around centres ``v`` (monotonic): midpoints, the ends extended."""
    if v.size == 1:
        return np.array([v[0] - 0.5, v[0] + 0.5])
    mid = (v[:-1] + v[1:]) / 2
    return np.concatenate([[2 * v[0] - mid[0]], mid, [2 * v[-1] - mid[-1]]])


def colour_scale(data: np.ndarray) -> Scale:
    """A robust scale of ``data``'s finite values (2nd to 98th percentile).

    Values of both signs get a diverging scale centred on zero (vmin = -vmax);
    a constant field and one with no finite values say so in ``note``.
    """
    finite = data[np.isfinite(data)]
    if finite.size == 0:
        return Scale(0.0, 1.0, SEQUENTIAL_CMAP, "neither", "no finite values")
    low, high = float(finite.min()), float(finite.max())
    if low == high:
        pad = max(abs(low) * 0.1, 1.0)
        return Scale(low - pad, low + pad, SEQUENTIAL_CMAP, "neither", f"constant = {_fmt(low)}")
    p_lo, p_hi = (float(p) for p in np.percentile(finite, ROBUST_PERCENTILES))
    if low < 0 < high:
        vmax = max(abs(p_lo), abs(p_hi)) or max(abs(low), abs(high))
        vmin, cmap = -vmax, DIVERGING_CMAP
    else:
        vmin, vmax, cmap = p_lo, p_hi, SEQUENTIAL_CMAP
        if vmin == vmax:  # nearly all one value: span the rest too
            vmin, vmax = low, high
    extend = {(False, False): "neither", (True, False): "min", (False, True): "max"}.get(
        (low < vmin, high > vmax), "both"
    )
    return Scale(vmin, vmax, cmap, extend, "")


def _constant(data: np.ndarray) -> str | None:
    """What makes ``data`` carry no map ('0 everywhere', 'constant = 3', 'no finite values')."""
    finite = data[np.isfinite(data)]
    if finite.size == 0:
        return "has no finite values"
    if finite.min() == finite.max():
        return "is 0 everywhere" if finite.max() == 0 else f"is constant = {_fmt(finite[0])}"
    return None


def _fitted_rms(ds: xr.Dataset, coef: xr.DataArray) -> xr.DataArray | None:
    """RMS over the observations of the fitted values (design × coefficients), if computable.

    Needs the shared design ``(obs, coef)`` in the output; ``coef`` is the
    (thinned) coefficients ``(coef, y, x)``. Every observation counts, valid or not.
    """
    design = ds.get(DESIGN_VARIABLE)
    if design is None or design.ndim != 2 or design.dims[1] != coef.dims[0]:
        return None
    a = np.asarray(design.values, dtype=np.float64)
    c = np.asarray(coef.values, dtype=np.float64).reshape(coef.shape[0], -1)
    # mean over t of (Σ_k a_tk c_k)² = cᵀ(AᵀA/n)c per pixel: coef² work, not obs × pixels
    gram = a.T @ a / len(a)
    with np.errstate(invalid="ignore"):
        ms = np.einsum("kp,kp->p", gram @ c, c)
    rms = np.sqrt(np.clip(ms, 0.0, None)).reshape(coef.shape[1:])
    obs = design.dims[0]
    attrs = {"long_name": f"RMS over the {len(a)} observations ({obs}) of design × coefficients"}
    units = ds["residual_rms"].attrs.get("units")
    if units not in (None, ""):
        attrs["units"] = str(units)
    return xr.DataArray(rms, dims=coef.dims[1:], name="fitted-value RMS", attrs=attrs)


def _at_most_one_observation_per_coefficient(plane: xr.Dataset, n_coef: int) -> bool:
    """Whether every pixel can be fitted exactly: ``n_valid`` ≤ coefficients, or ``dof`` 0."""
    for name, bound in (("n_valid", n_coef), ("dof", 0)):
        if name in plane:
            values = np.asarray(plane[name].values, dtype=np.float64)
            finite = values[np.isfinite(values)]
            if finite.size and (finite <= bound).all():
                return True
    return False


def _round_off(plane: xr.Dataset, rms: xr.DataArray, fitted: xr.DataArray | None) -> str | None:
    """'is ≈ 0 everywhere (…)' where the (thinned) residual RMS is round-off of an exact fit.

    Round-off: at most √ε of the residual's dtype times the fitted values' RMS at
    every pixel; without the design to compare with, a ``dof`` of 0 everywhere.
    """
    r = np.asarray(rms.values, dtype=np.float64)
    ok = np.isfinite(r)
    if not ok.any():
        return None
    kind = rms.dtype if rms.dtype.kind == "f" else np.dtype(np.float64)
    tol = float(np.sqrt(np.finfo(kind).eps))
    if fitted is not None:
        f = np.asarray(fitted.values, dtype=np.float64)
        negligible = bool((r[ok] <= tol * f[ok]).all())
    else:
        dof = np.asarray(plane["dof"].values, dtype=np.float64) if "dof" in plane else None
        negligible = dof is not None and bool((dof[np.isfinite(dof)] == 0).all())
    return f"is ≈ 0 everywhere (≤ {r[ok].max():.2g}: round-off)" if negligible else None


def _residual_panel(
    plane: xr.Dataset, coef: xr.DataArray, thin: Mapping[str, slice]
) -> tuple[xr.DataArray, str]:
    """The residual RMS map, or, where it is the same everywhere, what varies instead and why.

    Residual RMS that is 0 everywhere (an exact fit: as many coefficients as
    observations, e.g. the demo's minimum norm with 100 columns and 50
    observations; or only round-off of one), constant or never finite is
    replaced by the RMS of the fitted values (where the output holds the
    design) or else by ``n_valid``; the reason is returned for the title.
    """
    rms = plane["residual_rms"]
    n_coef = int(coef.shape[0])
    why = _constant(np.asarray(rms.values, dtype=np.float64))  # the whole plane, not thinned
    fitted = None
    if why is None:
        if not _at_most_one_observation_per_coefficient(plane, n_coef):
            return rms.isel(thin), ""
        fitted = _fitted_rms(plane, coef)
        why = _round_off(plane, rms.isel(thin), fitted)
        if why is None:
            return rms.isel(thin), ""
    else:
        fitted = _fitted_rms(plane, coef)
    reason = f"residual RMS {why}"
    if "0 everywhere" in why:
        n_obs = None
        if "n_valid" in plane:
            valid = np.asarray(plane["n_valid"].values, dtype=np.float64)
            n_obs = int(np.nanmax(valid)) if np.isfinite(valid).any() else None
        elif DESIGN_VARIABLE in plane and plane[DESIGN_VARIABLE].ndim == 2:
            n_obs = int(plane[DESIGN_VARIABLE].shape[0])
        exact = n_obs is not None and n_coef >= n_obs
        reason += f" (exact fit: {n_coef} coef ≥ {n_obs} obs)" if exact else " (an exact fit)"
    candidates = [
        ("the fitted-value RMS", fitted),
        ("n_valid", plane["n_valid"].isel(thin) if "n_valid" in plane else None),
    ]
    found = [(label, var) for label, var in candidates if var is not None]
    for label, var in found:
        if _constant(np.asarray(var.values, dtype=np.float64)) is None:
            return var, f"{reason} — showing {label}"
    if found:  # nothing varies: the last resort, its title says it is constant too
        label, var = found[-1]
        return var, f"{reason} — showing {label}"
    return rms.isel(thin), reason


def _title(head: str, var: xr.DataArray | None, *more: str) -> list[str]:
    lines = [head] + ([_describe(var)] if var is not None else []) + [m for m in more if m]
    return [
        w
        for line in lines
        for w in textwrap.wrap(line, _TITLE_CHARS, break_on_hyphens=False) or [""]
    ]


def _panels(full: xr.Dataset) -> tuple[list[Panel], Axis, Axis]:
    """The maps of an open output (thinned to at most ``MAX_SIDE`` a side) and their axes."""
    plane, where = first_plane(full)
    ydim, xdim = (str(d) for d in full["residual_rms"].dims[-2:])
    ny, nx = plane.sizes[ydim], plane.sizes[xdim]
    step = max(1, int(np.ceil(max(ny, nx) / MAX_SIDE)))
    thin = {ydim: slice(None, None, step), xdim: slice(None, None, step)}
    shown = plane.isel(thin)
    yaxis, xaxis = _axis(shown, ydim, shown.sizes[ydim]), _axis(shown, xdim, shown.sizes[xdim])

    def grid(var: xr.DataArray) -> np.ndarray:
        return np.asarray(var.transpose(ydim, xdim).values, dtype=np.float64)

    # a linear fit's coefficients, or a nonlinear fit's parameters (solve: curvefit)
    fitted_name, label_name, what = (
        ("coefficients", "coef_name", "coefficients of column")
        if "coefficients" in plane
        else ("params", "param_name", "fitted parameter")
    )
    coef_var = plane[fitted_name]
    coef_dim = str(coef_var.dims[0])
    coefs = coef_var.isel(thin).transpose(coef_dim, ydim, xdim)
    labels = plane[label_name] if label_name in plane.coords else plane.get(coef_dim)
    name = str(labels.values[0]) if labels is not None else "0"
    panels = [Panel(grid(coefs.isel({coef_dim: 0})), _title(f"{what} '{name}'", coef_var, where))]
    second, reason = _residual_panel(plane, coefs, thin)
    panels.append(Panel(grid(second), _title(str(second.name), second, where, reason)))
    trend = significant_trend(plane)
    if trend is not None:
        masked, fraction = trend
        panels.append(
            Panel(
                masked[::step, ::step],
                _title(
                    f"trend where p < 0.05 ({100 * fraction:.0f}% of pixels; grey elsewhere)",
                    plane["trend"],
                    where,
                ),
            )
        )
    return panels, xaxis, yaxis
