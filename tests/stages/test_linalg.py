"""Batch independence of the per-pixel numerics, within the stated agreement bound.

A pixel's result must not depend on its neighbours in a tile or chunk, nor on
the thread count, beyond the bound of stages/engine/agreement.py: MKL rounds a
matrix product differently with its width on some code paths (MKL_CBWR=AVX2
shows it), so equal bits are not asserted here. tests/stages/test_determinism.py
runs the same checks across emulated CPUs.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gridsolve.stages.engine.agreement import disagreements
from gridsolve.stages.solve import linalg
from gridsolve.stages.solve.cholesky import (
    PackedFactor,
    batched_cholesky,
    lower_pairs,
    packed_cholesky,
)
from gridsolve.stages.solve.columns import colmm
from gridsolve.stages.solve.dual import _dual_schur, gapwise_dual
from gridsolve.stages.solve.policy import OK, Policy
from gridsolve.stages.solve.spread import _inverses, compensated_residuals


def _agree(part: torch.Tensor, full: torch.Tensor) -> list[str]:
    return disagreements({"x": part.numpy()}, {"x": full.numpy()})


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(("m", "k"), [(100, 50), (10, 50), (50, 10), (55, 50)])
def test_colmm_columns_do_not_depend_on_width_offset_or_threads(
    dtype: torch.dtype, m: int, k: int
) -> None:
    g = torch.Generator().manual_seed(m * k)
    M = torch.randn(m, k, dtype=dtype, generator=g)
    X = torch.randn(k, 9000, dtype=dtype, generator=g)
    full = colmm(M, X)
    oracle = (M.double() @ X.double()).to(dtype)
    assert not _agree(full, oracle)
    threads = torch.get_num_threads()
    try:
        for n_threads in sorted({1, threads}):
            torch.set_num_threads(n_threads)
            spans = [(0, 1), (5, 7), (3, 1500), (1024, 5120), (777, 9000), (0, 9000), (1, 8999)]
            for start, stop in spans:
                part = colmm(M, X[:, start:stop])
                assert not _agree(part, full[:, start:stop]), (n_threads, start, stop)
    finally:
        torch.set_num_threads(threads)


def test_per_pixel_solve_does_not_depend_on_batch() -> None:
    rng = np.random.default_rng(0)
    A = torch.from_numpy(rng.standard_normal((20, 6)))
    M = torch.from_numpy(rng.random((20, 3000)) > 0.3)
    B0 = torch.where(M, torch.from_numpy(rng.standard_normal((20, 3000))), 0.0)
    W = M.double()
    full, status = linalg.solve_per_pixel(A, B0, W, Policy("minnorm"))
    for s, e in [(0, 1), (5, 1029), (2000, 3000)]:
        part, part_status = linalg.solve_per_pixel(A, B0[:, s:e], W[:, s:e], Policy("minnorm"))
        assert torch.equal(part_status, status[s:e])
        assert not _agree(part, full[:, s:e])
    # and each pixel is its own weighted least-squares solution (numpy oracle)
    for p in (0, 1234, 2999):
        rows = M[:, p].numpy()
        expected = np.linalg.lstsq(A.numpy()[rows], B0[:, p].numpy()[rows], rcond=None)[0]
        np.testing.assert_allclose(full[:, p].numpy(), expected, rtol=1e-9, atol=1e-12)


def _dual_oracle(A: np.ndarray, b: np.ndarray, rows: np.ndarray, lam: float) -> np.ndarray:
    """The pixel's own minimum-norm (λ = 0) or ridge solution, by numpy on its valid rows."""
    Av = A[rows]
    if lam:
        return np.asarray(Av.T @ np.linalg.solve(Av @ Av.T + lam * np.eye(len(Av)), b[rows]))
    return np.asarray(np.linalg.lstsq(Av, b[rows], rcond=None)[0])


@pytest.mark.parametrize(
    ("policy", "weighted", "gapwise"),
    [
        (Policy("minnorm"), False, True),
        (Policy("ridge", ridge=0.3), False, True),
        # weights never change an interpolating minimum-norm fit: still by gaps
        (Policy("minnorm"), True, True),
        # ridge with real weights: each pixel's own dual factorisation
        (Policy("ridge", ridge=0.3), True, False),
    ],
)
def test_dual_by_gaps_matches_each_pixels_own_solution(
    policy: Policy, weighted: bool, gapwise: bool
) -> None:
    """coef > obs with gaps: the Schur-complement dual equals numpy on each pixel's rows."""
    rng = np.random.default_rng(7)
    obs, coef, n = 30, 60, 3000
    A = rng.standard_normal((obs, coef))
    valid = rng.random((obs, n)) > 0.25
    valid[:, 0] = False  # all missing (inactive)
    valid[1:, 1] = False  # a single valid row
    valid[:, 2] = True  # gap-free
    B = rng.standard_normal((obs, n))
    W = valid * (rng.uniform(0.5, 2.0, (obs, n)) if weighted else 1.0)
    active = torch.ones(n, dtype=torch.bool)
    active[0] = False
    At = torch.from_numpy(A)
    zero_one = not weighted
    assert (gapwise_dual(At, policy, False, zero_one) is not None) is gapwise
    B0 = torch.from_numpy(np.where(valid, B, 0.0))
    x, status = linalg.solve_per_pixel(At, B0, torch.from_numpy(W), policy, active=active)
    assert bool((status[1:] == OK).all())
    lam = policy.ridge if policy.policy == "ridge" else 0.0
    for p in [1, 2, *range(3, n, 211)]:
        rows = valid[:, p]
        if weighted and lam:
            sw = np.sqrt(W[rows, p])
            Av, bv = A[rows] * sw[:, None], B[rows, p] * sw
            expected = Av.T @ np.linalg.solve(Av @ Av.T + lam * np.eye(len(Av)), bv)
        else:
            expected = _dual_oracle(A, B[:, p], rows, lam)
        np.testing.assert_allclose(x[:, p].numpy(), expected, rtol=1e-10, atol=1e-12)
    # and a pixel's result does not depend on its batch (sorting by gap count included)
    for s, e in [(1, 2), (5, 700), (1500, 3000)]:
        part, part_status = linalg.solve_per_pixel(
            At, B0[:, s:e], torch.from_numpy(W[:, s:e]), policy, active=active[s:e]
        )
        assert torch.equal(part_status, status[s:e])
        assert not _agree(part, x[:, s:e])


def test_dual_by_gaps_needs_a_well_conditioned_shared_matrix() -> None:
    """Nearly dependent design rows: not by gaps, and every pixel still equals numpy."""
    rng = np.random.default_rng(3)
    obs, coef, n = 12, 20, 400
    A = rng.standard_normal((obs, coef))
    A[5] = A[4] + 1e-7 * rng.standard_normal(coef)  # AAᵀ has condition ~1e15
    At = torch.from_numpy(A)
    assert gapwise_dual(At, Policy("minnorm"), False, True) is None
    assert gapwise_dual(At, Policy("ridge", ridge=1.0), False, True) is not None
    valid = rng.random((obs, n)) > 0.2
    B = rng.standard_normal((obs, n))
    B0 = torch.from_numpy(np.where(valid, B, 0.0))
    x, status = linalg.solve_per_pixel(
        At, B0, torch.from_numpy(valid.astype(float)), Policy("ridge", ridge=1.0)
    )
    assert bool((status == OK).all())
    for p in range(0, n, 37):
        expected = _dual_oracle(A, B[:, p], valid[:, p], 1.0)
        np.testing.assert_allclose(x[:, p].numpy(), expected, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("cond", [10.0, 3e3, 9e3])
def test_dual_by_gaps_keeps_float64_accuracy_on_ill_conditioned_designs(cond: float) -> None:
    """cond(A) up to the gate's 1e4: every pixel converges, as accurate as its own solve."""
    rng = np.random.default_rng(int(cond))
    obs, coef, n = 30, 60, 400
    U, _ = np.linalg.qr(rng.standard_normal((obs, obs)))
    V, _ = np.linalg.qr(rng.standard_normal((coef, obs)))
    A = (U * np.geomspace(1.0, 1.0 / cond, obs)) @ V.T
    At = torch.from_numpy(A)
    policy = Policy("minnorm")
    assert gapwise_dual(At, policy, False, True) is not None
    valid = rng.random((obs, n)) > 0.2
    B = rng.standard_normal((obs, n))
    B0 = torch.from_numpy(np.where(valid, B, 0.0))
    W = torch.from_numpy(valid.astype(float))
    x, status = linalg.solve_per_pixel(At, B0, W, policy)
    assert bool((status == OK).all())
    # solved by gaps, every pixel converged (none sent to the slower SVD path)
    H = gapwise_dual(At, policy, False, True)
    assert H is not None
    _, good = _dual_schur(At, B0, W > 0, 0.0, H, None)
    assert bool(good.all())
    worst = 0.0
    for p in range(n):
        ref = _dual_oracle(A, B[:, p], valid[:, p], 0.0)
        worst = max(worst, float(np.abs(x[:, p].numpy() - ref).max() / np.abs(ref).max()))
    assert worst < 1e-15 * cond * 100, worst


def _gram_batch(n: int, p: int, seed: int) -> torch.Tensor:
    """(n, n, p) Gram matrices: most positive definite, some singular, one zero."""
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(n + 3, n, p, dtype=torch.float64, generator=g)
    X[:, -1, : p // 4] = X[:, 0, : p // 4]  # a repeated column: singular
    X[:, :, -1] = 0.0
    return torch.einsum("oip,ojp->ijp", X, X)


@pytest.mark.parametrize("n", [1, 2, 3, 7, 10])
def test_packed_cholesky_is_the_square_ones_lower_triangle(n: int) -> None:
    G = _gram_batch(n, 200, n)
    r, c = lower_pairs(n)
    packed = G[r, c].contiguous()
    ok = packed_cholesky(packed, n)
    L, ok_square = batched_cholesky(G.clone())
    assert torch.equal(ok, ok_square)
    assert ok.any() and (n == 1 or not ok.all())
    np.testing.assert_allclose(packed[:, ok], L[r, c][:, ok], rtol=1e-14, atol=1e-14)
    # and it is the factor: L Lᵀ = G for the pixels that factored
    full = torch.zeros_like(G)
    full[r, c] = packed
    rebuilt = torch.einsum("ikp,jkp->ijp", full, full)
    np.testing.assert_allclose(rebuilt[:, :, ok], G[:, :, ok], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("n", [1, 4, 10])
def test_packed_factor_solves_each_pixels_system(n: int) -> None:
    G = _gram_batch(n, 120, 10 + n)
    r, c = lower_pairs(n)
    packed = G[r, c].contiguous()
    ok = packed_cholesky(packed, n)
    h = torch.randn(n, 120, dtype=torch.float64, generator=torch.Generator().manual_seed(n))
    x = PackedFactor(packed, n).solve_(h.clone())
    for px in torch.nonzero(ok).flatten().tolist():
        want = np.linalg.solve(G[:, :, px].numpy(), h[:, px].numpy())
        np.testing.assert_allclose(x[:, px].numpy(), want, rtol=1e-9, atol=1e-12)


def test_zero_one_weights_shortcut_changes_nothing() -> None:
    g = torch.Generator().manual_seed(5)
    A = torch.randn(30, 6, dtype=torch.float64, generator=g)
    W = (torch.rand(30, 500, generator=g) > 0.25).double()
    B0 = torch.randn(30, 500, dtype=torch.float64, generator=g) * W
    pol = Policy("minnorm")
    x1, s1 = linalg.solve_per_pixel(A, B0, W, pol, unit=True)
    x0, s0 = linalg.solve_per_pixel(A, B0, W, pol, unit=False)
    assert torch.equal(x1, x0) and torch.equal(s1, s0)
    for px in (0, 17, 499):
        on = W[:, px].bool().numpy()
        want = np.linalg.lstsq(A.numpy()[on], B0[:, px].numpy()[on], rcond=None)[0]
        np.testing.assert_allclose(x1[:, px].numpy(), want, rtol=1e-10)


def test_compensated_residuals_are_the_exact_ones_rounded() -> None:
    """b − A·x with cancelling terms: exact (fractions) to an ulp, where float64 loses digits."""
    from fractions import Fraction

    rng = np.random.default_rng(7)
    t = rng.uniform(-9, -3, 40)
    A = t[:, None] ** np.arange(11)[None, :]  # Filip's columns: x⁰ … x¹⁰
    x = rng.standard_normal((11, 3)) * 10.0 ** -np.arange(11)[:, None]
    B = A @ x + 1e-6 * rng.standard_normal((40, 3))  # residuals ~1e-6 of terms ~1e3
    got = compensated_residuals(torch.from_numpy(A), torch.from_numpy(B), torch.from_numpy(x))
    exact = np.array(
        [
            [
                float(
                    Fraction(B[i, p])
                    - sum(Fraction(A[i, j]) * Fraction(x[j, p]) for j in range(11))
                )
                for p in range(3)
            ]
            for i in range(40)
        ]
    )
    np.testing.assert_allclose(got.numpy(), exact, rtol=4e-16, atol=0)
    plain = B - A @ x
    assert np.abs(plain - exact).max() > 1e3 * np.abs(got.numpy() - exact).max()


def test_per_pixel_spread_of_an_ill_conditioned_design_is_householder_qr_s() -> None:
    """NIST's Filip (cond 1.8e15) per pixel with weights: the variances QR of each pixel's
    weighted rows gives, and standard errors to the certified values' 7 digits."""
    import nist_strd

    ds = next(d for d in nist_strd.DATASETS if d.name == "Filip")
    A, y = ds.design(), ds.response()
    n, coef = A.shape
    w = np.array([1.0, 0.5, 2.0, 1.0])
    Wp = np.repeat(w[None, :], n, axis=0)
    Wp[3, 3] = 0.0  # a gap of its own
    B0 = np.repeat(y[:, None], 4, axis=1) * (Wp > 0)
    _, status, sp = linalg.solve_per_pixel_spread(
        torch.from_numpy(A),
        torch.from_numpy(B0),
        torch.from_numpy(Wp),
        Policy("minnorm"),
        spans_known=True,
    )
    assert (status.numpy() == OK).all() and sp.rss is not None
    for p in range(4):
        Ri = np.linalg.inv(np.linalg.qr(np.sqrt(Wp[:, p])[:, None] * A, mode="r"))
        np.testing.assert_allclose(sp.var[:, p].numpy(), (Ri * Ri).sum(1), rtol=1e-12)
    se = np.sqrt(sp.rss.numpy()[:3] / (n - coef) * sp.var.numpy()[:, :3])
    assert nist_strd.lre(se, np.array(ds.sd)[:, None]).min() >= 7.0


def test_inverses_keep_the_invertible_matrices_of_a_stack() -> None:
    R = np.stack([np.eye(3) * 2.0, np.diag([1.0, 0.0, 1.0]), np.triu(np.ones((3, 3)))])
    out, keep = _inverses(R)
    assert keep.tolist() == [True, False, True]
    np.testing.assert_allclose(out[0], np.eye(3) / 2)
    np.testing.assert_allclose(out[2] @ R[2], np.eye(3), atol=1e-15)
