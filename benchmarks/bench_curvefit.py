"""Per-pixel nonlinear curve fitting (issue 31): gridsolve's batched Levenberg–Marquardt
beside xarray's ``DataArray.curvefit`` and a plain loop of scipy's ``curve_fit``.

The cube: 250,000 pixels × 50 dates over one year (day of year), float64, an NDVI
season per pixel, f(t, p) = base + amp·(σ((t − sos)/8) − σ((t − eos)/8)) with σ the
logistic function (4 parameters, each identifiable: level, amplitude, start and end
of season), seeded true parameters per pixel (base 0.1–0.3, amplitude 0.3–0.6,
start day 100–140, end day 250–290), Gaussian noise σ = 0.02, 20 % of the
observations NaN, the same start p0 for every pixel.

Rows, side by side in one run (median and min–max over repeats):

1. gridsolve on every pixel: the curvefit stage's chunked fit (``fit_pixels``: batched
   Levenberg–Marquardt chunk by chunk), numpy arrays in memory to numpy results, with the
   Jacobian eager (``compile: never``; ``auto`` too below a million pixels, the default
   size) and
   compiled (``compile: always``: its first call, compile included, and the median of the
   later calls of the process, which reuse the compiled Jacobian; timed after the eager
   rows, not alternated with them);
2. xarray ``DataArray.curvefit(skipna=True)`` (scipy ``curve_fit`` per pixel) on a
   subset laid out as a (y, x) grid, extrapolated linearly to every pixel;
3. a plain Python loop of ``scipy.optimize.curve_fit(method="lm")`` on the same
   subset, extrapolated;
4. one Jacobian of the batched model over every pixel (``Problem.weighted_jacobian``,
   as the fit's ``refresh_jacobian`` evaluates it), alternated with row 1, and the
   time per LM step: row 1 / the mean over pixels of ``n_iter`` (the steps a pixel took).

Targets: ≥ 300× faster than xarray; an LM iteration ≤ 3× one Jacobian (both for the
eager fit, what ``compile: auto`` runs at this size; the compiled fit's ratio to xarray is
printed beside). Checked on the subset: the converged pixels' parameters against
curve_fit's from the same start, and the compiled fit's against the eager one (printed,
not enforced). ``--profile``: where one fit's time goes (cProfile).

Usage: python benchmarks/bench_curvefit.py [--pixels N] [--peer-pixels K] [--repeats R]
       [--peer-repeats R] [--profile]
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import math
import pstats
import statistics
import time
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import xarray as xr
from scipy.optimize import OptimizeWarning, curve_fit

from gridsolve.schemas.kinds.solve import CurvefitSolve
from gridsolve.stages.solve.curvefit import CHUNK_PIXELS, fit_pixels
from gridsolve.stages.solve.levmar_problem import problem
from gridsolve.stages.solve.levmar_status import FitStatus

from common import machine, median_pair_seconds, median_seconds, print_verdicts

N_OBS = 50
T = np.linspace(1.0, 365.0, N_OBS)  # day of year, 50 dates over one year
P0 = np.array([0.2, 0.45, 120.0, 270.0])  # base, amplitude, start, end of season
NAMES = ("base", "amp", "sos", "eos")
SLOPE = 8.0  # days


def season(t: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """The double logistic for ONE pixel: t (obs,), p (4,) → (obs,)."""
    return p[0] + p[1] * (torch.sigmoid((t - p[2]) / SLOPE) - torch.sigmoid((t - p[3]) / SLOPE))


def season_np(t: np.ndarray, base: float, amp: float, sos: float, eos: float) -> np.ndarray:
    """The same model for scipy (xarray reads the parameter names from this signature)."""
    up = 1.0 / (1.0 + np.exp(-(t - sos) / SLOPE))
    down = 1.0 / (1.0 + np.exp(-(t - eos) / SLOPE))
    out: np.ndarray = base + amp * (up - down)
    return out


def cube(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(pixel, obs) NDVI with 20 % NaN, and the true parameters (pixel, 4)."""
    rng = np.random.default_rng(seed)
    truth = rng.uniform([0.1, 0.3, 100.0, 250.0], [0.3, 0.6, 140.0, 290.0], (n, 4))
    y = season_np(T[None, :], *(truth[:, k : k + 1] for k in range(4)))
    y = y + rng.normal(0.0, 0.02, y.shape)
    y[rng.random(y.shape) < 0.2] = np.nan
    return y, truth


class Recorded:
    """``fn`` that keeps each call's wall time and its last result, for the spread
    (the medians come from common's ``median_seconds`` / ``median_pair_seconds``)."""

    def __init__(self, fn: Callable[[], Any], warmup: int = 1) -> None:
        self.fn, self.warmup = fn, warmup
        self.times: list[float] = []
        self.last: Any = None

    def __call__(self) -> Any:
        t0 = time.perf_counter()
        self.last = self.fn()
        self.times.append(time.perf_counter() - t0)
        return self.last

    def spread(self, scale: float = 1.0) -> tuple[float, float]:
        ts = self.times[self.warmup :]
        return min(ts) * scale, max(ts) * scale


#: The stage's config of this fit (fit_pixels reads its tolerances and chunking).
CONFIG = CurvefitSolve(
    target="bench_curvefit:season",
    params=list(NAMES),
    p0=dict(zip(NAMES, P0.tolist(), strict=True)),
)


def gridsolve_fit(y: np.ndarray, compile: str = "never") -> dict[str, np.ndarray]:
    """End to end: numpy arrays in memory → the curvefit stage's chunked fit → numpy results
    (``compile``: the config's; compiled once per process, reused by later calls)."""
    config = CONFIG.model_copy(update={"compile": compile})
    return fit_pixels(season, torch.from_numpy(T), y, torch.from_numpy(P0), config)


def jacobian(y: np.ndarray) -> Callable[[], list[torch.Tensor]]:
    """One Jacobian of every pixel at the start, as the fit's ``refresh_jacobian`` takes it
    (``Problem.weighted_jacobian``: vmap(jacfwd(f)) times √w, 0 where not valid), in the
    stage's chunks of ``CHUNK_PIXELS`` (one batch of every pixel pays fresh memory)."""
    chunks = []
    for lo in range(0, y.shape[0], CHUNK_PIXELS):
        part = torch.from_numpy(np.ascontiguousarray(y[lo : lo + CHUNK_PIXELS]))
        prob, u0 = problem(
            season, torch.from_numpy(T), part, torch.from_numpy(P0), None, None, None, "auto"
        )
        chunks.append((prob, u0, torch.arange(part.shape[0])))
    return lambda: [prob.weighted_jacobian(u0[i], i) for prob, u0, i in chunks]


def xarray_fit(da: xr.DataArray) -> np.ndarray:
    """xarray's curvefit over the (time, y, x) grid: (y, x, param)."""
    p0 = dict(zip(NAMES, P0.tolist(), strict=True))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", OptimizeWarning)
        fit = da.curvefit("time", season_np, skipna=True, p0=p0)
    out: np.ndarray = fit["curvefit_coefficients"].values
    return out


def scipy_loop(y: np.ndarray) -> np.ndarray:
    """curve_fit(method="lm") pixel by pixel over the valid observations; NaN where it raised."""
    out = np.full((y.shape[0], len(P0)), np.nan)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", OptimizeWarning)
        for i, row in enumerate(y):
            ok = np.isfinite(row)
            with contextlib.suppress(RuntimeError):  # it gave up: NaN
                out[i] = curve_fit(season_np, T[ok], row[ok], p0=P0, method="lm")[0]
    return out


def grid_shape(k: int) -> tuple[int, int]:
    """(y, x) with y·x = k, as square as k allows."""
    ny = math.isqrt(k)
    while k % ny:
        ny -= 1
    return ny, k // ny


def rel_diff(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.max(np.abs(a - b) / np.abs(b), initial=0.0))


def profile_fit(y: np.ndarray) -> None:
    """Cumulative seconds of the fit's parts over one run (cProfile; it slows torch calls little)."""
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    gridsolve_fit(y)
    prof.disable()
    total = time.perf_counter() - t0
    wanted = [
        "refresh_jacobian",
        "weighted_jacobian",
        "qr_of_jacobian",
        "trial_step",
        "lmpar",
        "_gauss_newton",
        "_lmpar_iteration",
        "_damped",
        "residuals",
        "_finish",
        "covariance",
    ]
    found: dict[str, tuple[int, float]] = {}
    for (file, _, name), row in pstats.Stats(prof).stats.items():  # type: ignore[attr-defined]
        if name in wanted and "levmar" in file:
            calls, cum = found.get(name, (0, 0.0))
            found[name] = (calls + row[0], cum + row[3])
    print(f"\n## where one fit's time goes (cProfile, {total:.1f} s under the profiler)")
    for name in wanted:
        if name in found:
            calls, cum = found[name]
            print(f"  {name:<20}{cum:8.2f} s  {100 * cum / total:5.1f} %  {calls} calls")


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--pixels", type=int, default=250_000)
    p.add_argument("--peer-pixels", type=int, default=2000, help="subset the peers fit")
    p.add_argument("--repeats", type=int, default=3, help="gridsolve's (after one warm-up)")
    p.add_argument("--peer-repeats", type=int, default=3)
    p.add_argument("--profile", action="store_true", help="also profile one gridsolve fit")
    args = p.parse_args()
    print(machine())
    print(f"torch threads: {torch.get_num_threads()} (as the machine gives them)")

    n = args.pixels
    y, _ = cube(n)
    k = min(args.peer_pixels, n)
    pick = np.sort(np.random.default_rng(1).choice(n, k, replace=False))
    sub = np.ascontiguousarray(y[pick])
    ny, nx = grid_shape(k)
    da = xr.DataArray(sub.T.reshape(N_OBS, ny, nx), dims=("time", "y", "x"), coords={"time": T})
    print(
        f"\n## double logistic (4 params), {n:,} pixels × {N_OBS} dates, float64, "
        f"{np.isnan(y).mean():.0%} NaN, σ = 0.02; peers on {k:,} pixels ({ny}×{nx} grid), "
        "extrapolated linearly"
    )

    # rows 1 and 4: the fit and one Jacobian of every pixel, alternately
    fit = Recorded(lambda: gridsolve_fit(y))
    jac = Recorded(jacobian(y))
    fit_s, jac_s = median_pair_seconds(fit, jac, args.repeats)
    out = fit.last
    jac.last = None
    t0 = time.perf_counter()
    out_c = gridsolve_fit(y, "always")
    first_c = time.perf_counter() - t0
    fit_c = Recorded(lambda: gridsolve_fit(y, "always"), warmup=0)
    fit_c_s = median_seconds(fit_c, args.repeats, warmup=0)
    n_iter = out["n_iter"]
    passes = int(n_iter.max())
    converged = out["status"] == int(FitStatus.CONVERGED)
    rel_c = rel_diff(out_c["params"][converged], out["params"][converged])

    # rows 2 and 3: the peers on the subset
    xr_run = Recorded(lambda: xarray_fit(da))
    xr_s = median_seconds(xr_run, args.peer_repeats)
    loop = Recorded(lambda: scipy_loop(sub))
    loop_s = median_seconds(loop, args.peer_repeats)
    scale = n / k

    ref = loop.last
    xr_params = xr_run.last.reshape(k, len(P0))
    both = converged[pick] & np.isfinite(ref).all(axis=1)
    rel = rel_diff(out["params"][pick][both], ref[both])
    same = np.isfinite(xr_params).all(axis=1) & np.isfinite(ref).all(axis=1)
    rel_xr = rel_diff(xr_params[same], ref[same])

    # most pixels stop after a few steps and the loop's later passes touch few: per
    # pixel, the fit costs mean(n_iter) steps, each timed against one Jacobian of all
    per_iter = fit_s / float(n_iter.mean())
    rows = [
        (
            "gridsolve curvefit (chunked)",
            fit_s,
            fit.spread(),
            f"all {n:,} pixels, median of {args.repeats}",
        ),
        (
            "gridsolve curvefit, compiled",
            fit_c_s,
            fit_c.spread(),
            f"later calls; the first {first_c:.1f} s (compiles)",
        ),
        (
            "xarray curvefit(skipna=True)",
            xr_s * scale,
            xr_run.spread(scale),
            f"{k:,} px in {xr_s:.2f} s ×{scale:,.0f}",
        ),
        (
            "scipy curve_fit loop (lm)",
            loop_s * scale,
            loop.spread(scale),
            f"{k:,} px in {loop_s:.2f} s ×{scale:,.0f}",
        ),
        (
            "one Jacobian, every pixel",
            jac_s,
            jac.spread(),
            "weighted_jacobian, vmap(jacfwd), in chunks",
        ),
        (
            "one LM step (fit / mean n_iter)",
            per_iter,
            fit.spread(1 / float(n_iter.mean())),
            f"mean n_iter {n_iter.mean():.1f}",
        ),
    ]
    print(f"{'':<33}{'median s':>10}  {'range s':<17}{'pixels/s':>12}  note")
    for name, sec, (lo, hi), note in rows:
        print(f"{name:<33}{sec:10.3f}  {f'{lo:.3f}–{hi:.3f}':<17}{n / sec:12,.0f}  {note}")
    print(
        f"n_iter over pixels: median {statistics.median(n_iter.tolist()):.0f}, "
        f"max {passes}, mean {n_iter.mean():.1f}; converged {converged.sum():,} of {n:,}"
    )
    print(
        f"check on the {k:,} subset: max rel. diff of params vs curve_fit (lm, same p0), "
        f"{both.sum():,} pixels converged in both: {rel:.1e} (expected ≤ 1e-6: "
        f"{'yes' if rel <= 1e-6 else 'NO'}); xarray vs the loop: {rel_xr:.1e}"
    )
    print(
        f"compiled vs eager fit: max rel. diff of the converged params {rel_c:.1e}; "
        f"xarray / compiled = {xr_s * scale / fit_c_s:.1f}× (first call "
        f"{xr_s * scale / first_c:.1f}×)"
    )
    print(
        f"xarray / gridsolve = {xr_s * scale / fit_s:.1f}×, loop / gridsolve = "
        f"{loop_s * scale / fit_s:.1f}×, LM iteration / Jacobian = {per_iter / jac_s:.2f}×"
    )
    print_verdicts(
        [
            ("curvefit xarray/gridsolve", xr_s * scale / fit_s, 300, "≥"),
            ("curvefit LM iteration/Jacobian", per_iter / jac_s, 3, "≤"),
        ]
    )
    if args.profile:
        del out, fit.last
        profile_fit(y)


if __name__ == "__main__":
    main()
