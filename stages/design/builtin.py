"""The ``design`` stage: the design matrix ``A (obs, coef)`` shared by every pixel.

Generated bases use a centred, scaled axis: datetimes become days since
1970-01-01, then ``t = (v - centre) / half_range`` lies in [-1, 1], which keeps
polynomial columns well conditioned. The centre and scale are recorded so
coefficients can be mapped back to raw units. Each design records its columns'
units (``column_units``, None where unknown) and, where it has one, which column
is the linear trend (``trend``), so the output can state coefficient units and
the trend per raw axis unit (per day for datetimes).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from gridsolve.schemas.contracts import ArraySpec
from gridsolve.schemas.errors import ContractError, InputError
from gridsolve.schemas.kinds.design import (
    HarmonicDesign,
    NoDesign,
    PolynomialDesign,
    RandomDesign,
    VariableDesign,
)
from gridsolve.schemas.metadata import DesignMeta, LoadMeta
from gridsolve.stages.engine.context import StageContext
from gridsolve.stages.engine.registry import StageDecl, register, register_none
from gridsolve.stages.engine.store import Artifact, StageOutput

VERSION = "1"
OUTPUTS = {"A": ArraySpec(("obs", "coef"), "f", "design matrix, float64")}


#: Days per unit of a CF time coordinate's ``<unit> since <date>``; months and years
#: are left out on purpose: their length depends on the calendar and the date.
_DAYS_PER = {
    **dict.fromkeys(("days", "day", "d"), 1.0),
    **dict.fromkeys(("hours", "hour", "hr", "hrs", "h"), 1 / 24),
    **dict.fromkeys(("minutes", "minute", "min", "mins"), 1 / 1440),
    **dict.fromkeys(("seconds", "second", "sec", "secs", "s"), 1 / 86_400),
}
#: Days in a year of each CF calendar: the default period of a harmonic design.
YEAR_DAYS = {
    "noleap": 365.0,
    "365_day": 365.0,
    "all_leap": 366.0,
    "366_day": 366.0,
    "360_day": 360.0,
}


def stored_time(load: LoadMeta) -> tuple[str, str] | None:
    """(units, calendar) of an obs coordinate kept as stored CF time numbers; else None."""
    attrs = load.coord_attrs.get("obs") or {}
    units, calendar = attrs.get("units"), attrs.get("calendar")
    if isinstance(units, str) and " since " in units and isinstance(calendar, str):
        return units, calendar
    return None


def obs_axis(
    values: np.ndarray, stage: str, time: tuple[str, str] | None = None
) -> tuple[np.ndarray, str]:
    """The observation coordinate as float64 and its unit ("days" for datetimes).

    ``time`` is the (units, calendar) of a coordinate kept as stored CF time
    numbers (calendars datetime64 cannot hold): it becomes days since the
    units' reference date, counted in its calendar. Refuses NaT, NaN and
    infinite values (the load stage refuses them first).
    """
    if np.issubdtype(values.dtype, np.datetime64):
        ns = values.astype("datetime64[ns]")
        # NaT is the most negative int64: as days it would silently become -1e8.
        axis = np.where(np.isnat(ns), np.nan, ns.astype(np.int64) / 86_400e9)
        unit = "days since 1970-01-01"
    elif time is not None and values.dtype.kind in "fiu":
        step, _, since = time[0].partition(" since ")
        factor = _DAYS_PER.get(step.strip().lower())
        if factor is None:
            raise ContractError(
                f"a generated design cannot use the time unit {step.strip()!r}",
                stage=stage,
                found=f"obs coordinate units {time[0]!r} (calendar {time[1]})",
                fix="store the time in days, hours, minutes or seconds since a date "
                "(months and years have no fixed length), or use design impl 'variable'",
            )
        axis = values.astype(np.float64) * factor
        unit = f"days since {since.strip()} ({time[1]} calendar)"
    elif values.dtype.kind in "fiu":
        axis, unit = values.astype(np.float64), "coordinate units"
    else:
        raise ContractError(
            "a generated design needs a numeric or datetime observation coordinate",
            stage=stage,
            found=f"coordinate of dtype {values.dtype}",
            fix="use design impl 'random' or 'variable', or give the obs dim a numeric coordinate",
        )
    bad = ~np.isfinite(axis)
    if bad.any():
        raise ContractError(
            "a generated design needs a finite observation coordinate",
            stage=stage,
            found=f"{int(bad.sum())} NaT/NaN/infinite value(s), first at index "
            f"{int(np.flatnonzero(bad)[0])}",
            fix="give every observation a finite coordinate value in the input file",
        )
    return axis.astype(np.float64), unit


def axis_unit(load: LoadMeta, values: np.ndarray) -> str | None:
    """The unit one step of the raw obs axis is in ("day" for datetimes); None if unknown."""
    if np.issubdtype(values.dtype, np.datetime64) or stored_time(load) is not None:
        return "day"
    units = (load.coord_attrs.get("obs") or {}).get("units")
    if isinstance(units, str) and units.strip() and "since" not in units:
        return units.strip()
    return None


def power_unit(unit: str | None, k: int) -> str | None:
    """``unit`` to the power ``k`` in UDUNITS syntax; None if unknown or not a plain symbol."""
    if k == 0:
        return "1"
    if unit is None or not unit.isalpha():
        return None
    return unit if k == 1 else f"{unit}{k}"


def centre_scale(v: np.ndarray) -> tuple[float, float]:
    """(centre, half range) mapping ``v`` onto [-1, 1]; half range 1 when constant."""
    lo, hi = float(np.min(v)), float(np.max(v))
    half = (hi - lo) / 2.0
    return (lo + hi) / 2.0, (half if half > 0 else 1.0)


def conditioning(A: np.ndarray) -> dict[str, Any]:
    """Singular-value facts of ``A``: condition number, rank at the lstsq default cutoff."""
    s = np.linalg.svd(A, compute_uv=False)
    if s.size == 0 or s[0] == 0:
        return {"cond": float("inf"), "rank": 0, "s_max": 0.0, "s_min": 0.0}
    cutoff = np.finfo(np.float64).eps * max(A.shape) * s[0]
    rank = int((s > cutoff).sum())
    return {
        "cond": float(s[0] / s[-1]) if s[-1] > 0 else float("inf"),
        "rank": rank,
        "s_max": float(s[0]),
        "s_min": float(s[-1]),
    }


def _trend(column: int | None, scale: float, per: str | None) -> dict[str, Any]:
    """Design meta naming the linear-trend column: trend = coefficient / scale, per ``per``."""
    if column is None:
        return {}
    return {"trend": {"column": column, "scale": scale, "per": per}}


def _output(A: np.ndarray, columns: list[str], meta: dict[str, Any]) -> StageOutput:
    A = np.ascontiguousarray(A, dtype=np.float64)
    return StageOutput(
        arrays={"A": A},
        meta={
            **meta,
            "columns": columns,
            "coef": int(A.shape[1]),
            "obs": int(A.shape[0]),
            **conditioning(A),
        },
    )


def run_variable(
    config: VariableDesign, inputs: Mapping[str, Artifact], ctx: StageContext
) -> StageOutput:
    """The design matrix read from the input file."""
    load = inputs["load"]
    if "design" not in load:
        raise ContractError(
            "design impl 'variable' found no design variable in the input",
            stage="design/variable",
            fix="set load.design to the name of a variable with dims (obs, coef)",
        )
    A = np.array(load.array("design"))
    meta = LoadMeta.of(load)
    cols = meta.design_columns or [f"c{i}" for i in range(A.shape[1])]
    aux = meta.aux["design"]
    return _output(
        A,
        cols,
        {"basis": "variable", "variable": aux.name, "column_units": [aux.units] * A.shape[1]},
    )


def run_polynomial(
    config: PolynomialDesign, inputs: Mapping[str, Artifact], ctx: StageContext
) -> StageOutput:
    """Columns t**0 … t**degree of the (scaled) observation coordinate."""
    raw = inputs["load"].array("obs")
    load = LoadMeta.of(inputs["load"])
    v, unit = obs_axis(raw, "design/polynomial", stored_time(load))
    centre, half = centre_scale(v) if config.scale else (0.0, 1.0)
    t = (v - centre) / half
    A = np.stack([t**k for k in range(config.degree + 1)], axis=1)
    step = axis_unit(load, raw)
    # Scaled columns are pure numbers; raw ones carry the axis unit to their power.
    col_units = ["1" if config.scale else power_unit(step, k) for k in range(config.degree + 1)]
    return _output(
        A,
        [f"t^{k}" for k in range(config.degree + 1)],
        {
            "basis": "polynomial",
            "t_centre": centre,
            "t_scale": half,
            "t_units": unit,
            "column_units": col_units,
            **_trend(1 if config.degree >= 1 else None, half, step),
        },
    )


def run_harmonic(
    config: HarmonicDesign, inputs: Mapping[str, Artifact], ctx: StageContext
) -> StageOutput:
    """Mean, optional trend, and cos/sin of 2πk(v - centre)/period for k = 1…harmonics."""
    raw = inputs["load"].array("obs")
    load = LoadMeta.of(inputs["load"])
    time = stored_time(load)
    v, unit = obs_axis(raw, "design/harmonic", time)
    centre, half = centre_scale(v)
    if config.period is not None:
        period = config.period
    elif time is not None:
        period = YEAR_DAYS.get(time[1].lower(), 365.25)
    elif np.issubdtype(raw.dtype, np.datetime64):
        period = 365.25
    else:
        n = len(v)
        period = (2 * half) * n / (n - 1) if n > 1 else 1.0
    refuse_aliased(v, period, config.harmonics, unit)
    cols = [np.ones_like(v)]
    names = ["1"]
    if config.trend:
        cols.append((v - centre) / half)
        names.append("t")
    harmonics = []
    for k in range(1, config.harmonics + 1):
        w = 2 * np.pi * k * (v - centre) / period
        harmonics.append({"k": k, "cos": len(cols), "sin": len(cols) + 1})
        cols += [np.cos(w), np.sin(w)]
        names += [f"cos{k}", f"sin{k}"]
    step = axis_unit(load, raw)
    return _output(
        np.stack(cols, axis=1),
        names,
        {
            "basis": "harmonic",
            "period": period,
            "t_centre": centre,
            "t_scale": half,
            "t_units": unit,
            "column_units": ["1"] * len(names),
            # which columns are each harmonic's cos and sin: the output's amplitude and phase
            "harmonics": harmonics,
            "axis_step": step,
            **_trend(1 if config.trend else None, half, step),
        },
    )


#: Below this ratio of the singular values of a harmonic's (cos, sin) columns over the
#: observation times, the pair is taken as undetermined (one phase seen, or two opposite).
ALIAS_RATIO = 0.2


def refuse_aliased(v: np.ndarray, period: float, harmonics: int, unit: str | None) -> None:
    """InputError when the observations are too far apart to determine the highest harmonic.

    Regularly sampled, a cycle is determined only by observations less than half its
    period apart (Nyquist); sampled more sparsely, its cos and sin columns alias onto
    slower ones (annual means: the annual cosine is nearly the constant column), and the
    fit returns amplified noise for every pixel, each "determined" by a full-rank design.
    Refused: a median spacing (over the shared observation axis, so one pixel's gaps do
    not count) of at least half the harmonic's period, when the sampling is regular
    (the 10–90 % range of its steps within half the median) or its phases leave the
    harmonic's cos and sin nearly collinear (singular-value ratio under
    ``ALIAS_RATIO``); sparse irregular sampling that spreads the phases over the cycle
    is fitted. Not caught: dense sampling in short clusters (10 days a year), which the
    design's ``condition_number`` shows.
    """
    times = np.unique(v)
    steps = np.diff(times)
    if steps.size == 0:
        return
    step = float(np.median(steps))
    if step <= 0 or harmonics < period / (2 * step):
        return
    p10, p90 = np.percentile(steps, [10, 90])
    regular = (p90 - p10) <= 0.5 * step  # monthly (28–31 days) and 16-day data are
    phase = 2 * np.pi * harmonics * (times - times[0]) / period
    s = np.linalg.svd(np.stack([np.cos(phase), np.sin(phase)], axis=1), compute_uv=False)
    if not regular and s[-1] >= ALIAS_RATIO * s[0]:
        return  # irregular sampling whose phases cover the cycle determines it
    resolved = int(np.ceil(period / (2 * step))) - 1  # the largest k with period / k > 2 step
    what = unit.split(" since ")[0] if unit else "obs-coordinate units"
    if resolved >= 1:
        fix = f"set design.harmonics to at most {resolved}, or use finer data"
    else:
        fix = (
            "use a design these data determine, e.g. {impl: polynomial, degree: 1}, or set "
            "design.period to a cycle longer than twice the spacing"
        )
    raise InputError(
        f"the observations are too far apart for harmonic {harmonics} of a {period:g}-"
        f"{what.removesuffix('s')} "
        f"period: they alias onto slower terms instead of being fitted",
        stage="design/harmonic",
        expected=f"observations less than half of {period / harmonics:g} {what} apart "
        f"(the period of harmonic {harmonics})",
        found=f"a median spacing of {step:g} {what}",
        fix=fix,
    )


def run_random(
    config: RandomDesign, inputs: Mapping[str, Artifact], ctx: StageContext
) -> StageOutput:
    """A seeded standard-normal matrix (obs × coef)."""
    n_obs = LoadMeta.of(inputs["load"]).n_obs
    A = np.random.default_rng(config.seed).standard_normal((n_obs, config.coef))
    return _output(
        A,
        [f"c{i}" for i in range(config.coef)],
        {"basis": "random", "seed": config.seed, "column_units": ["1"] * config.coef},
    )


def describe(meta: Mapping[str, Any]) -> str:
    """The design's size and conditioning, for the run log."""
    return DesignMeta.of(meta).describe()


for _impl, _cfg, _fn, _summary in (
    ("variable", VariableDesign, run_variable, "design matrix from a file variable"),
    ("polynomial", PolynomialDesign, run_polynomial, "polynomial in scaled time"),
    ("harmonic", HarmonicDesign, run_harmonic, "mean, trend and harmonics"),
    ("random", RandomDesign, run_random, "seeded Gaussian matrix"),
):
    register(
        StageDecl(
            kind="design",
            impl=_impl,
            version=VERSION,
            config=_cfg,
            run=_fn,
            inputs=("load",),
            outputs=OUTPUTS,
            describe=describe,
            summary=_summary,
        )
    )


register_none(
    "design",
    NoDesign,
    VERSION,
    "no design: the solve fits a function of its own (solve impl curvefit)",
)
