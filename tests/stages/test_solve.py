"""The solve stage against numpy/scipy least squares, per pixel."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from gridsolve.schemas.artifacts import Tile
from gridsolve.schemas.contracts import STATUS_CODES
from gridsolve.schemas.errors import ContractError, NumericalError
from gridsolve.schemas.kinds.design import (
    HarmonicDesign,
    PolynomialDesign,
    RandomDesign,
    VariableDesign,
)
from gridsolve.schemas.kinds.load import NetCDFLoad
from gridsolve.schemas.kinds.normal_equations import SVDNormalEquations
from gridsolve.schemas.kinds.solve import LstsqSolve
from gridsolve.stages.engine.agreement import disagreements

from testkit import Chain, make_ds


def solve_cube(
    chain: Chain,
    path: Any,
    design_cfg: Any,
    solve_cfg: LstsqSolve,
    tiles: list[Tile] | None = None,
    **load: Any,
) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    chain.whole("load", NetCDFLoad(path=str(path), **load))
    A = np.array(chain.whole("design", design_cfg).array("A"))
    chain.whole("normal_equations", SVDNormalEquations())
    arts = chain.tiled("solve", solve_cfg, tiles)
    meta = chain.refs["load"].meta
    out = {
        "coefficients": np.full((A.shape[1], meta["ny"], meta["nx"]), np.nan),
        "residual_rms": np.full((meta["ny"], meta["nx"]), np.nan),
        "n_valid": np.zeros((meta["ny"], meta["nx"]), int),
        "status": np.zeros((meta["ny"], meta["nx"]), int),
    }
    tiles = tiles or [Tile(index=0, y0=0, y1=meta["ny"], x0=0, x1=meta["nx"])]
    for t, art in zip(tiles, arts, strict=True):
        for k in out:
            out[k][..., t.y0 : t.y1, t.x0 : t.x1] = art.array(k)
    return A, out


def per_pixel_lstsq(A: np.ndarray, cube: np.ndarray) -> np.ndarray:
    coef = np.empty((A.shape[1], *cube.shape[1:]))
    for j in range(cube.shape[1]):
        for i in range(cube.shape[2]):
            coef[:, j, i] = np.linalg.lstsq(A, cube[:, j, i], rcond=None)[0]
    return coef


def rel_err(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.max(np.linalg.norm(a - b, axis=0) / np.linalg.norm(b, axis=0)))


def test_minnorm_when_coef_exceeds_obs(chain: Chain, write_cube: Any) -> None:
    ds = make_ds(n_obs=12, ny=5, nx=4)
    A, out = solve_cube(chain, write_cube(ds), RandomDesign(coef=20), LstsqSolve(dtype="float64"))
    ref = per_pixel_lstsq(A, ds["signal"].values)
    assert rel_err(out["coefficients"], ref) < 1e-10
    # 12 rows cannot determine 20 coefficients: the minimum-norm fit, never labelled ok
    assert (out["status"] == STATUS_CODES["underdetermined"]).all()
    assert (out["n_valid"] == 12).all()
    np.testing.assert_allclose(out["residual_rms"], 0, atol=1e-10)  # rank 12 = obs: exact fit
    # the naive fix, torch.linalg.solve(AᵀA, Aᵀb), has no solution to give here:
    assert np.linalg.matrix_rank(A.T @ A) == 12 < 20


def test_well_posed_harmonic_float64(chain: Chain, write_cube: Any) -> None:
    ds = make_ds(n_obs=30, ny=4, nx=4)
    A, out = solve_cube(
        chain, write_cube(ds), HarmonicDesign(harmonics=2), LstsqSolve(dtype="float64")
    )
    ref = per_pixel_lstsq(A, ds["signal"].values)
    # cond(A) 1.6e6: both lie within cond·eps (3.6e-10) of the exact fit (mpmath, 40
    # digits: lstsq errs 9.6e-11, the equilibrated solve 3.4e-11), so not within 1e-10
    # of each other
    assert rel_err(out["coefficients"], ref) < 1e-9
    resid = ds["signal"].values - np.einsum("oc,cyx->oyx", A, ref)
    np.testing.assert_allclose(out["residual_rms"], np.sqrt((resid**2).mean(0)), rtol=1e-8)


@pytest.mark.parametrize("policy", ["cholesky", "minnorm"])
def test_float32_close_to_float64_oracle(chain: Chain, write_cube: Any, policy: str) -> None:
    ds = make_ds(n_obs=30, ny=4, nx=4, dtype="float32")
    A, out = solve_cube(
        chain, write_cube(ds), PolynomialDesign(degree=3), LstsqSolve(policy=policy)
    )
    ref = per_pixel_lstsq(A, ds["signal"].values.astype(np.float64))
    assert rel_err(out["coefficients"], ref) < 1e-5


def test_ridge_is_the_closed_form(chain: Chain, write_cube: Any) -> None:
    ds = make_ds(n_obs=12, ny=3, nx=3)
    A, out = solve_cube(
        chain,
        write_cube(ds),
        RandomDesign(coef=20),
        LstsqSolve(policy="ridge", ridge=0.3, dtype="float64"),
    )
    b = ds["signal"].values.reshape(12, -1)
    ref = np.linalg.solve(A.T @ A + 0.3 * np.eye(20), A.T @ b).reshape(20, 3, 3)
    assert rel_err(out["coefficients"], ref) < 1e-10


def test_cholesky_refuses_coef_above_obs(chain: Chain, write_cube: Any) -> None:
    with pytest.raises(NumericalError) as err:
        solve_cube(
            chain, write_cube(make_ds()), RandomDesign(coef=20), LstsqSolve(policy="cholesky")
        )
    text = str(err.value)
    assert "coef (20) > obs (12)" in text and "solve.policy: minnorm" in text


def test_cholesky_refuses_rank_deficient_design(chain: Chain, write_cube: Any) -> None:
    ds = make_ds()
    A = np.random.default_rng(0).standard_normal((12, 4))
    A[:, 3] = A[:, 0] + A[:, 1]
    ds["A"] = (("time", "coef"), A)
    with pytest.raises(NumericalError, match="rank 3 < coef 4"):
        solve_cube(
            chain,
            write_cube(ds),
            VariableDesign(),
            LstsqSolve(policy="cholesky"),
            variable="signal",
            design="A",
        )


def test_minnorm_on_rank_deficient_design_matches_lstsq(chain: Chain, write_cube: Any) -> None:
    ds = make_ds()
    A = np.random.default_rng(0).standard_normal((12, 4))
    A[:, 3] = A[:, 0] + A[:, 1]
    ds["A"] = (("time", "coef"), A)
    _, out = solve_cube(
        chain,
        write_cube(ds),
        VariableDesign(),
        LstsqSolve(dtype="float64"),
        variable="signal",
        design="A",
    )
    assert rel_err(out["coefficients"], per_pixel_lstsq(A, ds["signal"].values)) < 1e-10


def test_float32_refused_for_ill_conditioned_design(chain: Chain, write_cube: Any) -> None:
    ds = make_ds(n_obs=40, datetime_obs=False)
    ds = ds.assign_coords(time=np.arange(40.0) + 1000.0)
    with pytest.raises(NumericalError) as err:
        solve_cube(
            chain,
            write_cube(ds),
            PolynomialDesign(degree=3, scale=False),
            LstsqSolve(dtype="float32"),
        )
    assert "float32 is too coarse" in str(err.value) and "solve.dtype: float64" in str(err.value)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_tiles_agree_within_the_bound(chain: Chain, write_cube: Any, ctx: Any, dtype: str) -> None:
    ds = make_ds(n_obs=12, ny=8, nx=8, dtype=dtype)
    gappy = make_ds(n_obs=12, ny=8, nx=8, nan_fraction=0.2, dtype=dtype)["signal"].values
    ds["signal"][:, 5:, :] = gappy[:, 5:, :]  # per-pixel gaps in the last rows
    ds["signal"][3, :5, :] = np.nan  # a gap pattern of 40 pixels: common in the grid, not per tile
    ds["signal"][:, 7, 7] = ds["signal"][:, 7, 6] = 1.0  # a few fully valid pixels
    path = write_cube(ds)
    cfg = LstsqSolve(dtype=dtype)
    _, whole = solve_cube(chain, path, RandomDesign(coef=5), cfg)
    assert chain.runs["solve"][0].ref.meta["paths"]["pattern"] > 0
    tiles = [
        Tile(index=0, y0=0, y1=3, x0=0, x1=8),
        Tile(index=1, y0=3, y1=8, x0=0, x1=3),
        Tile(index=2, y0=3, y1=8, x0=3, x1=8),
    ]
    _, tiled = solve_cube(Chain(ctx), path, RandomDesign(coef=5), cfg, tiles)
    # Not equal bits: BLAS rounding may depend on a product's width (docs/failures.md, Determinism).
    assert not disagreements(tiled, whole)


def test_gaps_are_solved_per_pixel_and_flagged(chain: Chain, write_cube: Any) -> None:
    ds = make_ds(n_obs=12, ny=4, nx=4)
    v = ds["signal"].values
    v[:, 0, 0] = np.nan  # all missing
    v[:-2, 0, 1] = np.nan  # two valid of four coefficients
    v[[1, 4, 7], 1, 1] = np.nan  # a few gaps
    A, out = solve_cube(
        chain,
        write_cube(ds),
        PolynomialDesign(degree=3),
        LstsqSolve(policy="cholesky", dtype="float64"),
    )
    assert out["status"][0, 0] == STATUS_CODES["all_missing"] and out["n_valid"][0, 0] == 0
    assert out["status"][0, 1] == STATUS_CODES["too_few_observations"] and out["n_valid"][0, 1] == 2
    assert (
        np.isnan(out["coefficients"][:, 0, :2]).all() and np.isnan(out["residual_rms"][0, :2]).all()
    )
    ok = ~np.isnan(v[:, 1, 1])
    ref = np.linalg.lstsq(A[ok], v[ok, 1, 1], rcond=None)[0]
    np.testing.assert_allclose(out["coefficients"][:, 1, 1], ref, rtol=1e-10)
    assert out["n_valid"][1, 1] == 9 and out["status"][1, 1] == 0


def test_agrees_with_xarray_polyfit_skipna(chain: Chain, write_cube: Any) -> None:
    ds = make_ds(n_obs=40, ny=6, nx=6, nan_fraction=0.2, datetime_obs=False)
    ds["signal"][:, 0, 0] = np.nan
    ds["signal"][:37, 1, 0] = np.nan  # 3 valid < 4 coefficients
    _, out = solve_cube(
        chain, write_cube(ds), PolynomialDesign(degree=3, scale=False), LstsqSolve(dtype="float64")
    )
    fit = ds["signal"].polyfit("time", 3, skipna=True)["polyfit_coefficients"]
    ref = fit.sel(degree=[0, 1, 2, 3]).values  # polyfit orders highest degree first
    both = np.isfinite(ref).all(0) & (out["n_valid"] >= 4)
    assert both.sum() >= 30
    np.testing.assert_allclose(out["coefficients"][:, both], ref[:, both], rtol=1e-8, atol=1e-10)


def test_weights_equal_lstsq_on_scaled_rows(chain: Chain, write_cube: Any) -> None:
    ds = make_ds(n_obs=15, ny=3, nx=4, nan_fraction=0.1)
    rng = np.random.default_rng(2)
    W = rng.random((15, 3, 4)) + 0.1
    W[0, 0, 0] = 0.0  # a zero weight drops an observation
    ds["w"] = (("time", "y", "x"), W)
    A, out = solve_cube(
        chain,
        write_cube(ds),
        PolynomialDesign(degree=2),
        LstsqSolve(dtype="float64"),
        variable="signal",
        weights="w",
    )
    b = ds["signal"].values
    for j in range(3):
        for i in range(4):
            ok = np.isfinite(b[:, j, i]) & (W[:, j, i] > 0)
            s = np.sqrt(W[ok, j, i])
            ref = np.linalg.lstsq(A[ok] * s[:, None], b[ok, j, i] * s, rcond=None)[0]
            np.testing.assert_allclose(out["coefficients"][:, j, i], ref, rtol=1e-9)
            assert out["n_valid"][j, i] == ok.sum()


def test_shared_weights_match_weighted_lstsq(chain: Chain, write_cube: Any) -> None:
    ds = make_ds(n_obs=15, ny=3, nx=3)
    w = np.linspace(0.5, 2.0, 15)
    w[4] = 0.0  # this observation is left out of fits and residuals
    ds["w"] = ("time", w)
    A, out = solve_cube(
        chain,
        write_cube(ds),
        PolynomialDesign(degree=2),
        LstsqSolve(dtype="float64"),
        variable="signal",
        weights="w",
    )
    s = np.sqrt(w)
    ref = np.linalg.lstsq(
        A * s[:, None], ds["signal"].values.reshape(15, -1) * s[:, None], rcond=None
    )[0]
    np.testing.assert_allclose(out["coefficients"].reshape(3, -1), ref, rtol=1e-10)
    b = ds["signal"].values.reshape(15, -1)
    keep = w > 0
    resid = b[keep] - A[keep] @ ref
    np.testing.assert_allclose(out["residual_rms"].ravel(), np.sqrt((resid**2).mean(0)), rtol=1e-10)
    assert (out["n_valid"] == 14).all()


def test_shared_gap_pattern_uses_one_factorisation(chain: Chain, write_cube: Any) -> None:
    ds = make_ds(n_obs=12, ny=8, nx=8)
    ds["signal"][3] = np.nan  # one time step missing everywhere
    A, out = solve_cube(
        chain, write_cube(ds), PolynomialDesign(degree=2), LstsqSolve(dtype="float64")
    )
    paths = chain.runs["solve"][0].ref.meta["paths"]
    assert paths["pattern"] == 64 and paths["per_pixel"] == 0
    keep = np.arange(12) != 3
    ref = np.linalg.lstsq(A[keep], ds["signal"].values[keep].reshape(11, -1), rcond=None)[0]
    np.testing.assert_allclose(out["coefficients"].reshape(3, -1), ref, rtol=1e-10)
    assert (out["n_valid"] == 11).all()


def test_cholesky_pixel_that_fails_falls_back_and_is_flagged(chain: Chain, write_cube: Any) -> None:
    ds = make_ds(n_obs=12, ny=2, nx=2)
    A = np.random.default_rng(4).standard_normal((12, 3))
    A[6:, 2] = 0.0  # the last column lives in the first six observations only
    ds["A"] = (("time", "coef"), A)
    ds["signal"][:6, 0, 0] = np.nan  # …which pixel (0, 0) lacks: its own system is singular
    _, out = solve_cube(
        chain,
        write_cube(ds),
        VariableDesign(),
        LstsqSolve(policy="cholesky", min_valid=3, dtype="float64"),
        variable="signal",
        design="A",
    )
    # its rows do not determine the last coefficient: underdetermined, not fell_back
    assert out["status"][0, 0] == STATUS_CODES["underdetermined"]
    ref = np.linalg.lstsq(A[6:], ds["signal"].values[6:, 0, 0], rcond=None)[0]
    np.testing.assert_allclose(out["coefficients"][:, 0, 0], ref, rtol=1e-9, atol=1e-12)
    assert (out["status"].ravel()[1:] == 0).all()


def test_fallback_none_gives_nan_and_singular(chain: Chain, write_cube: Any) -> None:
    ds = make_ds(n_obs=12, ny=2, nx=2)
    A = np.random.default_rng(4).standard_normal((12, 3))
    A[6:, 2] = 0.0
    ds["A"] = (("time", "coef"), A)
    ds["signal"][:6, 0, 0] = np.nan
    _, out = solve_cube(
        chain,
        write_cube(ds),
        VariableDesign(),
        LstsqSolve(policy="cholesky", fallback="none", min_valid=3, dtype="float64"),
        variable="signal",
        design="A",
    )
    assert out["status"][0, 0] == STATUS_CODES["singular"]
    assert np.isnan(out["coefficients"][:, 0, 0]).all() and np.isnan(out["residual_rms"][0, 0])


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_solve_block_leaves_its_input_alone(dtype: str) -> None:
    from gridsolve.stages.solve.block import solve_block
    from gridsolve.stages.solve.prepared import make_operator

    rng = np.random.default_rng(0)
    A = rng.standard_normal((10, 3))
    B = rng.standard_normal((10, 500)).astype(dtype)
    B[rng.random(B.shape) < 0.3] = np.nan
    before = B.copy()
    config = LstsqSolve(dtype=dtype)
    solve_block(B, make_operator(A, np.ones(10), config), config)
    np.testing.assert_array_equal(B, before)


# ---------------------------------------------------------------- magnitudes and the solve dtype
def lstsq_rows(
    A: np.ndarray, cube: np.ndarray, w: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """float64 oracle: coefficients and residual RMS of each pixel on its valid rows."""
    b = cube.astype(np.float64).reshape(cube.shape[0], -1)
    w = np.ones(b.shape[0]) if w is None else w
    coef, rms = np.full((A.shape[1], b.shape[1]), np.nan), np.full(b.shape[1], np.nan)
    for j in range(b.shape[1]):
        ok = np.isfinite(b[:, j]) & (w > 0)
        s = np.sqrt(w[ok])
        coef[:, j] = np.linalg.lstsq(A[ok] * s[:, None], b[ok, j] * s, rcond=None)[0]
        rms[j] = np.sqrt(np.mean((b[ok, j] - A[ok] @ coef[:, j]) ** 2))
    return coef.reshape(A.shape[1], *cube.shape[1:]), rms.reshape(cube.shape[1:])


def scaled_cube(top: float, dtype: str, path: str) -> Any:
    """A cube whose largest |value| is ``top``, with the gaps that send it down ``path``."""
    ds = make_ds(n_obs=12, ny=8, nx=8, nan_fraction=0.2 if path == "per_pixel" else 0.0)
    v = ds["signal"].values
    v = v / np.nanmax(np.abs(v)) * top
    if path == "pattern":
        v[3] = np.nan  # one time step missing everywhere: a shared gap pattern
    ds["signal"] = (ds["signal"].dims, v.astype(dtype), ds["signal"].attrs)
    if path == "weighted":
        ds["w"] = ("time", np.linspace(0.5, 2.0, 12))
    return ds


PATHS = {  # solve path → design
    "shared_Q": PolynomialDesign(degree=5),  # rank left 6 ≤ coef 6: residual via Q
    "shared": PolynomialDesign(degree=2),  # residual as b − A c
    "weighted": PolynomialDesign(degree=2),
    "pattern": PolynomialDesign(degree=2),
    "per_pixel": PolynomialDesign(degree=2),
}


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("top", [1e20, 1e-20, 1e-30])
def test_residual_rms_neither_overflows_nor_underflows(
    chain: Chain, write_cube: Any, path: str, dtype: str, top: float
) -> None:
    ds = scaled_cube(top, dtype, path)
    load = {"variable": "signal", "weights": "w"} if path == "weighted" else {}
    A, out = solve_cube(chain, write_cube(ds), PATHS[path], LstsqSolve(dtype=dtype), **load)
    used = chain.runs["solve"][0].ref.meta["paths"]
    assert used[{"shared_Q": "shared", "weighted": "shared"}.get(path, path)] > 0
    w = ds["w"].values if path == "weighted" else None
    ref_coef, ref_rms = lstsq_rows(A, ds["signal"].values, w)
    solved = out["n_valid"] >= 3
    assert solved.sum() >= 50 and (out["status"][solved] == 0).all()
    rtol = 2e-4 if dtype == "float32" else 1e-8
    np.testing.assert_allclose(out["residual_rms"][solved], ref_rms[solved], rtol=rtol)
    assert rel_err(out["coefficients"][:, solved], ref_coef[:, solved]) < rtol


@pytest.mark.parametrize("path", ["shared_Q", "pattern", "per_pixel"])
def test_float32_values_near_its_limit_are_computed_in_float64(
    chain: Chain, write_cube: Any, path: str
) -> None:
    # float32 products and sums of these overflow although every coefficient fits
    ds = scaled_cube(1e38, "float32", path)
    A, out = solve_cube(chain, write_cube(ds), PolynomialDesign(degree=5), LstsqSolve())
    ref_coef, ref_rms = lstsq_rows(A, ds["signal"].values)
    solved = out["n_valid"] >= 6
    assert solved.sum() >= 40 and (out["status"][solved] == 0).all()
    assert np.abs(ref_coef[:, solved]).max() > 1e38  # near the top of float32's range
    assert rel_err(out["coefficients"][:, solved], ref_coef[:, solved]) < 1e-5
    np.testing.assert_allclose(out["residual_rms"][solved], ref_rms[solved], rtol=1e-4)


@pytest.mark.parametrize("top", [1e40, 1e-45])
def test_data_outside_float32_are_refused_under_float32(
    chain: Chain, write_cube: Any, ctx: Any, top: float
) -> None:
    ds = scaled_cube(top, "float64", "shared")
    path = write_cube(ds)
    with pytest.raises(NumericalError) as err:
        solve_cube(chain, path, PolynomialDesign(degree=2), LstsqSolve())
    text = str(err.value)
    assert "the cube's values do not fit float32" in text
    assert f"largest |value| {top:.3g}" in text and "set solve.dtype: float64" in text
    # float64 solves them: the oracle's coefficients, status ok
    A, out = solve_cube(Chain(ctx), path, PolynomialDesign(degree=2), LstsqSolve(dtype="float64"))
    ref_coef, ref_rms = lstsq_rows(A, ds["signal"].values)
    assert (out["status"] == 0).all()
    assert rel_err(out["coefficients"], ref_coef) < 1e-10
    np.testing.assert_allclose(out["residual_rms"], ref_rms, rtol=1e-9)


@pytest.mark.parametrize("gaps", [False, True])
def test_coefficients_beyond_float32_are_refused_not_stored_as_inf(
    chain: Chain, write_cube: Any, ctx: Any, gaps: bool
) -> None:
    ds = scaled_cube(1e20, "float32", "per_pixel" if gaps else "shared")
    A = np.vander(np.linspace(-1, 1, 12), 3, increasing=True) * 1e-20  # coefficients ~1e40
    ds["A"] = (("time", "coef"), A)
    path = write_cube(ds)
    load = {"variable": "signal", "design": "A"}
    with pytest.raises(NumericalError) as err:
        solve_cube(chain, path, VariableDesign(), LstsqSolve(), **load)
    text = str(err.value)
    assert "coefficients or residual RMS exceed float32's range" in text
    assert "first at y=0, x=0" in text and "set solve.dtype: float64" in text
    _, out = solve_cube(Chain(ctx), path, VariableDesign(), LstsqSolve(dtype="float64"), **load)
    ref_coef, _ = lstsq_rows(A, ds["signal"].values)
    solved = out["n_valid"] >= 3
    assert np.abs(ref_coef[:, solved]).max() > 1e39
    assert rel_err(out["coefficients"][:, solved], ref_coef[:, solved]) < 1e-9


@pytest.mark.parametrize("top", [1e200, 1e-200])
def test_float64_extremes_keep_cholesky_pixels_ok(
    chain: Chain, write_cube: Any, top: float
) -> None:
    # The refinement's convergence test squared the coefficients: at 1e200 every
    # gappy pixel was sent to the SVD path and flagged as a fallback.
    ds = scaled_cube(top, "float64", "per_pixel")
    A, out = solve_cube(
        chain,
        write_cube(ds),
        PolynomialDesign(degree=2),
        LstsqSolve(policy="cholesky", min_valid=3, dtype="float64"),
    )
    # the oracle on the unscaled values (its own squares would overflow at 1e200)
    ref_coef, ref_rms = lstsq_rows(A, ds["signal"].values / top)
    solved = out["n_valid"] >= 3
    assert (out["status"][solved] == 0).all()
    assert rel_err(out["coefficients"][:, solved] / top, ref_coef[:, solved]) < 1e-10
    np.testing.assert_allclose(out["residual_rms"][solved] / top, ref_rms[solved], rtol=1e-9)


def test_all_zero_shared_weights_are_named_not_a_float32_problem() -> None:
    from gridsolve.stages.solve.prepared import make_operator

    A = np.vander(np.linspace(-1, 1, 10), 3, increasing=True)
    with pytest.raises(ContractError) as err:
        make_operator(A, np.zeros(10), LstsqSolve())
    text = str(err.value)
    assert "all zero: no observation has weight > 0" in text and "float32" not in text


def test_valid_range_sentinel_is_a_gap(chain: Chain, write_cube: Any) -> None:
    ds = make_ds(n_obs=12, ny=4, nx=5)
    raw = np.round((ds["signal"].values - 2.0) / 0.001).astype(np.int16)
    raw[3, 1, 2] = -32768  # declared only by valid_min
    attrs = {"scale_factor": np.float32(0.001), "add_offset": np.float32(2.0)}
    ds["signal"] = (ds["signal"].dims, raw, {**attrs, "valid_min": np.int16(-32767)})
    A, out = solve_cube(
        chain, write_cube(ds), PolynomialDesign(degree=2), LstsqSolve(dtype="float64")
    )
    assert out["n_valid"][1, 2] == 11 and (out["status"] == 0).all()
    decoded = raw * np.float32(0.001) + np.float32(2.0)  # CF unpacking, float32 as xarray
    decoded = decoded.astype(np.float64)
    decoded[3, 1, 2] = np.nan
    ref_coef, _ = lstsq_rows(A, decoded)
    assert rel_err(out["coefficients"], ref_coef) < 1e-6


def test_solve_block_without_the_cube_maximum_scans_each_block() -> None:
    # Called directly (no load stage), the operator does not know the data's range.
    from gridsolve.stages.solve.block import solve_block
    from gridsolve.stages.solve.prepared import make_operator

    A = np.vander(np.linspace(-1, 1, 12), 6, increasing=True)
    b = make_ds(n_obs=12, ny=4, nx=4)["signal"].values.reshape(12, -1)
    B = (b / np.abs(b).max() * 1e38).astype(np.float32)
    config = LstsqSolve()
    op = make_operator(A, np.ones(12), config)
    assert op.data_max is None
    out = solve_block(B, op, config)
    ref = np.linalg.lstsq(A, B.astype(np.float64), rcond=None)[0]
    assert rel_err(out.arrays["coefficients"], ref) < 1e-5
    with pytest.raises(NumericalError, match="first at pixel 0 of the block"):
        tiny = make_operator(A * 1e-20, np.ones(12), config)
        solve_block((B / np.float32(1e18)).astype(np.float32), tiny, config)


@pytest.mark.parametrize("uncertainty", ["none", "stderr"])
def test_arrays_in_the_other_byte_order_give_the_same_results(uncertainty: str) -> None:
    # NetCDF-3 files and some archives hold big-endian arrays; torch reads no such array.
    from gridsolve.stages.solve.block import solve_block
    from gridsolve.stages.solve.prepared import make_operator

    A = np.vander(np.linspace(-1, 1, 20), 4, increasing=True)
    B = make_ds(n_obs=20, ny=5, nx=6)["signal"].values.reshape(20, -1)
    B[3, :7] = np.nan
    w = np.linspace(0.5, 1.5, B.size).reshape(B.shape)
    config = LstsqSolve(uncertainty=uncertainty)

    def swapped(a: np.ndarray) -> np.ndarray:
        return a.astype(a.dtype.newbyteorder())

    results = []
    for own in (None, w):
        native = solve_block(B, make_operator(A, np.ones(20), config), config, own)
        other = solve_block(
            swapped(B),
            make_operator(swapped(A), swapped(np.ones(20)), config),
            config,
            None if own is None else swapped(own),
        )
        assert native.arrays.keys() == other.arrays.keys()
        for k, v in native.arrays.items():
            np.testing.assert_array_equal(other.arrays[k], v, err_msg=k)
        results.append(native.arrays["coefficients"])
    ref = np.linalg.lstsq(A, B[:, 7:], rcond=None)[0]
    assert rel_err(results[0][:, 7:], ref) < 1e-5


@pytest.mark.parametrize("policy", ["minnorm", "cholesky"])
def test_min_valid_above_the_observations_gives_the_same_status_in_every_tile(
    policy: str,
) -> None:
    """A pixel's status never depends on its neighbours: gaps elsewhere in the tile or not."""
    from gridsolve.stages.solve.block import solve_block
    from gridsolve.stages.solve.prepared import make_operator

    rng = np.random.default_rng(3)
    n = 12
    A = np.vander(np.linspace(-1, 1, n), 3, increasing=True)
    B = A @ rng.normal(size=(3, 8)) + 0.1 * rng.normal(size=(n, 8))
    config = LstsqSolve(policy=policy, dtype="float64", min_valid=n + 1)
    op = make_operator(A, np.ones(n), config)
    gap_free = solve_block(B, op, config).arrays["status"]
    with_gap = B.copy()
    with_gap[0, -1] = np.nan  # one gap in the last pixel only
    one_gap = solve_block(with_gap, op, config).arrays["status"]
    too_few = STATUS_CODES["too_few_observations"]
    assert (gap_free == too_few).all() and (one_gap == too_few).all()
    # and with min_valid reachable, the gap-free pixels are solved in both tiles
    ok_config = LstsqSolve(policy=policy, dtype="float64", min_valid=n)
    ok_op = make_operator(A, np.ones(n), ok_config)
    assert (solve_block(B, ok_op, ok_config).arrays["status"] == STATUS_CODES["ok"]).all()
    mixed = solve_block(with_gap, ok_op, ok_config).arrays["status"]
    assert (mixed[:-1] == STATUS_CODES["ok"]).all() and mixed[-1] == too_few


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_infinite_data_are_gaps_on_the_per_pixel_path(dtype: str) -> None:
    from gridsolve.stages.solve.block import solve_block
    from gridsolve.stages.solve.prepared import make_operator

    rng = np.random.default_rng(3)
    A = np.vander(np.linspace(-1, 1, 30), 4, increasing=True)
    B = rng.standard_normal((30, 400)).astype(dtype)
    B[rng.random(B.shape) < 0.15] = np.nan
    B[rng.random(B.shape) < 0.05] = np.inf
    B[rng.random(B.shape) < 0.05] = -np.inf
    config = LstsqSolve(dtype="float64")
    out = solve_block(B, make_operator(A, np.ones(30), config), config)
    assert out.meta["paths"]["per_pixel"] > 300
    coef, rms = lstsq_rows(A, np.where(np.isfinite(B), B, np.nan)[:, None, :])
    np.testing.assert_allclose(out.arrays["coefficients"], coef[:, 0], rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(out.arrays["residual_rms"], rms[0], rtol=1e-10)
    assert (out.arrays["n_valid"] == np.isfinite(B).sum(axis=0)).all()


@pytest.mark.parametrize("n_obs", [40, 300])
def test_valid_counts_past_one_byte(n_obs: int) -> None:
    """n_valid counts each pixel's finite observations, with more than 255 of them too."""
    from gridsolve.stages.solve.block import solve_block
    from gridsolve.stages.solve.prepared import make_operator

    rng = np.random.default_rng(n_obs)
    A = np.vander(np.linspace(-1, 1, n_obs), 3, increasing=True)
    B = rng.standard_normal((n_obs, 64))
    B[rng.random(B.shape) < 0.05] = np.nan  # with 300 rows, most counts pass 255
    config = LstsqSolve(policy="minnorm", dtype="float64")
    out = solve_block(B, make_operator(A, np.ones(n_obs), config), config)
    np.testing.assert_array_equal(out.arrays["n_valid"], np.isfinite(B).sum(axis=0))
    if n_obs > 255:
        assert (out.arrays["n_valid"] > 255).any()
