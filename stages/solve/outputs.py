"""The variables the ``solve`` kind writes, with their CF attributes, and its derived data.

Declared once here (``KindContract.variables``) and written by whichever writer
the run uses: the coefficients and diagnostics, the uncertainty where the run
asked for it (t-statistics and p-values are derived from the stored standard
errors tile by tile, see :func:`t_values` and :func:`p_values`), and what the
design makes meaningful (a trend per obs unit, amplitude and peak time of
harmonics). A table of CF attributes per variable, hence its length. No torch:
writing a cached run imports none.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from gridsolve.schemas.contracts import STATUS_CODES, STATUS_FLAGS
from gridsolve.schemas.metadata import DesignMeta, SolvePrepared
from gridsolve.stages.engine.outputs import (
    OutputContext,
    OutputVariable,
    flag_attrs,
    per_unit,
    squared_unit,
    uniform_unit,
)
from gridsolve.stages.engine.store import Artifact, TiledArtifact

#: Bits of the ``uncertainty_flags`` variable.
UNCERTAINTY_FLAGS = {
    1: "rank_deficient",  # some coefficients are not identifiable: their stderr, t, p are NaN
    2: "no_residual_dof",  # dof ≤ 0: the residual variance, hence the scaled stderr, is undefined
    4: "not_solved",  # the coefficients are NaN (see status)
}


def t_values(coefficients: np.ndarray, stderr: np.ndarray) -> np.ndarray:
    """t-statistics (coefficient / standard error) of stored results, in ``stderr``'s dtype.

    NaN where the standard error is NaN (not identifiable, not solved); computed
    in float64, so float32 outputs round once.
    """
    with np.errstate(all="ignore"):
        t = np.asarray(coefficients, dtype=np.float64) / np.asarray(stderr, dtype=np.float64)
    out: np.ndarray = t.astype(np.asarray(stderr).dtype, copy=False)
    return out


def p_values(t: np.ndarray, dof: np.ndarray, scaled: bool = True) -> np.ndarray:
    """Two-sided p-values of t-statistics ``t`` (coef, …) with ``dof`` (…), in float64.

    Student t with ``dof`` degrees of freedom (NaN where dof ≤ 0); ``scaled``
    False (``cov_scale: unscaled``): the standard normal. Float64 whatever ``t``'s
    dtype: float32 underflows p-values below 1.2e-38 (highly significant trends) to 0.
    """
    import scipy.special  # here: a run without uncertainty never needs it

    t64 = np.asarray(t, dtype=np.float64)
    with np.errstate(all="ignore"):
        if scaled:
            d = np.asarray(dof, dtype=np.float64)
            # scipy.stats.t.sf(x, dof) is scipy.special.stdtr(dof, −x): called directly,
            # it skips the distribution's argument checks (2.5× faster on many values).
            p = 2.0 * scipy.special.stdtr(np.where(d > 0, d, np.nan), -np.abs(t64))
        else:
            p = 2.0 * scipy.special.ndtr(-np.abs(t64))
    out: np.ndarray = p
    return out


def variables(ctx: OutputContext) -> list[OutputVariable]:
    """Every variable the solve writes (those of optional arrays the run did not make too)."""
    units = ctx.data_units
    coef_units = ctx.coefficient_units()
    uniform = uniform_unit(coef_units)
    # the shared design's undetermined coefficients (see _undetermined_nan)
    prepared = SolvePrepared.of(ctx.own)
    shared = prepared.undetermined_columns
    flags = prepared.status_flags or STATUS_FLAGS
    out = [
        OutputVariable(
            "coefficients",
            "solve",
            "coefficients",
            ("coef", "y", "x"),
            {
                "long_name": "least-squares coefficients of the design columns",
                **({"units": uniform} if uniform is not None else {}),
            },
        ),
        OutputVariable(
            "residual_rms",
            "solve",
            "residual_rms",
            ("y", "x"),
            {
                "long_name": "root mean square of the residuals over valid observations",
                **({"units": units} if units else {}),
            },
        ),
        OutputVariable(
            "n_valid",
            "solve",
            "n_valid",
            ("y", "x"),
            {"long_name": "number of valid observations", "units": "1"},
        ),
        OutputVariable(
            "status",
            "solve",
            "status",
            ("y", "x"),
            flag_attrs("solve status", flags),
        ),
        *_uncertainty_variables(ctx.own, uniform),
    ]
    if ctx.design is not None:  # what a design's columns make meaningful
        out += _trend_variables(ctx.design, units, shared, ctx.own)
        out += _harmonic_variables(ctx.design, units, shared)
    return out


def _t_of(solved: Artifact) -> np.ndarray:
    return t_values(solved.array("coefficients"), solved.array("coef_stderr"))


def _uncertainty_variables(solve: TiledArtifact, uniform: str | None) -> list[OutputVariable]:
    """The per-pixel uncertainty variables, where the solve made them (solve.uncertainty)."""
    first = solve.tiles[0][1] if solve.tiles else None
    if first is None or "coef_stderr" not in first:
        return []
    scaled = SolvePrepared.of(solve).cov_scale == "residual"
    how = (
        "scaled by the residual variance sum(w*r^2)/dof"
        if scaled
        else "unscaled (weights taken as 1/variance of known errors)"
    )
    out = [*_coefficient_statistics(uniform, scaled, how), *_fit_statistics()]
    if "coef_cov" in first:
        out.insert(1, _covariance_variable(uniform, how))
    return out


def _coefficient_statistics(uniform: str | None, scaled: bool, how: str) -> list[OutputVariable]:
    """The coefficients' standard errors, t-statistics and p-values."""
    dist = "Student t with dof degrees of freedom" if scaled else "standard normal"
    return [
        OutputVariable(
            "coef_stderr",
            "solve",
            "coef_stderr",
            ("coef", "y", "x"),
            {
                "long_name": "standard error of the least-squares coefficients",
                "comment": f"covariance {how}; NaN where a coefficient is not identifiable",
                **({"units": uniform} if uniform is not None else {}),
            },
        ),
        OutputVariable(
            "t_value",
            "solve",
            "coef_stderr",  # its shape and dtype
            ("coef", "y", "x"),
            {"long_name": "t-statistic of the coefficients (coefficient / stderr)", "units": "1"},
            derive=lambda arts: _t_of(arts["solve"]),
        ),
        OutputVariable(
            "p_value",
            "solve",
            "coef_stderr",  # its shape (float64: float32 underflows small p)
            ("coef", "y", "x"),
            {
                "long_name": "two-sided p-value of the coefficients being zero",
                "comment": f"from the {dist} distribution",
                "units": "1",
            },
            derive=lambda arts: p_values(_t_of(arts["solve"]), arts["solve"].array("dof"), scaled),
        ),
    ]


def _fit_statistics() -> list[OutputVariable]:
    """Each pixel's residual degrees of freedom, R² and uncertainty flags."""
    return [
        OutputVariable(
            "dof",
            "solve",
            "dof",
            ("y", "x"),
            {
                "long_name": "residual degrees of freedom",
                "comment": "valid observations minus the effective rank (trace of the hat "
                "matrix under ridge)",
                "units": "1",
            },
        ),
        OutputVariable(
            "r2",
            "solve",
            "r2",
            ("y", "x"),
            {
                "long_name": "coefficient of determination",
                "comment": "centred where the pixel's design spans a constant, else uncentred",
                "units": "1",
            },
        ),
        OutputVariable(
            "uncertainty_flags",
            "solve",
            "uncertainty_flags",
            ("y", "x"),
            flag_attrs("uncertainty flags", UNCERTAINTY_FLAGS, masks=True),
        ),
    ]


def _covariance_variable(uniform: str | None, how: str) -> OutputVariable:
    """The coefficients' covariance (solve.uncertainty = cov)."""
    squared = squared_unit(uniform) if uniform is not None else None
    return OutputVariable(
        "coef_cov",
        "solve",
        "coef_cov",
        ("coef", "coef2", "y", "x"),
        {
            "long_name": "covariance of the least-squares coefficients",
            "comment": f"{how}; coef2 indexes the design columns as coef does",
            **({"units": squared} if squared is not None else {}),
        },
    )


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


def _trend_variables(
    design: Artifact, units: str | None, shared: list[int], solve: TiledArtifact | None = None
) -> list[OutputVariable]:
    """``trend``, where the design has a trend column: its coefficient per raw obs unit.

    With the solve's uncertainty on, also ``trend_stderr`` (the column's standard error,
    in the trend's units) and ``trend_p_value`` (the column's p-value).
    """
    meta = DesignMeta.of(design)
    trend = meta.trend
    if trend is None:
        return []
    col, scale = trend.column, trend.scale

    def per_obs_unit(arts: Mapping[str, Artifact], name: str) -> np.ndarray:
        a = arts["solve"].array(name)
        value = a[col].astype(np.float64) / scale
        return _undetermined_nan(value, arts, shared, col).astype(a.dtype)

    name = meta.columns[col]
    unit = per_unit(units, trend.per)
    what = f"the coefficient of design column {name!r} divided by the design's t_scale"
    if len(meta.columns) > col + 1 and meta.basis == "polynomial":
        what += " (with higher powers in the design: the slope at its centre time t_centre)"
    out = [
        OutputVariable(
            "trend",
            "solve",
            "coefficients",
            ("y", "x"),
            {
                "coefficient": str(name),
                "long_name": "linear trend",
                "comment": f"per unit of the observation axis: {what}",
                **({"units": unit} if unit else {}),
            },
            # NaN where the pixel's valid rows do not determine the trend column
            derive=lambda arts: per_obs_unit(arts, "coefficients"),
        )
    ]
    first = solve.tiles[0][1] if solve is not None and solve.tiles else None
    if solve is None or first is None or "coef_stderr" not in first:
        return out
    scaled = SolvePrepared.of(solve).cov_scale == "residual"

    def p_of(arts: Mapping[str, Artifact]) -> np.ndarray:
        solved = arts["solve"]
        t = t_values(solved.array("coefficients"), solved.array("coef_stderr"))
        p = p_values(t[col : col + 1], solved.array("dof"), scaled)[0]
        return _undetermined_nan(p, arts, shared, col)

    out += [
        OutputVariable(
            "trend_stderr",
            "solve",
            "coefficients",  # its dtype; one value per pixel
            ("y", "x"),
            {
                "coefficient": str(name),
                "long_name": "standard error of the linear trend",
                "comment": f"in the trend's units: the standard error of {what}",
                **({"units": unit} if unit else {}),
            },
            derive=lambda arts: per_obs_unit(arts, "coef_stderr"),
        ),
        OutputVariable(
            "trend_p_value",
            "solve",
            "coef_stderr",  # float64 like p_value: float32 underflows small p
            ("y", "x"),
            {
                "coefficient": str(name),
                "long_name": "two-sided p-value of the linear trend being zero",
                "comment": f"the p_value of design column {name!r}",
                "units": "1",
            },
            derive=p_of,
        ),
    ]
    return out


def reference_time(design_meta: DesignMeta) -> dict[str, str]:
    """``{"reference_time": ISO date}`` of the design's centre on a time axis, else {}.

    The centre ``t_centre`` is in ``t_units``: ``days since 1970-01-01`` for datetimes
    (turned into a date here), a stored time's own units otherwise (given in them).
    """
    units = design_meta.t_units or ""
    centre = design_meta.t_centre
    if " since " not in units or centre is None:
        return {}  # not a time axis: peak_offset counts from t_centre (design's attributes)
    if units != "days since 1970-01-01":  # a stored time in its own units
        return {"reference_time": f"{centre:g} {units}"}
    when = np.datetime64("1970-01-01T00:00:00") + np.timedelta64(round(centre * 86400), "s")
    return {"reference_time": str(when)}


def _harmonic_variables(
    design: Artifact, units: str | None, shared: Sequence[int] = ()
) -> list[OutputVariable]:
    """Amplitude and peak time of each harmonic of a harmonic design, from its cos/sin pair.

    ``c cos w + s sin w = A cos(w - φ)`` with ``A = hypot(c, s)``, ``φ = atan2(s, c)``
    and ``w = 2πk (v - t_centre) / period``: the maximum is at
    ``v = t_centre + φ period / (2πk)``, given within one period of the harmonic.
    """
    meta = DesignMeta.of(design)
    harmonics = meta.harmonics
    if not harmonics or meta.period is None:
        return []
    cos_i = np.array([h.cos for h in harmonics])
    sin_i = np.array([h.sin for h in harmonics])
    ks = np.array([h.k for h in harmonics], dtype=np.float64)[:, None, None]
    period = meta.period
    step = meta.axis_step
    reference = reference_time(meta)

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
        OutputVariable(
            "amplitude",
            "solve",
            "coefficients",
            ("harmonic", "y", "x"),
            {
                "long_name": "amplitude of each harmonic",
                "comment": "hypot of the harmonic's cos and sin coefficients",
                **({"units": units} if units else {}),
            },
            derive=amplitude,
        ),
        OutputVariable(
            "peak_offset",
            "solve",
            "coefficients",
            ("harmonic", "y", "x"),
            {
                "long_name": "time of each harmonic's maximum after reference_time",
                "comment": "within one period of the harmonic (period / harmonic); "
                "reference_time is the design's centre time t_centre",
                **({"units": step} if step else {}),
                **reference,
            },
            derive=peak,
        ),
    ]
