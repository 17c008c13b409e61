"""Per-pixel uncertainty of the solve (issue 15) against statsmodels, numpy.polyfit and xarray."""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import pytest
import scipy.stats
import statsmodels.api as sm

from gridsolve.schemas.contracts import STATUS_CODES
from gridsolve.schemas.kinds.design import PolynomialDesign, RandomDesign
from gridsolve.schemas.kinds.solve import LstsqSolve
from gridsolve.stages.solve.block import solve_block
from gridsolve.stages.solve.outputs import p_values, t_values
from gridsolve.stages.solve.prepared import make_operator

from testkit import Chain, make_ds

RANK_DEFICIENT, NO_DOF, NOT_SOLVED = 1, 2, 4


def solve(
    A: np.ndarray,
    B: np.ndarray,
    own: np.ndarray | None = None,
    sqrtw: np.ndarray | None = None,
    gaps: np.ndarray | None = None,
    **cfg: Any,
) -> tuple[dict[str, np.ndarray], dict[str, int]]:
    config = LstsqSolve(**{"dtype": "float64", "uncertainty": "cov", **cfg})
    op = make_operator(A, np.ones(A.shape[0]) if sqrtw is None else sqrtw, config)
    out = solve_block(B, op, config, own_weights=own, gap_patterns=gaps)
    arrays = dict(out.arrays)
    # t and p are derived where written (the writer calls t_values and p_values), checked here too
    assert "t_value" not in arrays and "p_value" not in arrays
    if "coef_stderr" in arrays:
        arrays["t_value"] = t_values(arrays["coefficients"], arrays["coef_stderr"])
        arrays["p_value"] = p_values(
            arrays["t_value"], arrays["dof"], scaled=config.cov_scale == "residual"
        )
    return arrays, out.meta["paths"]


def wls(A: np.ndarray, b: np.ndarray, w: np.ndarray | None = None, **fit: Any) -> Any:
    """statsmodels on the pixel's valid rows (it detects an implicit constant itself)."""
    w = np.ones(len(b)) if w is None else w
    ok = np.isfinite(b) & (w > 0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # rank-deficient designs are cases here, not mistakes
        return sm.WLS(b[ok], A[ok], weights=w[ok]).fit(**fit)


def assert_matches(out: dict[str, np.ndarray], j: int, res: Any, rtol: float = 1e-9) -> None:
    np.testing.assert_allclose(out["coef_stderr"][:, j], res.bse, rtol=rtol)
    np.testing.assert_allclose(out["t_value"][:, j], res.tvalues, rtol=rtol)
    np.testing.assert_allclose(out["p_value"][:, j], res.pvalues, rtol=1e3 * rtol, atol=1e-12)
    ref = res.cov_params()
    np.testing.assert_allclose(out["coef_cov"][:, :, j], ref, rtol=rtol, atol=rtol * abs(ref).max())
    assert out["dof"][j] == res.df_resid
    np.testing.assert_allclose(out["r2"][j], res.rsquared, rtol=rtol)
    assert out["uncertainty_flags"][j] == 0


def close(a: np.ndarray, b: np.ndarray, rtol: float) -> None:
    """Entries agree to ``rtol`` of the matrix's scale (off-diagonal zeros are rounding)."""
    np.testing.assert_allclose(a, b, rtol=rtol, atol=rtol * np.abs(b).max())


def cube(n: int = 30, px: int = 120, nan: float = 0.0, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    t = np.linspace(-1, 1, n)[:, None]
    B = 3.0 + 0.4 * t * rng.standard_normal(px) + 0.2 * rng.standard_normal((n, px))
    B[rng.random(B.shape) < nan] = np.nan
    return B


POLY = np.vander(np.linspace(-1, 1, 30), 4, increasing=True)


@pytest.mark.parametrize("policy", ["minnorm", "cholesky"])
@pytest.mark.parametrize("case", ["shared", "gappy", "own_weights", "shared_weights"])
def test_ols_and_wls_match_statsmodels_per_pixel(case: str, policy: str) -> None:
    rng = np.random.default_rng(1)
    B = cube(nan=0.0 if case == "shared" else 0.2)
    own = rng.random(B.shape) + 0.1 if case == "own_weights" else None
    w = np.linspace(0.2, 3.0, 30) if case == "shared_weights" else None
    if w is not None:
        B = cube()
    out, paths = solve(POLY, B, own, None if w is None else np.sqrt(w), policy=policy)
    assert paths["per_pixel" if case in ("gappy", "own_weights") else "shared"] > 0
    for j in range(B.shape[1]):
        assert_matches(out, j, wls(POLY, B[:, j], own[:, j] if own is not None else w))


def test_gappy_pixels_match_numpy_polyfit_cov() -> None:
    B = cube(nan=0.25, seed=3)
    t = np.linspace(-1, 1, 30)
    rng = np.random.default_rng(2)
    own = rng.random(B.shape) + 0.1
    for weights in (None, own):
        out, _ = solve(POLY, B, weights)
        for j in range(B.shape[1]):
            ok = np.isfinite(B[:, j])
            w = None if weights is None else np.sqrt(weights[ok, j])  # polyfit's w is 1/σ
            c, cov = np.polyfit(t[ok], B[ok, j], 3, w=w, cov=True)
            np.testing.assert_allclose(out["coefficients"][:, j], c[::-1], rtol=1e-9)
            close(out["coef_cov"][:, :, j], cov[::-1, ::-1], 1e-9)
            unscaled = np.polyfit(t[ok], B[ok, j], 3, w=w, cov="unscaled")[1]
            out_u, _ = solve(
                POLY,
                B[:, j : j + 1],
                None if weights is None else own[:, j : j + 1],
                cov_scale="unscaled",
            )
            close(out_u["coef_cov"][:, :, 0], unscaled[::-1, ::-1], 1e-9)


def test_unscaled_matches_statsmodels_fixed_scale_with_normal_p_values() -> None:
    B = cube(nan=0.2, seed=4)
    own = np.random.default_rng(5).random(B.shape) + 0.5
    out, _ = solve(POLY, B, own, cov_scale="unscaled")
    for j in range(B.shape[1]):
        res = wls(POLY, B[:, j], own[:, j], cov_type="fixed scale")
        np.testing.assert_allclose(out["coef_stderr"][:, j], res.bse, rtol=1e-9)
        np.testing.assert_allclose(out["p_value"][:, j], res.pvalues, rtol=1e-6, atol=1e-14)
        assert out["dof"][j] == res.df_resid


def test_shared_gap_pattern_path() -> None:
    from gridsolve.stages.load.patterns import common_patterns, full_hash, pattern_hash

    B = cube(px=200)
    B[[3, 17], :] = np.nan  # two time steps missing everywhere: one pattern
    gaps = common_patterns(pattern_hash(np.isfinite(B)), full_hash(30))
    out, paths = solve(POLY, B, gaps=gaps)
    assert paths["pattern"] == 200
    for j in range(0, 200, 7):
        assert_matches(out, j, wls(POLY, B[:, j]))


def test_shared_gap_pattern_under_cholesky_has_its_statistics() -> None:
    """A pattern whose Cholesky succeeds is full rank: its pixels get every statistic."""
    from gridsolve.stages.load.patterns import common_patterns, full_hash, pattern_hash

    B = cube(px=60)
    B[3, :] = np.nan  # one time step missing everywhere
    gaps = common_patterns(pattern_hash(np.isfinite(B)), full_hash(30))
    out, paths = solve(POLY, B, gaps=gaps, policy="cholesky")
    assert paths["pattern"] == 60
    assert (out["uncertainty_flags"] == 0).all()
    for j in range(0, 60, 7):
        assert_matches(out, j, wls(POLY, B[:, j]))


def test_ridge_variance_of_a_column_the_rows_do_not_see_is_zero_not_nan() -> None:
    """M⁻¹ − λM⁻² rounds below 0 for such a column: the stderr is 0, never NaN marked ok."""
    rng = np.random.default_rng(1)
    n = 30
    step = (np.arange(n) < 5).astype(float)  # non-zero only on rows every pixel misses
    A = np.column_stack([np.ones(n), np.linspace(0, 1, n), step])
    B = A @ rng.normal(size=(3, 400)) + 0.1 * rng.normal(size=(n, 400))
    B[:5] = np.nan
    B[rng.random(B.shape) < 0.2] = np.nan
    for lam in (0.2, 10.0):
        out, paths = solve(A, B, policy="ridge", ridge=lam)
        assert paths["per_pixel"] > 0
        assert np.isfinite(out["coef_stderr"]).all() and (out["coef_stderr"][2] >= 0).all()
        assert (out["coef_cov"][2, 2] >= 0).all()
        np.testing.assert_allclose(out["coef_stderr"][2], 0.0, atol=1e-7)
        assert (out["uncertainty_flags"] == 0).all()
        j = 0  # and the rest is still the documented sandwich
        ok = np.isfinite(B[:, j])
        cov, _ = ridge_oracle(A[ok], B[ok, j], lam)
        close(out["coef_cov"][:, :, j], cov, 1e-7)


def test_ill_conditioned_design() -> None:
    t = np.linspace(100.0, 140.0, 30)
    A = np.vander(t, 4, increasing=True)  # unscaled: κ ≈ 2e9
    rng = np.random.default_rng(6)
    B = 1 + 0.01 * t[:, None] + 0.1 * rng.standard_normal((30, 60))
    B[rng.random(B.shape) < 0.2] = np.nan
    for weights in (None, rng.random(B.shape) + 0.2):
        out, _ = solve(A, B, weights)
        for j in range(60):
            w = None if weights is None else weights[:, j]
            ok = np.isfinite(B[:, j])
            # float64 oracles: polyfit (scales its columns), statsmodels in a scaled basis
            _, cov = np.polyfit(
                t[ok], B[ok, j], 3, w=None if w is None else np.sqrt(w[ok]), cov=True
            )
            res = wls(np.vander((t - 120) / 20, 4, increasing=True), B[:, j], w)
            assert out["dof"][j] == res.df_resid
            np.testing.assert_allclose(out["r2"][j], res.rsquared, rtol=1e-9)
            # the leading coefficient is the same in both bases, up to 20³
            np.testing.assert_allclose(out["coef_stderr"][3, j], np.sqrt(cov[0, 0]), rtol=1e-5)
            np.testing.assert_allclose(out["coef_stderr"][3, j] * 20**3, res.bse[3], rtol=1e-5)
            np.testing.assert_allclose(out["p_value"][3, j], res.pvalues[3], rtol=1e-4)


def test_r2_is_uncentred_without_a_constant_in_the_span() -> None:
    rng = np.random.default_rng(7)
    A = rng.standard_normal((30, 3))  # no constant column, none in the span
    B = cube(nan=0.2, seed=8)
    out, _ = solve(A, B)
    for j in range(B.shape[1]):
        res = wls(A, B[:, j])
        assert res.k_constant == 0
        assert_matches(out, j, res)
    # …but a subset of rows on which a column is constant is centred, as statsmodels finds
    A2 = A.copy()
    A2[:15, 0] = 1.0
    B2 = cube(px=4, seed=9)
    B2[15:, :] = np.nan
    out2, _ = solve(A2, B2)
    for j in range(4):
        res = wls(A2, B2[:, j])
        assert res.k_constant == 1
        np.testing.assert_allclose(out2["r2"][j], res.rsquared, rtol=1e-9)


@pytest.mark.parametrize("path", ["fused", "apart", "apart-eager"])
def test_a_pixel_whose_rows_miss_the_constant_is_uncentred_under_unit_weights(
    path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The design spans the constant, so the moments skip the uncentred sum; a pixel whose
    solve still reports the constant outside its rows' span (an SVD fallback's numerical
    test; simulated here) gets the uncentred R², not a division by a sum never made.

    ``fused``: the compiled fit, every 7th pixel sent to the SVD fallback, which says
    its rows miss the constant; ``apart``: the separate passes (compiled, the fused fit
    refused), every 7th pixel's span set off after the solve; ``apart-eager``: the same
    on the eager path."""
    from gridsolve.stages.solve import kernel, linalg

    if path == "fused":
        if kernel.name() != "c":
            pytest.skip("no C compiler here: the apart case covers the eager path")
        real_fit, real_svd = kernel.fit, linalg._svd_solve

        def fit_some_bad(*args: Any, **kw: Any) -> Any:
            x, good, *rest = real_fit(*args, **kw)
            good[::7] = False
            return (x, good, *rest)

        def svd_off(*args: Any, **kw: Any) -> Any:
            x, spread, det = real_svd(*args, **kw)
            if spread is not None:
                spread.spans[:] = False
            return x, spread, det

        monkeypatch.setattr(kernel, "fit", fit_some_bad)
        monkeypatch.setattr(linalg, "_svd_solve", svd_off)
    else:
        if path == "apart-eager":
            monkeypatch.setenv(kernel.ENV, "eager")
            kernel._library.cache_clear()
        elif kernel.name() != "c":
            pytest.skip("no C compiler here: the apart-eager case covers the path")
        else:
            monkeypatch.setattr(linalg, "fit_unit", lambda *a, **k: None)
        real = linalg._solve_per_pixel

        def some_off(*args: Any, **kw: Any) -> Any:
            x, status, spread = real(*args, **kw)
            if spread is not None:
                spread.spans[::7] = False
            return x, status, spread

        monkeypatch.setattr(linalg, "_solve_per_pixel", some_off)
    try:
        B = cube(nan=0.2, seed=3)
        out, paths = solve(POLY, B, uncertainty="stderr")
    finally:
        monkeypatch.delenv(kernel.ENV, raising=False)
        kernel._library.cache_clear()
    assert paths["per_pixel"] > 100
    kinds = []
    for j in range(B.shape[1]):
        ok = np.isfinite(B[:, j])
        b = B[ok, j]
        r = b - POLY[ok] @ np.linalg.lstsq(POLY[ok], b, rcond=None)[0]
        centred = 1 - (r @ r) / ((b - b.mean()) @ (b - b.mean()))
        uncentred = 1 - (r @ r) / (b @ b)
        if np.isclose(out["r2"][j], centred, rtol=1e-9):
            kinds.append("centred")
        else:
            np.testing.assert_allclose(out["r2"][j], uncentred, rtol=1e-9)
            kinds.append("uncentred")
    assert 0 < kinds.count("uncentred") < len(kinds)


@pytest.mark.parametrize("path", ["c", "eager"])
@pytest.mark.parametrize("coef", [4, 10])
def test_fewer_valid_rows_than_coefficients_is_the_minimum_norm_fit(
    path: str, coef: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Such a pixel's normal equations are singular, whatever rounding does to the last
    pivot (it had passed the relative test: a fit that was not the minimum-norm one,
    dof −1, not flagged rank-deficient, status ok)."""
    from gridsolve.stages.solve import kernel

    if path == "c" and kernel.name() != "c":
        pytest.skip("no C compiler here: the eager case covers the path")
    monkeypatch.setenv(kernel.ENV, path)
    kernel._library.cache_clear()
    try:
        n, px = 30, 600
        A = np.random.default_rng(42).standard_normal((n, coef))
        rng = np.random.default_rng(0)
        B = np.full((n, px), np.nan)
        for j in range(px):
            B[rng.choice(n, coef - 1, replace=False), j] = rng.standard_normal(coef - 1) + 3.0
        if coef == 4:  # the gap pattern on which the pivot test had passed
            B[:, :8] = np.nan
            B[[2, 14, 20], :8] = rng.standard_normal((3, 8)) + 3.0
        out, paths = solve(A, B, uncertainty="stderr", min_valid=1)
    finally:
        monkeypatch.delenv(kernel.ENV)
        kernel._library.cache_clear()
    assert paths["per_pixel"] > 0
    assert (out["status"] == STATUS_CODES["underdetermined"]).all()
    assert (out["dof"] == 0).all()
    assert (out["uncertainty_flags"] & RANK_DEFICIENT).all()
    for j in range(px):
        ok = np.isfinite(B[:, j])
        want = np.linalg.lstsq(A[ok], B[ok, j], rcond=None)[0]
        np.testing.assert_allclose(out["coefficients"][:, j], want, rtol=1e-8, atol=1e-10)


def test_rank_deficient_minnorm_is_flagged_and_nan_where_not_identifiable() -> None:
    rng = np.random.default_rng(0)
    A = rng.standard_normal((12, 4))
    A[:, 3] = A[:, 0] + A[:, 1]  # c0, c1, c3 are not identifiable; c2 is
    B = cube(n=12, px=40, seed=10)
    for nan in (0.0, 0.2):
        Bn = B.copy()
        Bn[np.random.default_rng(11).random(B.shape) < nan] = np.nan
        out, _ = solve(A, Bn)
        solved = out["n_valid"] >= 4
        assert (out["uncertainty_flags"][solved] & RANK_DEFICIENT).all()
        assert np.isnan(out["coef_stderr"][[0, 1, 3]][:, solved]).all()
        for j in np.flatnonzero(solved):
            res = wls(A, Bn[:, j])  # pinv: numbers for every coefficient, meaningful for c2
            assert out["dof"][j] == res.df_resid == out["n_valid"][j] - 3
            np.testing.assert_allclose(out["coef_stderr"][2, j], res.bse[2], rtol=1e-8)
            np.testing.assert_allclose(out["p_value"][2, j], res.pvalues[2], rtol=1e-6)


@pytest.mark.parametrize("nan", [0.0, 0.2])
def test_coef_above_obs_minnorm_has_no_dof_and_no_identifiable_coefficient(nan: float) -> None:
    A = np.random.default_rng(0).standard_normal((12, 20))
    B = cube(n=12, px=30, nan=nan, seed=12)
    out, _ = solve(A, B)
    solved = out["n_valid"] > 0
    assert (out["dof"][solved] == 0).all()
    assert (out["uncertainty_flags"][solved] == RANK_DEFICIENT | NO_DOF).all()
    assert np.isnan(out["coef_stderr"]).all() and np.isnan(out["p_value"]).all()
    np.testing.assert_allclose(out["r2"][solved], 1.0, atol=1e-9)  # an exact fit


def ridge_oracle(X: np.ndarray, y: np.ndarray, lam: float) -> tuple[np.ndarray, float]:
    """σ²(XᵀX+λI)⁻¹XᵀX(XᵀX+λI)⁻¹ with σ² = RSS/(n − tr H): the documented ridge covariance."""
    M = np.linalg.inv(X.T @ X + lam * np.eye(X.shape[1]))
    c = M @ X.T @ y
    edf = np.trace(X @ M @ X.T)
    dof = len(y) - edf
    s2 = np.sum((y - X @ c) ** 2) / dof
    return s2 * M @ X.T @ X @ M, dof


@pytest.mark.parametrize("coef", [4, 20])  # primal and dual per-pixel forms
@pytest.mark.parametrize("nan", [0.0, 0.2])
def test_ridge_covariance_is_the_sandwich(coef: int, nan: float) -> None:
    rng = np.random.default_rng(13)
    n = 12
    A = rng.standard_normal((n, coef))
    B = cube(n=n, px=30, nan=nan, seed=14)
    own = rng.random(B.shape) + 0.2
    for weights in (None, own):
        out, _ = solve(A, B, weights, policy="ridge", ridge=0.3)
        for j in range(B.shape[1]):
            ok = np.isfinite(B[:, j])
            s = np.ones(ok.sum()) if weights is None else np.sqrt(weights[ok, j])
            cov, dof = ridge_oracle(A[ok] * s[:, None], B[ok, j] * s, 0.3)
            np.testing.assert_allclose(out["dof"][j], dof, rtol=1e-9)
            if coef > n:
                # no column of a random 12 × 20 design is determined by its rows: the
                # ridge coefficients stay, their covariance means nothing (NaN)
                assert out["status"][j] == STATUS_CODES["underdetermined"]
                assert np.isnan(out["coef_cov"][:, :, j]).all()
                continue
            close(out["coef_cov"][:, :, j], cov, 1e-7)
            assert out["uncertainty_flags"][j] == 0


def test_cholesky_fallback_pixel_is_flagged_rank_deficient() -> None:
    A = np.random.default_rng(4).standard_normal((12, 3))
    A[6:, 2] = 0.0
    B = cube(n=12, px=3, seed=15)
    B[:6, 0] = np.nan  # pixel 0 cannot see column 2
    out, _ = solve(A, B, policy="cholesky", min_valid=3)
    assert out["uncertainty_flags"][0] == RANK_DEFICIENT
    assert np.isnan(out["coef_stderr"][2, 0]) and np.isfinite(out["coef_stderr"][:2, 0]).all()
    res = wls(A, B[:, 0])
    np.testing.assert_allclose(out["coef_stderr"][:2, 0], res.bse[:2], rtol=1e-8)
    assert out["dof"][0] == 6 - 2
    for j in (1, 2):
        assert_matches(out, j, wls(A, B[:, j]))


def test_unsolved_pixels_are_nan_and_flagged() -> None:
    B = cube(px=3)
    B[:, 0] = np.nan
    B[:-2, 1] = np.nan
    out, _ = solve(POLY, B, policy="cholesky")
    assert out["status"][0] == STATUS_CODES["all_missing"]
    assert (out["uncertainty_flags"][:2] == NOT_SOLVED).all()
    for k in ("coef_stderr", "t_value", "p_value", "dof", "r2", "coef_cov"):
        assert np.isnan(out[k][..., :2]).all(), k


def test_none_writes_nothing_new_and_stderr_no_covariance() -> None:
    B = cube(nan=0.2)
    out, _ = solve(POLY, B, uncertainty="none")
    assert set(out) == {"coefficients", "residual_rms", "n_valid", "status"}
    out, _ = solve(POLY, B, uncertainty="stderr")
    assert "coef_cov" not in out and "coef_stderr" in out


def test_float32_close_to_float64() -> None:
    B = cube(nan=0.2).astype(np.float32)
    o32, _ = solve(POLY, B, dtype="float32")
    o64, _ = solve(POLY, B.astype(np.float64))
    for k in ("coef_stderr", "t_value", "r2"):
        np.testing.assert_allclose(o32[k], o64[k], rtol=1e-4)


def test_stage_matches_xarray_polyfit_cov_on_gap_free_pixels(chain: Chain, write_cube: Any) -> None:
    from gridsolve.schemas.kinds.load import NetCDFLoad
    from gridsolve.schemas.kinds.normal_equations import SVDNormalEquations

    ds = make_ds(n_obs=40, ny=6, nx=6, nan_fraction=0.2, datetime_obs=False)
    ds["signal"][:, :2, :] = make_ds(n_obs=40, ny=6, nx=6, datetime_obs=False)["signal"][:, :2, :]
    chain.whole("load", NetCDFLoad(path=str(write_cube(ds))))
    chain.whole("design", PolynomialDesign(degree=3, scale=False))
    chain.whole("normal_equations", SVDNormalEquations())
    art = chain.tiled("solve", LstsqSolve(dtype="float64", uncertainty="cov"))[0]
    fit = ds["signal"][:, :2, :].polyfit("time", 3, cov=True)
    ref = fit["polyfit_covariance"].values[::-1, ::-1]  # highest degree first
    close(art.array("coef_cov")[:, :, :2, :], ref, 1e-8)
    assert (art.array("dof")[:2] == 36).all()


def test_stage_on_a_random_design_above_obs(chain: Chain, write_cube: Any) -> None:
    from gridsolve.schemas.kinds.load import NetCDFLoad
    from gridsolve.schemas.kinds.normal_equations import SVDNormalEquations

    ds = make_ds(n_obs=12, ny=3, nx=3)
    chain.whole("load", NetCDFLoad(path=str(write_cube(ds))))
    chain.whole("design", RandomDesign(coef=20))
    chain.whole("normal_equations", SVDNormalEquations())
    art = chain.tiled("solve", LstsqSolve(uncertainty="stderr"))[0]
    assert art.array("coef_stderr").shape == (20, 3, 3)
    assert (art.array("uncertainty_flags") == RANK_DEFICIENT | NO_DOF).all()


@pytest.mark.parametrize("mode", ["stderr", "cov"])
def test_written_with_cf_attributes_and_tiles_agree(
    chain: Chain, ctx: Any, write_cube: Any, tmp_path: Any, mode: str
) -> None:
    import xarray as xr

    from gridsolve.schemas.artifacts import Tile
    from gridsolve.schemas.kinds.load import NetCDFLoad
    from gridsolve.schemas.kinds.model import MultidimLinearModel
    from gridsolve.schemas.kinds.normal_equations import SVDNormalEquations
    from gridsolve.schemas.kinds.write import NetCDFWrite
    from gridsolve.stages.engine.agreement import disagreements
    from gridsolve.stages.solve.outputs import UNCERTAINTY_FLAGS

    from testkit import CONTRACT

    path = write_cube(make_ds(n_obs=14, ny=5, nx=4, nan_fraction=0.2))
    results = []
    for c, tiles in (
        (chain, None),
        (
            Chain(ctx),
            [Tile(index=0, y0=0, y1=2, x0=0, x1=4), Tile(index=1, y0=2, y1=5, x0=0, x1=4)],
        ),
    ):
        c.whole("load", NetCDFLoad(path=str(path)))
        c.whole("design", PolynomialDesign(degree=3))
        c.whole("normal_equations", SVDNormalEquations())
        c.tiled("solve", LstsqSolve(uncertainty=mode), tiles)
        c.tiled("model", MultidimLinearModel(input_dim=2, hidden_dim=2, output_dim=3), tiles)
        out = tmp_path / f"out{len(results)}.nc"
        c.whole("write", NetCDFWrite(path=str(out)))
        results.append(xr.open_dataset(out))
    ds = results[0]
    new = {"coef_stderr", "t_value", "p_value", "dof", "r2", "uncertainty_flags"}
    new |= {"coef_cov"} if mode == "cov" else set()
    assert CONTRACT | new <= set(ds.data_vars)
    for name in ("coef_stderr", "t_value", "p_value"):
        assert ds[name].dims == ("coef", "y", "x") and ds[name].attrs["long_name"]
    for name in ("t_value", "p_value", "dof", "r2"):
        assert ds[name].attrs["units"] == "1"
    # the written p-values are Student t's two-sided tail at the written t and dof
    expected_p = 2.0 * scipy.stats.t.sf(np.abs(ds["t_value"].values), ds["dof"].values)
    np.testing.assert_allclose(ds["p_value"].values, expected_p, rtol=1e-5, atol=1e-30)
    if mode == "cov":
        assert ds["coef_cov"].dims == ("coef", "coef2", "y", "x")
        diag = np.sqrt(np.einsum("iiyx->iyx", ds["coef_cov"].values))
        np.testing.assert_allclose(diag, ds["coef_stderr"].values, rtol=1e-5)
    flags = ds["uncertainty_flags"].attrs
    assert flags["flag_meanings"].split() == [
        UNCERTAINTY_FLAGS[k] for k in sorted(UNCERTAINTY_FLAGS)
    ]
    assert (ds["dof"].values == ds["n_valid"].values - 4).all()
    arrays = [{k: d[k].values for k in new} for d in results]
    assert not disagreements(arrays[1], arrays[0])


@pytest.mark.parametrize("path", ["c", "eager"])
@pytest.mark.parametrize("case", ["one gappy pixel", "chunk_pixels 1"])
def test_stderr_of_single_pixel_batches(
    path: str, case: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch of one pixel (one gappy pixel in a tile, or ``chunk_pixels: 1``): its
    (coef, 1) arrays, whose column stride numpy leaves arbitrary, went to the statistics
    kernel and were refused ("expected a 2-D float64 array with contiguous rows")."""
    from gridsolve.stages.solve import kernel

    if path == "c" and kernel.name() != "c":
        pytest.skip("no C compiler here: the eager case covers the path")
    monkeypatch.setenv(kernel.ENV, path)
    kernel._library.cache_clear()
    try:
        B = cube(nan=0.0, seed=11)
        if case == "one gappy pixel":
            B[3, 5] = np.nan
            out, paths = solve(POLY, B, uncertainty="stderr")
            assert paths["per_pixel"] == 1
        else:
            B = cube(nan=0.2, seed=11)
            out, paths = solve(POLY, B, uncertainty="stderr", chunk_pixels=1)
            assert paths["per_pixel"] > 10
    finally:
        monkeypatch.delenv(kernel.ENV)
        kernel._library.cache_clear()
    for j in range(B.shape[1]):
        ok = np.isfinite(B[:, j])
        res = wls(POLY[ok], B[ok, j])
        np.testing.assert_allclose(out["coefficients"][:, j], res.params, rtol=1e-9, atol=1e-12)
        np.testing.assert_allclose(out["coef_stderr"][:, j], res.bse, rtol=1e-8)


@pytest.mark.parametrize("path", ["c", "eager"])
@pytest.mark.parametrize("uncertainty", ["none", "stderr"])
def test_rcond_cuts_every_pixel_as_lstsq_does(
    path: str, uncertainty: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``rcond`` is a cutoff on each pixel's own singular values: pixels with gaps (the
    per-pixel path) are truncated like those of the shared path and like lstsq's, not
    solved in full by their normal equations."""
    from gridsolve.stages.solve import kernel

    if path == "c" and kernel.name() != "c":
        pytest.skip("no C compiler here: the eager case covers the path")
    rng = np.random.default_rng(5)
    t = np.linspace(0, 1, 20)
    A = np.stack([np.ones_like(t), t, t + 1e-2 * rng.standard_normal(20), t**2], axis=1)
    B = A @ rng.standard_normal((4, 60)) + 0.1 * rng.standard_normal((20, 60))
    B[rng.random(B.shape) < 0.15] = np.nan
    B[:, :5] = A @ rng.standard_normal((4, 5))  # gap-free: the shared path
    monkeypatch.setenv(kernel.ENV, path)
    kernel._library.cache_clear()
    try:
        out, paths = solve(A, B, uncertainty=uncertainty, rcond=0.2)
    finally:
        monkeypatch.delenv(kernel.ENV)
        kernel._library.cache_clear()
    assert paths["per_pixel"] > 40
    # the cutoff truncates every pixel's rank: the truncated fit, labelled underdetermined
    assert (out["status"] == STATUS_CODES["underdetermined"]).all()
    for j in range(B.shape[1]):
        ok = np.isfinite(B[:, j])
        want = np.linalg.lstsq(A[ok], B[ok, j], rcond=0.2)[0]
        np.testing.assert_allclose(out["coefficients"][:, j], want, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("clear", [[5, 6, 70, 199], list(range(0, 200, 3))])
def test_clear_pixels_among_cloudy_ones_keep_every_pixel_its_own_results(
    dtype: str, clear: list[int]
) -> None:
    # A cloudy tile's per-pixel batches skip the few gap-free pixels the shared path
    # solves: stored as stretches of columns between them (few) or by an index (many).
    B = cube(px=200, nan=0.2, seed=5)
    B[:, clear] = cube(px=len(clear), seed=6)
    config = LstsqSolve(dtype=dtype, uncertainty="stderr", chunk_pixels=64)
    out = solve_block(B, make_operator(POLY, np.ones(30), config), config)
    a, paths = out.arrays, out.meta["paths"]
    assert paths["shared"] == len(clear) and paths["per_pixel"] == 200 - len(clear)
    rtol = 1e-9 if dtype == "float64" else 1e-5
    for j in range(B.shape[1]):
        res = wls(POLY, B[:, j])
        for name, ref in [("coefficients", res.params), ("coef_stderr", res.bse)]:
            close(a[name][:, j], ref, rtol)  # float32: to the largest one's precision
        close(t_values(a["coefficients"][:, j], a["coef_stderr"][:, j]), res.tvalues, rtol)
        np.testing.assert_allclose(a["r2"][j], res.rsquared, atol=rtol, err_msg=f"{j}")
        assert a["dof"][j] == res.df_resid and a["uncertainty_flags"][j] == 0
        assert a["n_valid"][j] == np.isfinite(B[:, j]).sum()


@pytest.mark.parametrize("uncertainty", ["stderr", "cov"])
@pytest.mark.parametrize("offset", [0.0, 1e2, 1e3, 1e6])
def test_float32_data_far_from_zero_keeps_its_noise(uncertainty: str, offset: float) -> None:
    # float32 products round at eps32·max|b|: at an offset of 1e3 and a noise of 0.1
    # (pressure in hPa) that was 25% of the t-values, every pixel flagged ok.
    rng = np.random.default_rng(7)
    n, px = 60, 40
    t = np.linspace(-1, 1, n)
    A = np.stack([np.ones(n), t, np.cos(np.pi * t), np.sin(np.pi * t)], 1)
    noise = 0.3 * t[:, None] * rng.standard_normal(px) + 0.1 * rng.standard_normal((n, px))
    B = (offset + noise).astype(np.float32)
    out, _ = solve(A, B, dtype="float32", uncertainty=uncertainty)
    assert (out["status"] == 0).all() and (out["uncertainty_flags"] == 0).all()
    for j in range(px):
        res = wls(A, B[:, j].astype(np.float64))
        # in standard errors: what a reader of the coefficients and t compares with
        assert np.max(np.abs(out["coefficients"][1:, j] - res.params[1:]) / res.bse[1:]) < 1e-5
        np.testing.assert_allclose(out["coef_stderr"][:, j], res.bse, rtol=1e-5)
        np.testing.assert_allclose(out["t_value"][1:, j], res.tvalues[1:], rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(out["dof"][j], res.df_resid)


def test_trend_stderr_and_p_value_are_statsmodels_in_the_trends_own_units() -> None:
    import pandas as pd
    import xarray as xr

    import gridsolve

    rng = np.random.default_rng(12)
    time = pd.date_range("2000-01-01", periods=120, freq="7D")
    days = ((time - pd.Timestamp("1970-01-01")) / pd.Timedelta(days=1)).to_numpy()
    y = 2 + 1e-3 * days[:, None, None] + rng.normal(0, 0.5, (120, 4, 5))
    y[rng.random(y.shape) < 0.2] = np.nan
    da = xr.DataArray(y, dims=("time", "y", "x"), coords={"time": time}, name="v")
    da.attrs["units"] = "K"
    out = gridsolve.fit(
        da,
        design={"impl": "harmonic", "harmonics": 1},
        solve={"dtype": "float64", "uncertainty": "stderr"},
        progress=False,
    )
    assert out["trend_stderr"].attrs["units"] == out["trend"].attrs["units"] == "K day-1"
    w = 2 * np.pi * (days - out["design"].attrs["t_centre"]) / out["design"].attrs["period"]
    X = np.stack([np.ones_like(days), days, np.cos(w), np.sin(w)], axis=1)  # raw days
    for i in range(4):
        for j in range(5):
            ok = np.isfinite(y[:, i, j])
            ols = sm.OLS(y[ok, i, j], X[ok]).fit()
            np.testing.assert_allclose(out["trend"][i, j], ols.params[1], rtol=1e-8)
            np.testing.assert_allclose(out["trend_stderr"][i, j], ols.bse[1], rtol=1e-8)
            np.testing.assert_allclose(out["trend_p_value"][i, j], ols.pvalues[1], rtol=1e-6)


def test_every_long_name_is_one_short_line_and_peak_offset_states_its_reference() -> None:
    import xarray as xr

    import gridsolve

    ds = make_ds(n_obs=40, ny=4, nx=5, nan_fraction=0.1)
    out = gridsolve.fit(
        ds["signal"],
        design={"impl": "harmonic", "harmonics": 1},  # 4 coefficients
        solve={"uncertainty": "cov"},
        model={
            "impl": "multidim_linear",
            "input_dim": 2,
            "hidden_dim": 2,
            "output_dim": 3,
            "wrt": "both",
            "jacobian": True,
        },
        progress=False,
    )
    assert {"trend_stderr", "trend_p_value", "coef_cov", "jac_input"} <= set(out.variables)
    for name, var in out.variables.items():
        long_name = str(var.attrs.get("long_name", ""))
        assert len(long_name) <= 60 and "\n" not in long_name, (name, long_name)
    centre = float(out["design"].attrs["t_centre"])  # days since 1970-01-01
    ref = np.datetime64(out["peak_offset"].attrs["reference_time"])
    assert ref == np.datetime64("1970-01-01") + np.timedelta64(round(centre * 86400), "s")
    assert xr.DataArray(ref).dt.year == 2021  # make_ds starts on 2021-01-01
