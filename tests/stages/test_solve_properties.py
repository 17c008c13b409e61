"""Property tests: every pixel equals numpy.linalg.lstsq on its valid rows, or is flagged.

Random shapes, masks (all-missing pixels, missing time steps, single valid
observations), weights, and well-, ill-conditioned or rank-deficient designs.
Tolerance: 1e-8 relative for float64, loosened only by the conditioning of the
pixel's own sub-problem (100·eps times κ + κ²·‖r‖/(σ₁‖c‖), the least-squares
sensitivity), which bounds how far any two backward-stable solvers may differ.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gridsolve.schemas.contracts import STATUS_CODES
from gridsolve.stages.solve import linalg
from gridsolve.stages.solve.policy import Policy

EPS = np.finfo(np.float64).eps


@st.composite
def problems(draw: Any) -> dict[str, Any]:
    n_obs = draw(st.integers(1, 14))
    coef = draw(st.integers(1, 8))
    n_px = draw(st.integers(1, 24))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    kind = draw(st.sampled_from(["well", "ill", "deficient"]))
    A = rng.standard_normal((n_obs, coef))
    if kind == "ill" and min(n_obs, coef) > 1:
        U, _, Vt = np.linalg.svd(A, full_matrices=False)
        s = np.logspace(0, -draw(st.integers(2, 6)), min(n_obs, coef))
        A = (U * s) @ Vt
    elif kind == "deficient" and coef > 1:
        A[:, -1] = A[:, 0] if draw(st.booleans()) else 0.0
    B = rng.standard_normal((n_obs, n_px))
    p_nan = draw(st.sampled_from([0.0, 0.2, 0.6]))
    M = rng.random((n_obs, n_px)) >= p_nan
    if n_px > 2:
        M[:, 0] = False  # an all-missing pixel
        M[:, 1] = False
        M[rng.integers(n_obs), 1] = True  # a single valid observation
    if n_obs > 2 and draw(st.booleans()):
        M[rng.integers(n_obs), :] = False  # a missing time step everywhere
    W = rng.random((n_obs, n_px)) + 0.2 if draw(st.booleans()) else np.ones((n_obs, n_px))
    return {"A": A, "B": B, "M": M, "W": W}


def _oracle(A: np.ndarray, b: np.ndarray, w: np.ndarray) -> tuple[np.ndarray, float]:
    s = np.sqrt(w)
    X = A * s[:, None]
    c = np.linalg.lstsq(X, b * s, rcond=None)[0]
    sv = np.linalg.svd(X, compute_uv=False)
    kept = sv[sv > EPS * max(X.shape) * sv[0]] if sv.size and sv[0] > 0 else sv[:0]
    if not kept.size:
        return c, 1.0
    kappa = float(kept[0] / kept[-1])
    # A least-squares solution with residual r moves by κ²·‖r‖/(σ₁‖c‖) relative, on top
    # of κ, under perturbations of relative size ε (Golub & Van Loan, §5.3): any two
    # backward-stable solvers may differ by that much when the system is inconsistent.
    r = float(np.linalg.norm(b * s - X @ c))
    return c, kappa + kappa**2 * r / (float(kept[0]) * max(float(np.linalg.norm(c)), 1e-300))


def _determined(X: np.ndarray) -> bool | None:
    """Whether rows ``X`` determine every coefficient: True, False, or None near the cutoff.

    Decided on the column-equilibrated rows (the solve's rank decision is taken there too);
    within three decades of the cutoff either verdict is right, so None.
    """
    n, coef = X.shape
    if n < coef:
        return False
    norms = np.linalg.norm(X, axis=0)
    if not (norms > 0).all():
        return False
    sv = np.linalg.svd(X / norms, compute_uv=False)
    ratio = float(sv[-1] / sv[0])
    cut = EPS * max(n, coef)
    if ratio > 1e3 * cut:
        return True
    if ratio < 1e-3 * cut:
        return False
    return None


def _status_fits(status: int, X: np.ndarray, *also: str) -> bool:
    """Whether ``status`` is the determined-or-not verdict on rows ``X`` (or one of ``also``)."""
    verdict = _determined(X)
    allowed = {STATUS_CODES[a] for a in also}
    if verdict is not False:
        allowed.add(STATUS_CODES["ok"])
    if verdict is not True:
        allowed.add(STATUS_CODES["underdetermined"])
    return status in allowed


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems())
def test_per_pixel_minnorm_equals_lstsq_on_valid_rows(p: dict[str, Any]) -> None:
    A, B, M, W = p["A"], p["B"], p["M"], p["W"]
    Wp = np.where(M, W, 0.0)
    B0 = np.where(M, B, 0.0)
    n_valid = M.sum(0)
    todo = np.flatnonzero(n_valid >= 1)
    if todo.size == 0:
        return
    x, status = linalg.solve_per_pixel(
        torch.from_numpy(A),
        torch.from_numpy(B0[:, todo]),
        torch.from_numpy(Wp[:, todo]),
        Policy("minnorm"),
    )
    x = x.numpy()
    for j, px in enumerate(todo):
        ok = M[:, px]
        # Here the status is the factorisation's: ok, or underdetermined where this layer
        # saw the rank short; that EVERY short pixel is flagged is solve_block's contract
        # (test_solve_block_every_pixel_is_lstsq_or_flagged), which marks dual-path pixels.
        X = A[ok] * np.sqrt(W[ok, px])[:, None]
        assert status[j] in (STATUS_CODES["ok"], STATUS_CODES["underdetermined"])
        if _determined(X) is True:
            assert status[j] == STATUS_CODES["ok"]
        ref, kappa = _oracle(A[ok], B[ok, px], W[ok, px])
        tol = max(1e-8, 100 * kappa * EPS)
        err = np.linalg.norm(x[:, j] - ref)
        assert err <= tol * max(np.linalg.norm(ref), 1e-300) + 1e-13, (err, tol, kappa)


@settings(max_examples=60, deadline=None)
@given(problems(), st.floats(1e-4, 10.0))
def test_per_pixel_ridge_equals_closed_form(p: dict[str, Any], lam: float) -> None:
    A, B, M, W = p["A"], p["B"], p["M"], p["W"]
    Wp = np.where(M, W, 0.0)
    B0 = np.where(M, B, 0.0)
    x, _ = linalg.solve_per_pixel(
        torch.from_numpy(A), torch.from_numpy(B0), torch.from_numpy(Wp), Policy("ridge", ridge=lam)
    )
    x = x.numpy()
    for px in range(B.shape[1]):
        G = A.T @ (Wp[:, px, None] * A) + lam * np.eye(A.shape[1])
        ref = np.linalg.solve(G, A.T @ (Wp[:, px] * B0[:, px]))
        kappa = np.linalg.cond(G)
        tol = max(1e-8, 100 * kappa * EPS)
        assert np.linalg.norm(x[:, px] - ref) <= tol * max(np.linalg.norm(ref), 1e-300) + 1e-13


@settings(max_examples=60, deadline=None)
@given(problems())
def test_cholesky_policy_solves_or_flags(p: dict[str, Any]) -> None:
    A, B, M = p["A"], p["B"], p["M"]
    coef = A.shape[1]
    Wp = M.astype(float)
    B0 = np.where(M, B, 0.0)
    todo = np.flatnonzero(M.sum(0) >= coef)
    if todo.size == 0:
        return
    x, status = linalg.solve_per_pixel(
        torch.from_numpy(A),
        torch.from_numpy(B0[:, todo]),
        torch.from_numpy(Wp[:, todo]),
        Policy("cholesky", fallback="minnorm"),
    )
    x, status = x.numpy(), status.numpy()
    for j, px in enumerate(todo):
        ok = M[:, px]
        ref, kappa = _oracle(A[ok], B[ok, px], np.ones(ok.sum()))
        # a full-rank pixel whose Cholesky fails numerically falls back (flagged so)
        assert _status_fits(int(status[j]), A[ok], "fell_back_to_minimum_norm")
        if _determined(A[ok]) is False:
            assert status[j] == STATUS_CODES["underdetermined"]
        tol = max(1e-8, 100 * kappa * EPS)
        assert np.linalg.norm(x[:, j] - ref) <= tol * max(np.linalg.norm(ref), 1e-300) + 1e-13


@pytest.mark.parametrize("coef", [3, 40])
def test_dual_and_primal_agree_with_lstsq_at_scale(coef: int) -> None:
    rng = np.random.default_rng(coef)
    A = rng.standard_normal((20, coef))
    B = rng.standard_normal((20, 3000))
    M = rng.random(B.shape) > 0.3
    x, _ = linalg.solve_per_pixel(
        torch.from_numpy(A),
        torch.from_numpy(np.where(M, B, 0.0)),
        torch.from_numpy(M.astype(float)),
        Policy("minnorm"),
    )
    x = x.numpy()
    for px in range(0, 3000, 97):
        ok = M[:, px]
        ref = np.linalg.lstsq(A[ok], B[ok, px], rcond=None)[0]
        np.testing.assert_allclose(x[:, px], ref, rtol=1e-9, atol=1e-12)


@st.composite
def cubes(draw: Any) -> dict[str, Any]:
    n_obs = draw(st.integers(1, 12))
    coef = draw(st.integers(1, 6))
    n_px = draw(st.integers(1, 80))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    A = rng.standard_normal((n_obs, coef))
    if draw(st.booleans()) and coef > 1:
        A[:, -1] = A[:, 0]  # rank-deficient design
    B = rng.standard_normal((n_obs, n_px))
    B[rng.random(B.shape) < draw(st.sampled_from([0.0, 0.1, 0.5]))] = np.nan
    if n_px > 3:
        B[:, 0] = np.nan  # all missing
        B[:, 1] = np.nan
        B[0, 1] = 1.0  # one valid observation
    if n_obs > 1 and draw(st.booleans()):
        B[draw(st.integers(0, n_obs - 1)), : n_px // 2] = np.nan  # a common gap pattern
    return {"A": A, "B": B, "policy": draw(st.sampled_from(["minnorm", "cholesky", "ridge"]))}


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cubes(), st.sampled_from(["float64", "float32"]))
def test_solve_block_every_pixel_is_lstsq_or_flagged(c: dict[str, Any], dtype: str) -> None:
    from gridsolve.schemas.errors import NumericalError
    from gridsolve.schemas.kinds.solve import LstsqSolve
    from gridsolve.stages.load.patterns import common_patterns, full_hash, pattern_hash
    from gridsolve.stages.solve.block import solve_block
    from gridsolve.stages.solve.prepared import make_operator

    A, B, policy = c["A"], c["B"].astype(dtype), c["policy"]
    coef = A.shape[1]
    config = LstsqSolve(policy=policy, ridge=0.5 if policy == "ridge" else 0.0, dtype=dtype)
    try:
        op = make_operator(A, np.ones(A.shape[0]), config)
    except NumericalError:
        assert (policy == "cholesky" and np.linalg.matrix_rank(A) < coef) or dtype == "float32"
        return
    gaps = common_patterns(pattern_hash(np.isfinite(B)), full_hash(A.shape[0]))
    out = solve_block(B, op, config, gap_patterns=gaps)
    C, status, n_valid = out.arrays["coefficients"], out.arrays["status"], out.arrays["n_valid"]
    tol_base = 1e-8 if dtype == "float64" else 2e-4  # float32 data: documented tolerance
    for px in range(B.shape[1]):
        ok = np.isfinite(B[:, px])
        assert n_valid[px] == ok.sum()
        if ok.sum() == 0:
            assert status[px] == STATUS_CODES["all_missing"] and np.isnan(C[:, px]).all()
            continue
        if ok.sum() < op.min_valid:
            assert status[px] == STATUS_CODES["too_few_observations"] and np.isnan(C[:, px]).all()
            continue
        X, y = A[ok], B[ok, px].astype(np.float64)
        how = policy
        if policy == "cholesky" and np.linalg.matrix_rank(X) < coef:
            how = "minnorm"
        fell_back = ("fell_back_to_minimum_norm",) if policy == "cholesky" else ()
        assert _status_fits(int(status[px]), X, *fell_back), (int(status[px]), _determined(X))
        if how == "ridge":
            ref = np.linalg.solve(X.T @ X + 0.5 * np.eye(coef), X.T @ y)
            kappa = np.linalg.cond(X.T @ X + 0.5 * np.eye(coef))
        else:
            ref, kappa = _oracle(X, y, np.ones(len(y)))
        tol = max(tol_base, 100 * kappa * (EPS if dtype == "float64" else 6e-8))
        err = np.linalg.norm(C[:, px].astype(np.float64) - ref)
        assert err <= tol * max(np.linalg.norm(ref), np.linalg.norm(y) * 1e-3) + 1e-12, (
            px,
            err,
            tol,
        )
