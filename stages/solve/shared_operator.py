"""The shared operator: one design (or one gap pattern) for many pixels, solved by a float64 SVD.

:func:`svd_operator` gives the solution operator ``P`` (coef × obs) for the chosen
policy, then ``C = P @ B`` is one matrix product over the pixels; :func:`operator_spread`
its unscaled covariance ``P_w P_wᵀ``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from gridsolve.stages.solve.policy import (
    CONST_TOL,
    FELL_BACK_MINNORM,
    FELL_BACK_RIDGE,
    IDENT_TOL,
    OK,
    SINGULAR,
    UNDERDETERMINED,
    Policy,
)


@dataclass(frozen=True)
class Operator:
    """``c = P @ (sqrtw * b)`` for every pixel sharing a design; how it was obtained."""

    P: np.ndarray  # (coef, rows) float64
    status: int
    rank: int
    cond: float  # amplification s_max·‖P‖ of the solve actually used
    method: str
    #: (coef,) whether each coefficient is identifiable (see IDENT_TOL)
    identifiable: np.ndarray | None = None
    #: (coef,) whether the rows determine each coefficient, whatever the policy (ridge
    #: too): its unit vector lies in their row space at the rank cutoff; None: all do
    determined: np.ndarray | None = None


def _filter(s: np.ndarray, how: str, ridge: float, cutoff: float) -> np.ndarray:
    if how == "ridge":
        out: np.ndarray = s / (s * s + ridge)
        return out
    keep = s > cutoff * (s[0] if s.size else 0.0)
    out = np.where(keep, 1.0 / np.where(keep, s, 1.0), 0.0)
    return out


def svd_operator(
    Aw: np.ndarray,
    pol: Policy,
    svd: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None,
) -> Operator:
    """Solution operator of the weighted design ``Aw`` (rows × coef) under ``pol``.

    ``svd`` is the thin SVD of ``Aw`` when already known. Under ``cholesky`` a
    rank-deficient ``Aw`` is solved by the fallback (status flagged), or gets
    status ``singular`` with a NaN operator.
    """
    rows, coef = Aw.shape
    U, s, Vt = svd if svd is not None else np.linalg.svd(Aw, full_matrices=False)
    cut = pol.cutoff(rows, coef)
    # The rank is decided on the column-equilibrated rows (unit 2-norm columns): a
    # design whose columns differ in scale by 1e10 (Filip's x⁰…x¹⁰) is not rank
    # deficient, and the raw cutoff truncated it (0 correct digits of NIST's values).
    d = np.linalg.norm(Aw, axis=0)
    d = np.where(d > 0, d, 1.0)
    Ue, se, Vte = np.linalg.svd(Aw / d, full_matrices=False)
    rank = int((se > cut * (se[0] if se.size else 0.0)).sum()) if se.size else 0
    # e_j lies in the row space of Aw D⁻¹ iff it lies in that of Aw (D diagonal)
    determined = None if rank == coef else (Vte[:rank] ** 2).sum(axis=0) >= 1.0 - IDENT_TOL
    how, status = pol.policy, OK
    if rank == coef and how != "ridge" and rows >= coef:
        # Full column rank: the least-squares solution is unique and the same from the
        # equilibrated factorisation, whose error grows with its condition number
        # (Filip 5e9, Pontius 18), not the raw one (1.8e15, 1.4e13).
        P = (Vte.T / se) @ Ue.T / d[:, None]  # c = D⁻¹ V S⁻¹ Uᵀ b
        raw_cond = float(s[0] / s[-1]) if s.size and s[-1] > 0 else float("inf")
        method = "cholesky" if how == "cholesky" else "svd-" + how
        return Operator(P, OK, rank, raw_cond, method, np.ones(coef, dtype=bool))
    if how == "cholesky":
        if rank == coef:
            try:
                import scipy.linalg

                factor = scipy.linalg.cho_factor(Aw.T @ Aw, lower=True, check_finite=False)
                P = scipy.linalg.cho_solve(factor, Aw.T, check_finite=False)
                inv = 1.0 / s
                return Operator(P, OK, rank, float(s[0] * inv.max()), "cholesky")
            except np.linalg.LinAlgError:
                pass
        if pol.fallback == "none":
            return Operator(
                np.full((coef, rows), np.nan),
                SINGULAR,
                rank,
                float("inf"),
                "singular",
                np.zeros(coef, dtype=bool),
                determined,
            )
        how = pol.fallback
        status = FELL_BACK_RIDGE if how == "ridge" else FELL_BACK_MINNORM
    if rank < coef:
        # truly rank-deficient: the policy's solution is kept, never labelled ok
        status = UNDERDETERMINED
    inv = _filter(s, how, pol.ridge, cut)
    P = (Vt.T * inv) @ U.T
    cond = float(s[0] * inv.max()) if s.size and inv.max() > 0 else float("inf")
    # the raw minimum-norm fit (numpy's lstsq) keeps its raw truncation
    raw_rank = int((s > cut * (s[0] if s.size else 0.0)).sum()) if s.size else 0
    if how == "ridge" or raw_rank == coef:
        ident = np.ones(coef, dtype=bool)
    else:
        ident = (Vt[:raw_rank] ** 2).sum(axis=0) >= 1.0 - IDENT_TOL
    return Operator(P, status, rank, cond, "svd-" + how, ident, determined)


def spans_constant(A: np.ndarray, pol: Policy) -> bool:
    """Whether the constant vector lies in the column space of ``A`` (rows × coef)."""
    rows, coef = A.shape
    if rows == 0 or not np.isfinite(A).all():
        return False
    U, s, _ = np.linalg.svd(A, full_matrices=False)
    if not s.size or s[0] == 0:
        return False
    keep = s > pol.cutoff(rows, coef) * s[0]
    proj = U[:, keep].T @ np.ones(rows)
    return bool(proj @ proj >= (1.0 - CONST_TOL) * rows)


def operator_spread(
    Pw: np.ndarray, Aw: np.ndarray, identifiable: np.ndarray, full: bool
) -> tuple[np.ndarray, float, np.ndarray | None]:
    """Unscaled variances (NaN where not identifiable), effective parameters and covariance.

    ``Pw`` (coef × rows) maps the weighted data ``S b`` of the weighted design
    ``Aw`` to the coefficients; the covariance is returned when ``full``.
    """
    cov = Pw @ Pw.T
    cov[~identifiable, :] = np.nan
    cov[:, ~identifiable] = np.nan
    edf = float(np.trace(Pw @ Aw)) if Pw.size else 0.0
    return np.diagonal(cov).copy(), edf, cov if full else None
