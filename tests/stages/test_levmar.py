"""The batched Levenberg–Marquardt fit (stages/solve/levmar.py) against scipy's curve_fit.

Oracle: ``scipy.optimize.curve_fit(method="lm")`` pixel by pixel from the same start,
as users call it (forward-difference Jacobian, MINPACK's ``lmdif``) and with the
exact Jacobian (``jac=``, MINPACK's ``lmder``: the very iteration gridsolve batches,
so the two agree to rounding). The Jacobians given to scipy are written out by
hand here, not taken from torch.

Covariance: gridsolve's is ``(JᵀJ)⁻¹·cost/(n − p)`` at its solution. curve_fit
applies the same formula to the last Jacobian MINPACK computed, which is the
Jacobian at the point *before* the last accepted step; with the default
tolerances that point differs enough to move pcov by up to ~2e-3 (relative) in
this cube's poorly determined parameters. So the covariance is checked against
curve_fit's formula evaluated at curve_fit's own solution (1e-5), and against
curve_fit's pcov itself with tolerances tight enough that its last step is
negligible (1e-5).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch
from my_curves import season
from scipy.optimize import curve_fit

from gridsolve.stages.engine.outputs import flag_attrs
from gridsolve.stages.solve.levmar import LMResult, fit_batched
from gridsolve.stages.solve.levmar_status import FIT_STATUS_FLAGS, FitStatus

from testkit import season_jac, season_np

T = np.linspace(0.0, 365.0, 46)  # 8-day composites over a year
P0_SEASON = np.array([0.2, 0.5, 0.08, 120.0, 0.07, 275.0])
REGULAR, FLAT, SPARSE = 180, 10, 10  # pixels of the season cube, in this order


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def recovery(t: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """Exponential recovery after a disturbance: level p[0], depth p[1], time scale p[2]."""
    return p[0] - p[1] * torch.exp(-t / p[2])


def recovery_np(t: np.ndarray, *p: float) -> np.ndarray:
    out: np.ndarray = p[0] - p[1] * np.exp(-t / p[2])
    return out


def recovery_jac(t: np.ndarray, *p: float) -> np.ndarray:
    ex = np.exp(-t / p[2])
    return np.stack([np.ones_like(t), -ex, -p[1] * ex * t / p[2] ** 2], axis=1)


@dataclass(frozen=True)
class Scipy:
    """curve_fit per pixel: params and pcov (NaN where it raised), ok where it converged."""

    params: np.ndarray
    pcov: np.ndarray
    ok: np.ndarray


def scipy_per_pixel(
    f: Callable[..., np.ndarray], t: np.ndarray, y: np.ndarray, p0: np.ndarray, **kw: Any
) -> Scipy:
    n = p0.shape[-1]
    starts = np.broadcast_to(p0, (y.shape[0], n))
    params = np.full((y.shape[0], n), np.nan)
    pcov = np.full((y.shape[0], n, n), np.nan)
    ok = np.zeros(y.shape[0], dtype=bool)
    for i, row in enumerate(y):
        v = np.isfinite(row)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                params[i], pcov[i] = curve_fit(f, t[v], row[v], p0=starts[i], method="lm", **kw)
            ok[i] = True
        except RuntimeError:
            pass
    return Scipy(params, pcov, ok)


def pcov_at(
    f: Callable[..., np.ndarray], jac: Callable[..., np.ndarray], t: np.ndarray, y: np.ndarray, p
) -> np.ndarray:
    """curve_fit's covariance formula, (JᵀJ)⁻¹·cost/(m − n), at ``p`` per pixel (float64)."""
    out = np.full(p.shape + p.shape[-1:], np.nan)
    for i, row in enumerate(y):
        v = np.isfinite(row)
        J = jac(t[v], *p[i])
        r = row[v] - f(t[v], *p[i])
        out[i] = np.linalg.inv(J.T @ J) * (r @ r) / (v.sum() - p.shape[-1])
    return out


def rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.max(np.abs(a - b) / np.abs(b), initial=0.0))


def cov_rel(a: np.ndarray, b: np.ndarray) -> float:
    """Largest |Δcov_ij| / √(cov_ii cov_jj): relative, also for near-zero off-diagonals."""
    sd = np.sqrt(np.einsum("...ii->...i", b))
    return float(np.max(np.abs(a - b) / (sd[..., :, None] * sd[..., None, :])))


def season_cube(seed: int = 0) -> np.ndarray:
    """(pixel, obs) NDVI: 180 seasons with 20 % gaps, 10 without a season, 10 with 75 % gaps."""
    rng = np.random.default_rng(seed)
    n = REGULAR + FLAT + SPARSE
    lo, hi = np.array([0.1, 0.3, 0.05, 100, 0.04, 250]), np.array([0.3, 0.6, 0.12, 140, 0.1, 300])
    truth = rng.uniform(lo, hi, (n, 6))
    truth[REGULAR : REGULAR + FLAT, 1] = 0.0
    y = np.stack([season_np(T, *p) for p in truth]) + rng.normal(0, 0.03, (n, T.size))
    gaps = rng.random(y.shape) < 0.2
    gaps[REGULAR + FLAT :] = rng.random((SPARSE, T.size)) < 0.75
    return np.where(gaps, np.nan, y)


@dataclass(frozen=True)
class Fits:
    y: np.ndarray
    ours: dict[str, np.ndarray]
    fd: Scipy  # curve_fit as users call it: forward differences (lmdif)
    exact: Scipy  # curve_fit with the exact Jacobian (lmder), same iteration limit


@pytest.fixture(scope="module")
def season_fits() -> Fits:
    y = season_cube()
    # fewer trial steps than the default 700 keep the seasonless pixels (which never
    # converge) short; the regular ones need at most 30. MINPACK's maxfev also counts
    # the first evaluation.
    limit = 200
    ours = fit_batched(
        season, torch.tensor(T), torch.tensor(y), torch.tensor(P0_SEASON), max_iter=limit
    )
    return Fits(
        y,
        ours.arrays(),
        scipy_per_pixel(season_np, T, y, P0_SEASON),
        scipy_per_pixel(season_np, T, y, P0_SEASON, jac=season_jac, maxfev=limit + 1),
    )


def test_the_season_cube_has_gaps_failures_and_successes(season_fits: Fits) -> None:
    n_valid = season_fits.ours["n_valid"]
    assert 0.7 < n_valid[:REGULAR].mean() / T.size < 0.9
    assert len(set(map(tuple, np.isnan(season_fits.y)))) == season_fits.y.shape[0]
    # a comparison with no failure would prove nothing about flagging them
    assert (~season_fits.exact.ok).any() and (~season_fits.fd.ok).any()
    assert season_fits.exact.ok[:REGULAR].all() and season_fits.fd.ok[:REGULAR].all()


def test_season_is_minpacks_iteration_with_the_same_jacobian(season_fits: Fits) -> None:
    ours, ref = season_fits.ours, season_fits.exact
    assert (ours["status"][:REGULAR] == FitStatus.CONVERGED).all()
    assert rel(ours["params"][:REGULAR], ref.params[:REGULAR]) < 1e-6
    # every pixel MINPACK gives up on (iteration limit, here the seasonless ones) is flagged
    assert (ours["status"][~ref.ok] != FitStatus.CONVERGED).all()
    assert (ours["status"][~ref.ok] == FitStatus.ITERATION_LIMIT).all()


def test_season_matches_curve_fit_as_users_call_it(season_fits: Fits) -> None:
    ours, fd, exact = season_fits.ours, season_fits.fd, season_fits.exact
    y, reg = season_fits.y[:REGULAR], slice(0, REGULAR)
    assert rel(ours["params"][reg], fd.params[reg]) < 1e-6
    oracle = pcov_at(season_np, season_jac, T, y, fd.params[reg])
    assert cov_rel(ours["covariance"][reg], oracle) < 1e-5
    stderr = np.sqrt(np.diagonal(oracle, 0, 1, 2))
    np.testing.assert_allclose(ours["param_stderr"][reg], stderr, rtol=1e-5)
    # where curve_fit's finite differences give up but gridsolve converged, curve_fit
    # with the exact Jacobian converges too, to the same parameters: the difference is
    # the path finite differences take on an ill-posed pixel, not a false convergence
    disputed = ~fd.ok & (ours["status"] == FitStatus.CONVERGED)
    assert exact.ok[disputed].all()
    assert rel(ours["params"][disputed], exact.params[disputed]) < 1e-6


def test_covariance_is_curve_fits_pcov_when_its_last_step_is_negligible() -> None:
    y = season_cube()[:40]
    tight = {"xtol": 1e-13, "ftol": 1e-13}
    ours = fit_batched(season, torch.tensor(T), torch.tensor(y), torch.tensor(P0_SEASON), **tight)
    ref = scipy_per_pixel(season_np, T, y, P0_SEASON, jac=season_jac, **tight)
    assert ref.ok.all()
    assert cov_rel(ours.covariance.numpy(), ref.pcov) < 1e-5


def test_recovery_with_per_pixel_starts_matches_curve_fit() -> None:
    rng = np.random.default_rng(1)
    t = np.arange(0.0, 60.0, 1.25)
    truth = rng.uniform([0.6, 0.2, 5.0], [0.9, 0.6, 25.0], (120, 3))
    y = np.stack([recovery_np(t, *p) for p in truth]) + rng.normal(0, 0.02, (120, t.size))
    y[rng.random(y.shape) < 0.2] = np.nan
    # a start per pixel from its data: last level, depth below it, a fixed time scale
    level = np.nanmean(y[:, -8:], axis=1)
    p0 = np.stack([level, level - np.nanmean(y[:, :8], axis=1), np.full(120, 10.0)], axis=1)
    ours = fit_batched(recovery, torch.tensor(t), torch.tensor(y), torch.tensor(p0)).arrays()
    fd = scipy_per_pixel(recovery_np, t, y, p0)
    exact = scipy_per_pixel(recovery_np, t, y, p0, jac=recovery_jac, maxfev=401)
    assert fd.ok.all() and exact.ok.all()
    assert (ours["status"] == FitStatus.CONVERGED).all()
    assert rel(ours["params"], fd.params) < 1e-6
    assert rel(ours["params"], exact.params) < 1e-6
    assert cov_rel(ours["covariance"], pcov_at(recovery_np, recovery_jac, t, y, fd.params)) < 1e-5


def test_weights_are_inverse_variances_like_curve_fits_sigma() -> None:
    rng = np.random.default_rng(2)
    t = np.arange(0.0, 60.0, 2.0)
    sigma = rng.uniform(0.01, 0.05, (3, t.size))
    y = recovery_np(t, 0.8, 0.4, 12.0) + rng.normal(0, 1, (3, t.size)) * sigma
    p0 = np.array([0.7, 0.3, 8.0])
    for absolute in (False, True):
        ours = fit_batched(
            recovery,
            torch.tensor(t),
            torch.tensor(y),
            torch.tensor(p0),
            weights=torch.tensor(sigma**-2),
            absolute_sigma=absolute,
            xtol=1e-13,
            ftol=1e-13,
        )
        for i in range(3):
            popt, pcov = curve_fit(
                recovery_np, t, y[i], p0=p0, sigma=sigma[i], absolute_sigma=absolute,
                method="lm", jac=recovery_jac, xtol=1e-13, ftol=1e-13,
            )  # fmt: skip
            assert rel(ours.params[i].numpy(), popt) < 1e-8
            assert cov_rel(ours.covariance[i].numpy(), pcov) < 1e-6


def _fit(f: Callable[..., torch.Tensor], y: np.ndarray, p0: list[float], **kw: Any) -> LMResult:
    t = torch.arange(y.shape[-1], dtype=torch.float64)
    return fit_batched(f, t, torch.tensor(y), torch.tensor(p0, dtype=torch.float64), **kw)


def _line(t: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    return p[0] + p[1] * torch.exp(-t / p[2])


def _exact(n_obs: int) -> np.ndarray:
    """``_line`` at (1, 2, 3) on 0 … n_obs − 1, float64."""
    return _line(torch.arange(n_obs, dtype=torch.float64), torch.tensor([1.0, 2.0, 3.0])).numpy()


def test_too_few_observations_and_all_missing_are_not_fitted() -> None:
    y = np.tile(_exact(10), (4, 1))
    y[1, 2:] = np.nan  # 2 valid < 3 parameters
    y[2, :] = np.nan
    mask = np.ones_like(y, dtype=bool)
    mask[3, 3:] = False  # exactly 3 valid: fitted, but no degrees of freedom for σ²
    r = _fit(_line, y, [1.5, 1.5, 2.0], mask=torch.tensor(mask))
    assert r.status.tolist() == [
        FitStatus.CONVERGED, FitStatus.TOO_FEW_OBSERVATIONS, FitStatus.ALL_MISSING,
        FitStatus.CONVERGED,
    ]  # fmt: skip
    assert r.n_valid.tolist() == [10, 2, 0, 3]
    assert torch.isnan(r.params[1:3]).all() and torch.isnan(r.covariance[1:3]).all()
    assert torch.isnan(r.cost[1:3]).all() and (r.n_iter[1:3] == 0).all()
    np.testing.assert_allclose(r.params[[0, 3]].numpy(), [[1.0, 2.0, 3.0]] * 2, rtol=1e-7)
    assert torch.isnan(r.covariance[3]).all() and torch.isfinite(r.covariance[0]).all()


def test_a_parameter_without_effect_is_singular_with_nan_covariance() -> None:
    def ignores_p2(t: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        return p[0] * torch.exp(-t / p[1]) + 0 * p[2]

    y = np.exp(-np.arange(12.0) / 4.0) * 3 + np.random.default_rng(3).normal(0, 0.01, 12)
    r = _fit(ignores_p2, y[None], [2.0, 3.0, 5.0])
    assert r.status.tolist() == [FitStatus.SINGULAR]
    assert torch.isnan(r.covariance).all() and torch.isnan(r.param_stderr).all()
    assert torch.isfinite(r.params).all() and r.params[0, 2] == 5.0


def test_the_iteration_limit_is_flagged() -> None:
    y = _exact(20)[None]
    r = _fit(_line, y, [0.0, 1.0, 10.0], max_iter=1)
    assert r.status.tolist() == [FitStatus.ITERATION_LIMIT] and r.n_iter.tolist() == [1]
    assert r.reason.tolist() == [5]


def test_a_model_not_finite_at_the_start_is_flagged() -> None:
    y = np.tile(np.linspace(1, 2, 8), (2, 1))
    r = _fit(lambda t, p: p[0] * torch.log(p[1] * (t + 1)), y, [1.0, -1.0])
    assert (r.status == FitStatus.MODEL_NOT_FINITE).all()
    assert torch.isnan(r.params).all()


def test_a_solution_outside_the_bounds_stops_at_the_bound() -> None:
    y = np.stack([_exact(30)] * 2)
    y += np.random.default_rng(4).normal(0, 0.01, y.shape)
    free = _fit(_line, y, [1.5, 1.5, 2.0])
    inside = _fit(_line, y, [1.5, 1.5, 2.0], bounds=([0.0, 0.0, 1.0], [5.0, np.inf, 10.0]))
    capped = _fit(_line, y, [1.5, 1.5, 2.0], bounds=([-np.inf, 0.0, 0.0], [np.inf, 1.5, 10.0]))
    assert (inside.status == FitStatus.CONVERGED).all()
    np.testing.assert_allclose(inside.params.numpy(), free.params.numpy(), rtol=1e-6)
    np.testing.assert_allclose(inside.covariance.numpy(), free.covariance.numpy(), rtol=1e-4)
    assert (capped.status == FitStatus.AT_BOUND).all()
    np.testing.assert_allclose(capped.params[:, 1].numpy(), 1.5, rtol=1e-6)


def test_float32_fits_to_its_precision() -> None:
    y = season_cube(5)[:30]
    args = (season, torch.tensor(T, dtype=torch.float32), torch.tensor(y, dtype=torch.float32))
    r32 = fit_batched(*args, torch.tensor(P0_SEASON, dtype=torch.float32))
    r64 = fit_batched(season, torch.tensor(T), torch.tensor(y), torch.tensor(P0_SEASON))
    assert r32.params.dtype == torch.float32 and r32.covariance.dtype == torch.float32
    both = r32.converged() & r64.converged()
    assert both.sum() >= 27
    # float32's default tolerances (√eps32) stop within a fraction of a standard error
    sd = r64.param_stderr[both]
    assert ((r32.params[both].double() - r64.params[both]).abs() < 0.2 * sd).all()
    np.testing.assert_allclose(r32.param_stderr[both].double(), sd, rtol=0.05)


def test_the_same_input_gives_bit_identical_output() -> None:
    y = torch.tensor(season_cube(6)[:50])
    runs = [fit_batched(season, torch.tensor(T), y, torch.tensor(P0_SEASON)) for _ in range(2)]
    for name, a in runs[0].arrays().items():
        np.testing.assert_array_equal(a, runs[1].arrays()[name], err_msg=name)


def test_a_mask_is_the_same_as_nan() -> None:
    y = season_cube(7)[:20]
    mask = np.isfinite(y)
    filled = np.where(mask, y, 123.0)
    a = fit_batched(season, torch.tensor(T), torch.tensor(y), torch.tensor(P0_SEASON))
    b = fit_batched(
        season,
        torch.tensor(T),
        torch.tensor(filled),
        torch.tensor(P0_SEASON),
        mask=torch.tensor(mask),
    )
    for name, arr in a.arrays().items():
        np.testing.assert_array_equal(arr, b.arrays()[name], err_msg=name)


def test_bad_arguments_say_what_was_expected() -> None:
    t, y = torch.arange(5.0), torch.ones(2, 5)
    with pytest.raises(ValueError, match="n_obs=5"):
        fit_batched(_line, torch.arange(4.0), y, torch.ones(3))
    with pytest.raises(ValueError, match="p0 must be"):
        fit_batched(_line, t, y, torch.ones(3, 3))
    with pytest.raises(ValueError, match="float32 or float64"):
        fit_batched(_line, t, torch.ones(5), torch.ones(3))
    with pytest.raises(ValueError, match="lower < upper"):
        fit_batched(_line, t, y, torch.ones(3), bounds=(1.0, 0.0))
    with pytest.raises(ValueError, match="weights"):
        fit_batched(_line, t, y, torch.ones(3), weights=-torch.ones(5))


def test_the_status_flags_are_cf_flags() -> None:
    attrs = flag_attrs("fit status", FIT_STATUS_FLAGS)
    assert attrs["flag_values"].tolist() == list(range(8))
    assert attrs["flag_meanings"].split()[:3] == [
        "converged",
        "all_missing",
        "too_few_observations",
    ]
    assert FIT_STATUS_FLAGS[5] == "singular"  # the linear solve's code for the same thing
