"""Batched least-squares numerics, pixel-last (pixels are the last axis everywhere).

Two families:

* :func:`svd_operator` — one design (or one gap pattern) shared by many pixels:
  a float64 SVD gives the solution operator ``P`` (coef × obs) for the chosen
  policy, then ``C = P @ B`` is one matrix product over the pixels.
* :func:`solve_per_pixel` — every pixel with its own weights ``W_p`` (its own
  gaps): per-pixel normal equations in float64, factored by a vectorised
  Cholesky (a loop over the matrix order, vectorised over pixels; far faster
  than a batched LAPACK call for small matrices on CPU) and refined twice
  (corrected semi-normal equations), so the error does not grow with the
  square of the condition number. Pixels whose factorisation fails, or whose
  refinement does not converge, are solved by a batched SVD of their own
  weighted rows: the same answer ``numpy.linalg.lstsq`` gives.

When ``coef`` exceeds ``obs``, the minimum-norm and ridge solutions use the
dual form ``c = AᵀS (SAAᵀS + λI)⁻¹ S b`` (S = W_p^½), whose matrix is
obs × obs instead of coef × coef.

Uncertainty (:class:`Spread`) comes from the same factorisations: every
solution is ``c = P_w S b`` for an operator ``P_w`` of the weighted rows
``X = S A``, so under the WLS model (Cov(S b) = σ²I) the coefficients'
unscaled covariance is ``P_w P_wᵀ``: ``(XᵀX)⁻¹`` for a full-rank fit, the
pseudo-inverse's ``V Σ⁻² Vᵀ`` for minimum norm, and for ridge the sandwich
``(XᵀX+λI)⁻¹ XᵀX (XᵀX+λI)⁻¹``. The effective number of parameters is
``tr(X P_w)``: the rank, or ``Σ s²/(s²+λ)`` under ridge.
"""

from __future__ import annotations

import functools
import math
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import numpy as np
import torch

from gridsolve.schemas.contracts import STATUS_CODES
from gridsolve.stages.solve import kernel

EPS64 = float(np.finfo(np.float64).eps)
OK = STATUS_CODES["ok"]
ALL_MISSING = STATUS_CODES["all_missing"]
TOO_FEW = STATUS_CODES["too_few_observations"]
FELL_BACK_RIDGE = STATUS_CODES["fell_back_to_ridge"]
FELL_BACK_MINNORM = STATUS_CODES["fell_back_to_minimum_norm"]
SINGULAR = STATUS_CODES["singular"]
UNDERDETERMINED = STATUS_CODES["underdetermined"]
#: The statuses of pixels whose coefficients are finite (solved by some policy).
SOLVED = (OK, FELL_BACK_RIDGE, FELL_BACK_MINNORM, UNDERDETERMINED)

#: A design whose raw condition number is at least this gets one more refinement
#: step against the data in its own coordinates (per pixel, and the shared and
#: gap-pattern operators in lstsq); below it the step changes nothing measurable.
REFINE_COND = 1e6
#: A design whose column-equilibrated condition number is at least this (NIST's Filip:
#: 5e9; a raw quadratic in calendar years: 2e6) takes each pixel's variances from a QR
#: of its own rows: there float64's spread is at its limit, and the normal equations'
#: draw of it differed from QR's by up to a digit.
QR_SPREAD_COND = 1e8
#: Refinement steps of the per-pixel normal equations, and the relative size
#: of the last correction (its largest magnitude over the coefficients' largest)
#: above which a pixel goes to the SVD path instead.
REFINE_STEPS = 2
REFINE_TOL = 1e-11
#: A Cholesky pivot below this fraction of its diagonal entry means the
#: pixel's design is (nearly) rank-deficient, κ(A) ≳ 1e5: solve it by SVD.
PIVOT_TOL = 1e-10
#: A minimum-norm coefficient is identifiable when the unit vector of its column
#: lies in the row space of the pixel's design: its squared projection onto that
#: space (1 when it does) may fall short of 1 by this much (rounding, measured
#: in tests/stages/test_uncertainty.py); otherwise its uncertainty is NaN.
IDENT_TOL = 1e-6
#: The constant vector is in a design's column space when its squared distance
#: to that space is at most this fraction of its squared norm.
CONST_TOL = 1e-10


@dataclass(frozen=True)
class Policy:
    """How singular or ill-posed systems are handled (see LstsqSolve)."""

    policy: str  # minnorm | cholesky | ridge
    ridge: float = 0.0
    rcond: float | None = None
    fallback: str = "minnorm"  # minnorm | ridge | none

    def cutoff(self, rows: int, coef: int) -> float:
        """Relative singular-value cutoff (numpy.linalg.lstsq's default when unset)."""
        return self.rcond if self.rcond is not None else EPS64 * max(rows, coef)


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


# ---------------------------------------------------------------- per pixel
# Every operation along the pixel axis is elementwise, a matrix product, or a
# sum over a small axis in an order fixed by its length (stable_sum), so a
# pixel's result does not depend on
# which other pixels share its tile or chunk beyond the rounding of the matrix
# products: MKL picks kernels by the product's width and the CPU's
# instructions (on its AVX2 path the last bits change with the width). That is
# the agreement bound of stages/engine/agreement.py, not equal bits; see
# tests/stages/test_linalg.py and test_determinism.py. Very narrow products (a
# single column takes a matrix-vector path that rounds differently again) are
# padded to MIN_WIDTH so that small tiles stay close to large ones.
MIN_WIDTH = 64


def colmm(M: torch.Tensor, X: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``M @ X``, with narrow X padded on CPU so that it takes the matrix-matrix kernels.

    ``out``: where to write it (contiguous, M's rows × X's columns), e.g. a
    tensor over a numpy array: numpy backs large arrays with huge pages, so
    writing a 100 MB product into one costs a third less than into a fresh tensor.
    """
    n = X.shape[1]
    if X.device.type != "cpu" or n >= MIN_WIDTH:
        if out is None:
            return M @ X
        return torch.mm(M, X, out=out)
    padded = X.new_zeros((X.shape[0], MIN_WIDTH))
    padded[:, :n] = X
    if out is None:
        return (M @ padded)[:, :n]
    out.copy_((M @ padded)[:, :n])
    return out


def colmm_sub(
    C: torch.Tensor, M: torch.Tensor, X: torch.Tensor, in_place: bool = False
) -> torch.Tensor:
    """``C − M @ X`` by one product that reads ``C`` (padded as :func:`colmm`).

    A new tensor, or ``C`` itself with ``in_place`` (no copy of ``C`` then).
    """
    n = X.shape[1]
    if X.device.type != "cpu" or n >= MIN_WIDTH:
        if in_place:
            return C.addmm_(M, X, alpha=-1)
        return torch.addmm(C, M, X, alpha=-1)
    # narrow: the same addmm on operands padded to MIN_WIDTH, so it rounds as a wide one
    Cp, Xp = C.new_zeros((C.shape[0], MIN_WIDTH)), X.new_zeros((X.shape[0], MIN_WIDTH))
    Cp[:, :n], Xp[:, :n] = C, X
    out = Cp.addmm_(M, Xp, alpha=-1)[:, :n]
    return C.copy_(out) if in_place else out.contiguous()


def host_empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An uninitialised tensor; on CPU over a numpy array (huge pages: see :func:`colmm`)."""
    if device.type != "cpu":
        return torch.empty(shape, dtype=dtype, device=device)
    return torch.from_numpy(np.empty(shape, dtype=torch.empty((), dtype=dtype).numpy().dtype))


def stable_sum(x: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """Sum over ``dim`` in an order fixed by its length alone (batch-independent on CPU).

    Pairwise: the two halves added, again and again (an odd one out is added to
    the first entry), so ⌈log₂ n⌉ operations instead of n, and more accurate.
    """
    if x.device.type != "cpu" or x.shape[dim] == 0:
        return x.sum(dim)
    n = x.shape[dim]
    if n == 1:
        return x.select(dim, 0).clone()
    half = n // 2
    acc = x.narrow(dim, 0, half) + x.narrow(dim, half, half)
    if n % 2:
        acc.select(dim, 0).add_(x.select(dim, n - 1))
    n = half
    while n > 1:
        half = n // 2
        acc.narrow(dim, 0, half).add_(acc.narrow(dim, half, half))
        if n % 2:
            acc.select(dim, 0).add_(acc.select(dim, n - 1))
        n = half
    # a copy: a view would keep the half-size buffer alive with the result
    return acc.select(dim, 0).clone()


def column_rms(R: torch.Tensor, n: torch.Tensor | float) -> torch.Tensor:
    """``√(Σ r² / n)`` of every column of ``R``, free of overflow and underflow in the squares.

    NaN or inf in a column gives NaN or inf for it, as the plain formula does.
    """
    if R.shape[0] == 0:
        out = host_empty((R.shape[1],), R.dtype, R.device)
        return out.zero_()
    ss = stable_sum(R * R)
    # The plain sum is right unless it overflowed, or is so small that squares
    # lost to underflow (each < tiny) could matter: n·tiny ≤ ε/4 of it.
    fi = torch.finfo(R.dtype)
    small = 4 * R.shape[0] * fi.tiny / fi.eps
    redo = ~((ss >= small) & (ss <= fi.max))  # NaN columns too: they stay NaN
    if bool(redo.any()):
        # Scale those columns by the power of two just above their largest |r|
        # (exact): r² then neither overflows (1e20 in float32) nor underflows (1e-30).
        cols = torch.nonzero(redo).flatten()
        Rc = R[:, cols]
        e = _pow2_exponent(Rc)
        S = torch.ldexp(Rc, -e)
        scaled = torch.sqrt(stable_sum(S * S) / (n[cols] if isinstance(n, torch.Tensor) else n))
        half = torch.div(e, 2, rounding_mode="floor")  # 2^e itself may overflow: two steps
        out = torch.sqrt(ss / n)
        out[cols] = torch.ldexp(torch.ldexp(scaled, half), e - half)
        return out
    return torch.sqrt(ss / n)


def residual_moments(
    A: torch.Tensor,
    B0: torch.Tensor,
    W: torch.Tensor,
    x: torch.Tensor,
    n: torch.Tensor,
    full: bool = True,
    centred_only: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """Per column, RMS of the residuals and the data; None where the kernel cannot run.

    Over each column's ``n`` valid rows (``W`` > 0): of ``r = B0 − A x``, of ``√W·r``,
    of ``√W·(b − b̄)`` about the weighted mean, and of ``√W·b`` (these three only with
    ``full``, else zeros; with ``centred_only``, the second and fourth are zeros). The
    compiled kernel reads each pixel's data once; columns whose sums overflowed or may
    have lost squares to underflow are redone as :func:`column_rms` does.
    """
    if not 1 <= A.shape[1] <= kernel.MAX_ORDER or not kernel.usable(A, B0, W, x):
        return None
    sums = kernel.moments(A, B0, W, x, full, centred_only)
    fi = torch.finfo(sums.dtype)
    # the rows asked for (the others are zeros)
    checked = sums[:1] if not full else sums[0::2] if centred_only else sums
    redo = ~((checked >= 4 * B0.shape[0] * fi.tiny / fi.eps) & (checked <= fi.max)).all(0)
    checked.div_(n).sqrt_()
    ss, wss, tss, uss = sums.unbind(0)
    if bool(redo.any()):
        c = torch.nonzero(redo).flatten()
        Bc, Wc, nc = B0[:, c], W[:, c], n[c]
        valid, SW = Wc > 0, Wc.sqrt()
        R = colmm_sub(Bc, A, x[:, c]).mul_(valid)
        ss[c] = column_rms(R, nc)
        if full:
            mean = (Wc * Bc).sum(0) / Wc.sum(0)
            tss[c] = column_rms((Bc - mean).mul_(SW), nc)
        if full and not centred_only:
            wss[c], uss[c] = column_rms(R * SW, nc), column_rms(Bc * SW, nc)
    return ss, wss, tss, uss


def batched_cholesky(G: torch.Tensor, tol: float = PIVOT_TOL) -> tuple[torch.Tensor, torch.Tensor]:
    """Lower Cholesky factors of ``G`` (n, n, P), in place, and which pixels factored well.

    ``G``'s lower triangle is overwritten with the factor (its upper triangle
    is left as scratch). A pixel fails when a pivot falls below ``tol`` times
    its own diagonal entry: that column is (nearly) a combination of the
    earlier ones, so the normal equations cannot be trusted and the pixel
    goes to the SVD path.
    """
    n, _, p = G.shape
    if kernel.usable(G):
        return G, kernel.cholesky(G, n, tol, square=True)
    diag = torch.diagonal(G, dim1=0, dim2=1).T.clone()  # (n, P), before factoring
    ok = torch.ones(p, dtype=torch.bool, device=G.device)
    tiny = torch.finfo(G.dtype).tiny
    for j in range(n):
        d2 = G[j, j]
        ok &= d2 > (tol * diag[j]).clamp_min(tiny)
        # A failed pixel's factor is garbage (maybe NaN); the caller re-solves it by SVD.
        d = d2.clamp_min(tiny).sqrt()
        G[j:, j] /= d
        if j + 1 < n:
            col = G[j + 1 :, j]
            G[j + 1 :, j + 1 :].addcmul_(col[:, None], col[None, :], value=-1)
    return G, ok


def cholesky_solve(L: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """Solve ``L Lᵀ x = h`` for every pixel, in place in ``h``: L (n, n, P), h (n, P)."""
    n = L.shape[0]
    if kernel.usable(L, h):
        return kernel.solve_(L, n, h, square=True)
    for i in range(n):
        h[i] /= L[i, i]
        if i + 1 < n:
            h[i + 1 :].addcmul_(L[i + 1 :, i], h[i], value=-1)
    for i in range(n - 1, -1, -1):
        h[i] /= L[i, i]
        if i:
            h[:i].addcmul_(L[i, :i], h[i], value=-1)
    return h


@functools.cache
def lower_pairs(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Row and column indices of an n × n lower triangle, packed column after column.

    Column ``j`` (rows ``j…n-1``) starts at ``j·n − j(j−1)/2``: the layout of
    :func:`packed_cholesky`, in which every column of the factor is one slice.
    """
    rows = [r for j in range(n) for r in range(j, n)]
    cols = [j for j in range(n) for _ in range(j, n)]
    return torch.tensor(rows), torch.tensor(cols)


@functools.cache
def _row_order(n: int) -> torch.Tensor:
    """Gather index: entry k of the triangle packed by rows is entry ``index[k]`` by columns."""
    r, c = lower_pairs(n)
    return torch.tensor(sorted(range(len(r)), key=lambda k: (int(r[k]), int(c[k]))))


def _column_start(j: int, n: int) -> int:
    return j * n - j * (j - 1) // 2


def packed_cholesky(
    G: torch.Tensor,
    n: int,
    tol: float = PIVOT_TOL,
    spread: tuple[torch.Tensor | None, torch.Tensor] | None = None,
    rhs: torch.Tensor | None = None,
) -> torch.Tensor:
    """Factor packed lower triangles ``G`` (n(n+1)/2, P) in place; which pixels factored well.

    :func:`batched_cholesky` on the packed layout of :func:`lower_pairs`: half
    the memory passes of the square one, since only the lower triangle is
    updated. Same failure rule (a pivot below ``tol`` times its diagonal entry).
    ``spread``, ``rhs``: for :func:`kernel.cholesky` (compiled kernel only).
    """
    if kernel.usable(G):
        return kernel.cholesky(G, n, tol, spread=spread, rhs=rhs)
    assert spread is None and rhs is None, "the fused passes are the compiled kernel's"
    p = G.shape[1]
    starts = [_column_start(j, n) for j in range(n)]
    diag = G[starts].clone()  # (n, P), before factoring
    ok = torch.ones(p, dtype=torch.bool, device=G.device)
    tiny = torch.finfo(G.dtype).tiny
    for j in range(n):
        col = G[starts[j] : starts[j] + n - j]  # L[j:, j]
        d2 = col[0]
        ok &= d2 > (tol * diag[j]).clamp_min(tiny)
        # A failed pixel's factor is garbage (maybe NaN); the caller re-solves it by SVD.
        col /= d2.clamp_min(tiny).sqrt()
        for c in range(j + 1, n):  # L[c:, c] -= L[c:, j]·L[c, j]
            G[starts[c] : starts[c] + n - c].addcmul_(col[c - j :], col[c - j], value=-1)
    return ok


class PackedFactor:
    """A packed Cholesky factor (:func:`packed_cholesky`) ready for solves: columns and rows."""

    def __init__(self, L: torch.Tensor, n: int, var: torch.Tensor | None = None) -> None:
        self.n = n
        self.cols = L
        self.starts = [_column_start(j, n) for j in range(n)]
        self.compiled = kernel.usable(L)
        #: diag(ZᵀZ) of Z = L⁻¹T, when the factorisation computed it (:func:`_primal`)
        self.var = var

    @functools.cached_property
    def rows(self) -> torch.Tensor:
        """L's rows packed one after the other (row i: ``L[i, :i+1]`` at i(i+1)/2)."""
        return self.cols[_row_order(self.n).to(self.cols.device)]

    def column(self, j: int) -> torch.Tensor:
        """``L[j:, j]`` (n−j, P)."""
        return self.cols[self.starts[j] : self.starts[j] + self.n - j]

    def solve_(self, h: torch.Tensor) -> torch.Tensor:
        """Solve ``L Lᵀ x = h`` for every pixel, in place in ``h`` (n, P)."""
        n = self.n
        if self.compiled and kernel.usable(h):
            return kernel.solve_(self.cols, n, h)
        for i in range(n):
            col = self.column(i)
            h[i] /= col[0]
            if i + 1 < n:
                h[i + 1 :].addcmul_(col[1:], h[i], value=-1)
        for i in range(n - 1, -1, -1):
            row = self.rows[i * (i + 1) // 2 : (i + 1) * (i + 2) // 2]  # L[i, :i+1]
            h[i] /= row[i]
            if i:
                h[:i].addcmul_(row[:i], h[i], value=-1)
        return h


def _pow2_exponent(X: torch.Tensor) -> torch.Tensor:
    """Per column, ``e`` with 2^(e-1) ≤ max |x| < 2^e (0 for a zero column), 2^-e finite."""
    _, e = torch.frexp(_max_abs(X))
    return e.clamp_min(math.frexp(torch.finfo(X.dtype).tiny)[1])


def _converged(dx: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Per column: the largest correction is at most REFINE_TOL × the largest coefficient."""
    # Largest magnitudes, not norms: no squares to overflow or underflow, and a
    # quarter of the passes (it runs on every batch of the per-pixel path).
    xm = _max_abs(x)
    return torch.isfinite(xm) & (_max_abs(dx) <= REFINE_TOL * xm)


def _step(
    ok: torch.Tensor, conv: torch.Tensor | None, *pairs: tuple[torch.Tensor, torch.Tensor]
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One refinement step: each ``(value, correction)`` pair corrected; which pixels converged.

    The first step (``conv`` None) corrects every pixel; later steps only the pixels
    that have not converged yet, so how often a pixel is refined never depends on the
    other pixels of its batch (the loop stops once every pixel has). Convergence is
    judged on the first pair (the coefficients).
    """
    if len(pairs) == 1 and kernel.usable(*pairs[0]) and ok.device.type == "cpu":
        x, dx = pairs[0]  # one pass over both instead of a dozen reductions
        return kernel.step(x, dx, ok.contiguous(), conv, REFINE_TOL), [x]
    if conv is None:
        out = [v.add_(d) for v, d in pairs]
        return ok & _converged(pairs[0][1], out[0]), out
    more = ok & ~conv
    out = [torch.where(more, v + d, v) for v, d in pairs]
    return conv | (more & _converged(pairs[0][1], out[0])), out


def _max_abs(X: torch.Tensor) -> torch.Tensor:
    """Per column, the largest magnitude (NaN where a column has one)."""
    # max and −min: no |X| array (half the time of X.abs().amax at coef 100)
    return torch.maximum(X.amax(dim=0), -X.amin(dim=0))


@dataclass(frozen=True)
class _Setup:
    """What every batch of a design shares in :func:`_primal`."""

    basis: torch.Tensor  # Q of A = QR, or A itself when not preconditioned
    pairs: torch.Tensor  # the basis's packed Gram rows
    Rinv: torch.Tensor | None  # R⁻¹ (None: not preconditioned)
    lam_mat: torch.Tensor | None  # λ in the basis (None: no ridge)
    #: the raw design's condition number is ≥ REFINE_COND: one more refinement step
    #: against the data in the user's coordinates (see :func:`_primal`)
    refine_raw: bool = False
    #: the column-equilibrated design's condition number is ≥ QR_SPREAD_COND: per-pixel
    #: variances from a QR of each pixel's rows (see :func:`_qr_spread`)
    qr_spread: bool = False


_SETUPS: dict[tuple[bytes, tuple[int, ...], str, str, float], _Setup] = {}
_SETUPS_LOCK = threading.Lock()


def _primal_setup(A: torch.Tensor, lam: float) -> _Setup:
    """The design's basis, its packed Gram rows, ``R⁻¹`` and ``λ`` in that basis.

    The same for every batch of a design: kept for the last few designs (keyed by
    their content), so a tile's batches do not repeat the small factorisations.
    """
    key = (A.cpu().numpy().tobytes(), tuple(A.shape), str(A.dtype), str(A.device), lam)
    with _SETUPS_LOCK:
        hit = _SETUPS.get(key)
    if hit is not None:
        return hit
    obs, coef = A.shape
    # Work in an orthonormal basis Q of the design (A = Q·R): each pixel's Gram
    # matrix QᵀW_pQ is then near the identity unless its gaps are severe, however
    # badly the user's columns are scaled; c = R⁻¹·c'. Q rather than the SVD's U:
    # R⁻¹ is triangular, so the spread's L⁻¹R⁻ᵀ is too (a third of the work).
    # Decided on the column-equilibrated design, so that columns of very different
    # scales (Filip's x⁰…x¹⁰: raw cond 1.8e15, equilibrated 5e9) still get an
    # orthonormal basis instead of their raw, unfactorable Gram. Householder QR is
    # itself indifferent to the columns' scales: the raw A is factored (the same Q;
    # factoring A·D⁻¹ instead cost the masked benchmark 1.8×, its refinement
    # converging less often).
    d = torch.linalg.vector_norm(A, dim=0)
    d = torch.where(d > 0, d, torch.ones_like(d))
    s = torch.linalg.svdvals(A / d)
    precondition = bool(s[-1] > s[0] * EPS64 * max(obs, coef) * 1e3)
    eye = torch.eye(coef, dtype=A.dtype, device=A.device)
    Rinv: torch.Tensor | None = None
    lam_mat: torch.Tensor | None
    if precondition:
        basis, R = torch.linalg.qr(A)
        Rinv = torch.linalg.solve_triangular(R, eye, upper=True)
        # λI in the new basis: Tᵀ(AᵀWA + λI)T = QᵀWQ + λR⁻ᵀR⁻¹
        lam_mat = lam * (Rinv.T @ Rinv) if lam else None
    else:
        basis = A.clone()  # kept for later batches: not the caller's tensor
        lam_mat = lam * eye if lam else None
    # Only the lower triangle of each Gram matrix, packed (one product of 55 rows
    # for coef 10 instead of 100).
    r, c = lower_pairs(coef)
    r, c = r.to(A.device), c.to(A.device)
    raw = torch.linalg.svdvals(A)
    refine_raw = precondition and bool(raw[-1] * REFINE_COND <= raw[0])
    qr_spread = precondition and bool(s[-1] * QR_SPREAD_COND <= s[0])
    pairs = (basis[:, r] * basis[:, c]).T.contiguous()
    setup = _Setup(basis, pairs, Rinv, lam_mat, refine_raw, qr_spread)
    with _SETUPS_LOCK:
        if len(_SETUPS) >= 8:
            _SETUPS.pop(next(iter(_SETUPS)))
        _SETUPS[key] = setup
    return setup


def _primal(
    A: torch.Tensor, B0: torch.Tensor, Wp: torch.Tensor, lam: float, unit: bool, var: bool
) -> tuple[torch.Tensor, torch.Tensor, tuple[PackedFactor, torch.Tensor | None]]:
    """``var``: the variances alone will be asked of the spread (not the covariance)."""
    coef = A.shape[1]
    setup = _primal_setup(A, lam)
    basis, pairs, Rinv, lam_mat = setup.basis, setup.pairs, setup.Rinv, setup.lam_mat
    # contiguous: narrow batches' factorisation too takes the compiled kernel (colmm pads
    # them and returns a view); their solves and moments, on views, take the eager path
    G = colmm(pairs, Wp).contiguous()
    if lam_mat is not None:
        r, c = lower_pairs(coef)
        G += lam_mat[r.to(A.device), c.to(A.device)][:, None]
    # (AᵀWA + λI)⁻¹ = R⁻¹ G⁻¹ R⁻ᵀ: the spread needs R⁻ᵀ (lower triangular)
    T = Rinv.T.contiguous() if Rinv is not None else None
    fused = None
    if var and not lam and coef <= kernel.MAX_ORDER and kernel.usable(G):
        # the variances in the factorisation's pass, while each block's factor is in cache
        # (the masked benchmark: 11 ms a 250,000-pixel solve as a pass of its own)
        fused = (T, torch.empty((coef, G.shape[1]), dtype=G.dtype))
    # unit: Wp is 0/1 and B0 is 0 where Wp is, so W·B0 = B0 (one pass fewer)
    x = colmm(basis.T, B0 if unit else Wp * B0)
    # compiled: solved in the factorisation's pass too (one read of the factors fewer)
    solved = kernel.usable(G, x) and x.shape == (coef, G.shape[1])
    ok = packed_cholesky(G, coef, spread=fused, rhs=x if solved else None)
    L = PackedFactor(G, coef, None if fused is None else fused[1])
    if not solved:
        x = L.solve_(x)
    conv = None
    # The refinement's residuals stay torch's matrix products: a compiled per-pixel
    # loop without fused multiply-adds is compute-bound and no faster than MKL's
    # (measured: 1.2-1.4 ms against 1.1 ms a batch of 16,384 pixels); its step
    # (correction, convergence test) is the kernel's where it can take it.
    for _ in range(REFINE_STEPS):
        # W·b − W·(Qx) = W·(b − Qx): B0 is 0 where W is
        g = colmm(basis.T, colmm_sub(B0, basis, x).mul_(Wp))
        if lam_mat is not None:
            g -= colmm(lam_mat, x)
        conv, (x,) = _step(ok, conv, (x, L.solve_(g)))
        if bool(conv.eq(ok).all()):
            break
    conv = ok if conv is None else conv
    if Rinv is not None:
        x = colmm(Rinv, x)
        if setup.refine_raw and lam_mat is None:
            # the map back by R⁻¹ rounds with the equilibrated condition; one correction
            # on the residual in the user's coordinates (Wampler1: 8.7 → QR's digits)
            g = colmm(basis.T, colmm_sub(B0, A, x).mul_(Wp))
            x = x + colmm(Rinv, L.solve_(g))
    return x, conv, (L, T)


def _dual(
    A: torch.Tensor, B0: torch.Tensor, Wp: torch.Tensor, lam: float
) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor | None]]:
    obs = A.shape[0]
    S = torch.sqrt(Wp)
    K = (A @ A.T)[:, :, None] * S[:, None, :] * S[None, :, :]
    missing = (S == 0).to(A.dtype)
    idx = torch.arange(obs, device=A.device)
    K[idx, idx] += lam * (1 - missing) + missing
    L, ok = batched_cholesky(K)
    z = S * B0
    alpha = cholesky_solve(L, z.clone())
    x = colmm(A.T, S * alpha)
    conv = None
    for _ in range(REFINE_STEPS):
        r = z - S * colmm(A, x) - lam * alpha
        da = cholesky_solve(L, r)
        conv, (x, alpha) = _step(ok, conv, (x, colmm(A.T, S * da)), (alpha, da))
        if bool(conv.eq(ok).all()):
            break
    return x, ok if conv is None else conv, (L, S)


#: The shared dual matrix AAᵀ + λI must be this well conditioned for the gap-wise
#: (Schur complement) dual; worse designs take the per-pixel factorisation.
SCHUR_MAX_COND = 1e8


def gapwise_dual(
    A: torch.Tensor, pol: Policy, spread: bool, zero_one_weights: bool
) -> torch.Tensor | None:
    """``H = (AAᵀ + λI)⁻¹`` where the per-pixel path solves by gaps (:func:`_dual_schur`).

    It does for the dual form (coef > obs, not ``cholesky``) without a spread
    (uncertainty needs the per-pixel factor), with 0/1 weights or no ridge, when
    ``AAᵀ + λI`` is well conditioned (:data:`SCHUR_MAX_COND`); None otherwise.
    """
    obs, coef = A.shape
    lam = pol.ridge if pol.policy == "ridge" else 0.0
    if pol.policy == "cholesky" or coef <= obs or spread or (lam and not zero_one_weights):
        return None
    M = A @ A.T
    M.diagonal().add_(lam)
    ev = torch.linalg.eigvalsh(M)
    if not bool(ev[0] > 0) or float(ev[-1] / ev[0]) > SCHUR_MAX_COND:
        return None
    return torch.cholesky_inverse(torch.linalg.cholesky(M))


def _dual_schur(
    A: torch.Tensor,
    B0: torch.Tensor,
    valid: torch.Tensor,
    lam: float,
    H: torch.Tensor,
    active: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dual solutions ``c = A_vᵀ (A_vA_vᵀ + λI)⁻¹ b_v`` of every pixel, from the shared ``H``.

    ``H = (AAᵀ + λI)⁻¹`` for all rows; a pixel's matrix is the principal submatrix
    ``M_vv`` of ``M = AAᵀ + λI`` on its valid rows v, whose inverse is the Schur
    complement ``H_vv − H_vm H_mm⁻¹ H_mv`` (m: its missing rows). So a pixel needs
    only a k × k factorisation, k = its gap count (the per-pixel dual factors
    obs × obs), and ``α = H b − H E_m H_mm⁻¹ (H b)_m`` vanishes on m by
    construction. Pixels are sorted by k and each k factored as one group (no
    padding); refined (at most :data:`REFINE_STEPS` times) on the coefficients'
    residual as :func:`_dual` is; a pixel that does not converge goes to the SVD
    path. Valid for 0/1 weights, or any weights without ridge (a minimum-norm
    fit of full row rank interpolates, so the weights do not change it); the
    caller checks that. Inactive pixels are not solved (their result is junk).
    """
    ones = torch.ones((1, A.shape[0]), dtype=A.dtype, device=A.device)
    k_of = A.shape[0] - colmm(ones, valid.to(A.dtype))[0].round().to(torch.int64)
    if active is not None:
        k_of = torch.where(active, k_of, 0)
    order = torch.argsort(k_of, stable=True)
    ks, counts = torch.unique_consecutive(k_of[order], return_counts=True)
    # Everything below works on the pixels sorted by k: each group is a slice (a view).
    on = valid[:, order].to(A.dtype)
    if active is not None:
        on[:, k_of[order] == 0] = 1.0  # inactive pixels: solved as if gap-free, dropped later
    # Only valid rows' data: H is applied to all rows (an inf, or data under weight 0,
    # elsewhere would spoil the first iterate).
    B0s = B0[:, order] * on
    # the gap rows of every pixel, pixel after pixel, ascending within a pixel
    gap_rows = torch.nonzero(on.T == 0)[:, 1]
    ok = torch.ones(B0.shape[1], dtype=torch.bool, device=A.device)
    groups: list[tuple[int, int, torch.Tensor, torch.Tensor]] = []
    s0 = r0 = 0
    for k, n in zip(ks.tolist(), counts.tolist(), strict=True):
        if k:
            rows = gap_rows[r0 : r0 + k * n].reshape(n, k).T.contiguous()  # (k, n)
            # square factors: a group has ~1000s of pixels, so a packed one's k²/2
            # operations per factor (instead of k) cost more than they save
            L, good = batched_cholesky(H[rows[:, None, :], rows[None, :, :]])
            ok[s0 : s0 + n] = good
            groups.append((s0, s0 + n, rows, L))
            r0 += k * n
        s0 += n

    compiled = kernel.usable(B0s)  # (H is column-major; only MKL's products read it)

    def apply(r: torch.Tensor) -> torch.Tensor:
        """``M_vv⁻¹ r_v`` per pixel (``r`` zero on missing rows), zero on missing rows."""
        u = colmm(H, r).contiguous()
        Z = torch.zeros_like(u)
        for a, b, rows, L in groups:
            if compiled and L.shape[0] <= kernel.MAX_GAPS and L.is_contiguous():
                # gather, solve and scatter in one pass
                kernel.gap_solve(L, rows, u, Z, a)
                continue
            y = cholesky_solve(L, torch.gather(u[:, a:b], 0, rows))
            Z[:, a:b].scatter_(0, rows, y)
        return colmm_sub(u, H, Z, in_place=True).mul_(on)

    # Refined as _dual is, on c's residual b − Ac − λα (not on b − Mα with M = AAᵀ
    # formed, whose error grows with cond(A)²), and judged on c.
    alpha = apply(B0s)
    x = colmm(A.T, alpha, out=host_empty((A.shape[1], alpha.shape[1]), A.dtype, A.device))
    dx = host_empty(x.shape, x.dtype, x.device)  # one buffer for every step's correction
    conv = None
    for _ in range(REFINE_STEPS):
        r = colmm_sub(B0s, A, x).mul_(on)
        if lam:
            r -= lam * alpha
        da = apply(r)
        conv, (x, alpha) = _step(ok, conv, (x, colmm(A.T, da, out=dx)), (alpha, da))
        if bool(conv.eq(ok).all()):
            break
    conv = ok if conv is None else conv
    # back to the caller's pixel order (torch.gather: index_select along columns costs 5× more)
    back = torch.empty_like(order)
    back[order] = torch.arange(order.numel(), device=order.device)
    return torch.gather(x, 1, back.expand(x.shape[0], -1)), conv[back]


def svd_per_pixel(
    A: torch.Tensor, B0: torch.Tensor, Wp: torch.Tensor, how: str, pol: Policy
) -> torch.Tensor:
    """Minimum-norm or ridge solution of each pixel by a batched SVD of its weighted rows."""
    return _svd_solve(A, B0, Wp, how, pol, None)[0]


def determined_columns(A: torch.Tensor, Wp: torch.Tensor, pol: Policy) -> torch.Tensor:
    """(coef, P): whether each pixel's rows of weight > 0 determine each coefficient.

    Coefficient j is determined when the unit vector e_j lies in the row space of
    the pixel's valid rows (numerical rank at the policy's cutoff, see IDENT_TOL),
    whatever the policy.
    """
    return _svd_solve(A, torch.zeros_like(Wp), (Wp > 0).to(A.dtype), "minnorm", pol, None)[2]


def _svd_solve(
    A: torch.Tensor,
    B0: torch.Tensor,
    Wp: torch.Tensor,
    how: str,
    pol: Policy,
    full: bool | None,
) -> tuple[torch.Tensor, Spread | None, torch.Tensor]:
    """Coefficients (coef, P) by SVD, their :class:`Spread` (unless ``full`` is None).

    And which coefficients the rows determine (coef, P) (:func:`determined_columns`).
    """
    obs, coef = A.shape
    S = torch.sqrt(Wp)  # (obs, P)
    X = S.T[:, :, None] * A[None]  # (P, obs, coef)
    y = (S * B0).T  # (P, obs)
    U, s, Vh = torch.linalg.svd(X, full_matrices=False)
    keep = s > pol.cutoff(obs, coef) * s[:, :1]
    det = (stable_sum(Vh * Vh * keep[:, :, None], dim=1) >= 1.0 - IDENT_TOL).T
    if how == "ridge":
        inv = s / (s * s + pol.ridge)
    else:
        inv = torch.where(keep, 1.0 / torch.where(keep, s, torch.ones_like(s)), torch.zeros_like(s))
    proj = stable_sum(U * y[:, :, None], dim=1)  # Uᵀy per pixel: (P, k)
    coeffs = stable_sum(Vh * (inv * proj)[:, :, None], dim=1)  # (P, coef)
    if full is None:
        return coeffs.T, None, det
    Wv = inv[:, :, None] * Vh  # (P, k, coef): P_w = Wvᵀ Uᵀ, so P_w P_wᵀ = Wvᵀ Wv
    var = stable_sum(Wv * Wv, dim=1).T
    cov = torch.bmm(Wv.transpose(1, 2), Wv).permute(1, 2, 0) if full else None
    if how != "ridge":
        var = var.masked_fill(~det, torch.nan)
        if cov is not None:
            cov = cov.masked_fill(~det[:, None, :] | ~det[None, :, :], torch.nan)
    ones = stable_sum(U * S.T[:, :, None], dim=1) * keep  # U_rᵀ S1 per pixel
    spans = stable_sum(ones * ones, dim=1) >= (1.0 - CONST_TOL) * stable_sum(Wp)
    return coeffs.T, Spread(var, stable_sum(s * inv, dim=1), cov, spans), det


def solve_per_pixel(
    A: torch.Tensor,
    B0: torch.Tensor,
    Wp: torch.Tensor,
    pol: Policy,
    svd_chunk: int = 4096,
    active: torch.Tensor | None = None,
    unit: bool = False,
    n_valid: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Coefficients (coef, P) and status (P,) of pixels with their own weights ``Wp`` (obs, P).

    ``B0`` holds zeros where ``Wp`` is zero. Every ``active`` pixel (default:
    all) has enough valid observations; the others are computed but never sent
    to the SVD path, and the caller drops them. ``unit``: the caller knows that
    ``Wp`` holds only 0 and 1 (it saves a pass over the data). ``n_valid``: each
    pixel's count of rows with ``Wp`` > 0, when the caller has it (else counted).
    """
    x, status, _ = _solve_per_pixel(A, B0, Wp, pol, svd_chunk, active, None, False, unit, n_valid)
    return x, status


def solve_per_pixel_spread(
    A: torch.Tensor,
    B0: torch.Tensor,
    Wp: torch.Tensor,
    pol: Policy,
    full: bool = False,
    spans_known: bool = False,
    svd_chunk: int = 4096,
    active: torch.Tensor | None = None,
    unit: bool = False,
    n_valid: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, Spread]:
    """:func:`solve_per_pixel`, and the solutions' :class:`Spread` from the same factorisations.

    ``full`` asks for the covariance too. ``spans_known``: the design spans the
    constant on all its rows, hence on every pixel's valid rows.
    """
    x, status, spread = _solve_per_pixel(
        A, B0, Wp, pol, svd_chunk, active, full, spans_known, unit, n_valid
    )
    assert spread is not None
    return x, status, spread


@dataclass
class Spread:
    """Unscaled second moments of per-pixel solutions (pixels last), before the residual scale."""

    var: torch.Tensor  # (coef, P) diagonal of P_w P_wᵀ; NaN: not identifiable
    edf: torch.Tensor  # (P,) effective number of parameters tr(X P_w)
    cov: torch.Tensor | None  # (coef, coef, P) P_w P_wᵀ, when asked
    spans: torch.Tensor  # (P,) bool: the constant lies in the column space of the valid rows
    #: (P,) Σw·r² from compensated residuals (NaN: not computed, the plain residuals
    #: give it); see :func:`_qr_spread`. None: none computed.
    rss: torch.Tensor | None = None

    def put(self, sel: torch.Tensor, other: Spread) -> None:
        """Overwrite pixels ``sel`` with ``other``'s."""
        self.var[:, sel], self.edf[sel], self.spans[sel] = other.var, other.edf, other.spans
        if self.cov is not None and other.cov is not None:
            self.cov[:, :, sel] = other.cov
        if self.rss is not None:
            self.rss[sel] = torch.nan if other.rss is None else other.rss


def _pixels_first(L: torch.Tensor) -> torch.Tensor:
    """(n, n, P) → (P, n, n), contiguous: batched LAPACK works on one pixel's matrix at a time."""
    return L.permute(2, 0, 1).contiguous()


def _to_pixels_last(X: torch.Tensor) -> torch.Tensor:
    return X.permute(1, 2, 0)


def spread_bytes(
    coef: int, obs: int, full: bool, ridge: bool, dual: bool, device: torch.device
) -> int:
    """Bytes per pixel that the spread of a per-pixel batch adds (and its moments' columns)."""
    if dual or full or ridge or device.type != "cpu" or not kernel.usable():
        # _dual_spread's per-pixel (obs × coef) products, or the primal's Z = L⁻¹T and ZᵀZ
        return 8 * (4 * coef * coef + 2 * obs * coef + 4 * obs)
    # the compiled primal spread keeps diag(ZᵀZ) only
    return 8 * (2 * coef + 4 * obs)


def _primal_spread(L: PackedFactor, T: torch.Tensor | None, lam: float, full: bool) -> Spread:
    """The spread ``Z = L⁻¹T``, ``T`` lower triangular (None: the identity)."""
    coef, p = L.n, L.cols.shape[1]
    dev = L.cols.device
    if L.var is not None and not (lam or full):
        return _spread_of(L.var, None, lam, full, coef, p, dev)
    if L.compiled:
        var, Zk = kernel.spread(L.cols, coef, T, bool(lam) or full)
        return _spread_of(var, Zk, lam, full, coef, p, dev)
    rhs = torch.eye(coef, dtype=L.cols.dtype, device=dev) if T is None else T
    # Z = L⁻¹T per pixel, so that ZᵀZ = (XᵀX + λI)⁻¹: forward substitution on the
    # pixels-last factor, elementwise per pixel (each pixel's result is independent of
    # the batch), without a pixels-first copy of L or a batched LAPACK call per pixel.
    # L and T lower triangular: so is Z, and row i needs only its first i+1 columns.
    Z = rhs[:, :, None].expand(coef, coef, p).clone()
    var = torch.zeros((coef, p), dtype=L.cols.dtype, device=dev)
    for i in range(coef):
        col = L.column(i)  # L[i:, i]
        zi = Z[i, : i + 1]
        zi /= col[0]
        if i + 1 < coef:
            Z[i + 1 :, : i + 1].addcmul_(col[1:, None, :], zi[None], value=-1)
        var[: i + 1].addcmul_(zi, zi)  # diag(ZᵀZ), row by row while Z[i] is final (and in cache)
    return _spread_of(var, Z, lam, full, coef, p, dev)


def _spread_of(
    var: torch.Tensor,
    Z: torch.Tensor | None,
    lam: float,
    full: bool,
    coef: int,
    p: int,
    dev: torch.device,
) -> Spread:
    """The primal :class:`Spread` from ``diag(ZᵀZ)`` and ``Z`` (needed for ridge or ``full``)."""
    if lam:
        assert Z is not None
        # the ridge sandwich M⁻¹XᵀXM⁻¹ = M⁻¹ − λM⁻², M = XᵀX + λI; tr(H) = coef − λ tr(M⁻¹)
        Minv = _gram(Z)
        cov = Minv - lam * _matmul_pixels_last(Minv, Minv)
        # A column the pixel's rows say nothing about has variance ≈ 0, which the
        # subtraction can round below 0 (a NaN stderr); clamp the diagonal at 0.
        diag = torch.diagonal(cov, dim1=0, dim2=1)  # a view of cov: (P, coef)
        diag.clamp_(min=0.0)
        var = diag.T.contiguous()
        edf = coef - lam * torch.diagonal(Minv, dim1=0, dim2=1).T.sum(0)
        return Spread(var, edf, cov if full else None, _true(p, dev))
    edf = torch.full((p,), float(coef), dtype=var.dtype, device=dev)
    if full:
        assert Z is not None
        return Spread(var, edf, _gram(Z), _true(p, dev))
    return Spread(var, edf, None, _true(p, dev))


def _gram(Z: torch.Tensor) -> torch.Tensor:
    """``ZᵀZ`` per pixel of a pixels-last ``Z`` (n, m, P): (m, m, P), summed in row order."""
    out = Z[0][:, None, :] * Z[0][None, :, :]
    for a in range(1, Z.shape[0]):
        out.addcmul_(Z[a][:, None, :], Z[a][None, :, :])
    return out


def _matmul_pixels_last(X: torch.Tensor, Y: torch.Tensor) -> torch.Tensor:
    """``X @ Y`` per pixel of pixels-last (n, k, P) and (k, m, P): (n, m, P)."""
    out = X[:, 0][:, None, :] * Y[0][None, :, :]
    for k in range(1, X.shape[1]):
        out.addcmul_(X[:, k][:, None, :], Y[k][None, :, :])
    return out


def _true(p: int, device: torch.device) -> torch.Tensor:
    return torch.ones(p, dtype=torch.bool, device=device)


def _dual_spread(
    A: torch.Tensor, L: torch.Tensor, S: torch.Tensor, lam: float, full: bool
) -> Spread:
    # X = S A; P_w = Xᵀ K⁻¹ with K = XXᵀ + λI: P_w X = ZᵀZ and P_w P_wᵀ = YᵀY,
    # Z = L⁻¹X, Y = L⁻ᵀZ = K⁻¹X.
    Lb = _pixels_first(L)
    X = S.T[:, :, None] * A[None]  # (P, obs, coef)
    Z = torch.linalg.solve_triangular(Lb, X, upper=False)
    d = (Z * Z).sum(1)  # (P, coef): diagonal of P_w X
    edf = d.sum(1)
    Y = torch.linalg.solve_triangular(Lb.transpose(1, 2), Z, upper=True)
    var = (Y * Y).sum(1)
    cov = torch.bmm(Y.transpose(1, 2), Y) if full else None
    if not lam:
        ident = (d - 1.0).abs() <= IDENT_TOL
        var = var.masked_fill(~ident, torch.nan)
        if cov is not None:
            cov = cov.masked_fill(~ident[:, :, None] | ~ident[:, None, :], torch.nan)
    return Spread(
        var.T.contiguous(),
        edf,
        None if cov is None else _to_pixels_last(cov),
        _true(L.shape[2], L.device),
    )


#: Elements (pixels × obs × coef) of one batch of :func:`_qr_spread`'s weighted rows.
QR_SPREAD_ELEMENTS = 1 << 22
#: Veltkamp's splitting constant for float64 (2²⁷ + 1): a = hi + lo, each half 26 bits.
_SPLIT = 134217729.0


def _two_sum(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``a + b`` and its rounding error, exactly (Knuth's TwoSum)."""
    s = a + b
    z = s - a
    return s, (a - (s - z)) + (b - z)


def _two_product(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``a·b`` and its rounding error, exactly (Dekker's TwoProduct, no FMA needed)."""
    p = a * b
    ca, cb = _SPLIT * a, _SPLIT * b
    ah, bh = ca - (ca - a), cb - (cb - b)
    al, bl = a - ah, b - bh
    return p, al * bl - (((p - ah * bh) - al * bh) - ah * bl)


def compensated_residuals(A: torch.Tensor, B0: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``B0 − A·x`` (obs, P) as if computed in twice float64's precision (Ogita-Rump-Oishi Dot2).

    For designs at float64's limit (see :data:`QR_SPREAD_COND`): plain
    float64 residuals lose the digits the cancellation takes (Filip: the residual
    variance to 7 digits; this way to 11, as 80-bit arithmetic gives).
    """
    s = B0.to(torch.float64).clone()
    err = torch.zeros_like(s)
    for j in range(A.shape[1]):
        p, e1 = _two_product(-A[:, j : j + 1].to(torch.float64), x[j : j + 1].to(torch.float64))
        s, e2 = _two_sum(s, p)
        err += e1 + e2
    return s + err


def _qr_spread(
    A: torch.Tensor,
    columns: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
    sel: torch.Tensor,
    x: torch.Tensor,
    spread: Spread,
) -> None:
    """Overwrite the variances (and covariance) of pixels ``sel`` by a QR of their own rows.

    For a design whose equilibrated condition number is at least :data:`QR_SPREAD_COND`: its
    spread from the normal equations, ``R⁻¹G⁻¹R⁻ᵀ``, loses what ``G = QᵀWQ``'s own
    condition adds, and its residuals ``b − Ac`` what the columns' cancellation
    takes (Filip's per-pixel standard errors: 7.2–7.4 digits where QR gets 7.9–8.5,
    by CPU). A Householder QR of each pixel's ``√w``-weighted rows (numpy's LAPACK,
    as a numpy or statsmodels user computes it) gives ``(XᵀX)⁻¹ = R⁻¹R⁻ᵀ``;
    compensated residuals give ``Σw·r²`` (:attr:`Spread.rss`). At Filip's
    conditioning (1.8e15) that is float64's limit: QR's own standard errors range
    over 7.1–8.5 digits when the same rows are scaled by a weight (measured). Only
    for full-rank, unridged fits (their spread is ``(XᵀX)⁻¹``). ``columns(sel)``:
    ``B0`` and ``Wp`` of the pixels ``sel``; ``x`` every pixel's coefficients. On
    the CPU (a GPU's pixels are copied): the designs that take it are rare.
    """
    obs, coef = A.shape
    An = A.detach().to("cpu", torch.float64).numpy()
    if spread.rss is None:
        spread.rss = torch.full_like(spread.edf, torch.nan)
    chunk = max(1, QR_SPREAD_ELEMENTS // (obs * coef))
    for start in range(0, sel.numel(), chunk):
        part = sel[start : start + chunk]
        B0c, Wc = columns(part)
        Wc = Wc.to(torch.float64)
        r = compensated_residuals(A, B0c, x[:, part])
        spread.rss[part] = (Wc * r * r).sum(0).to(spread.rss.dtype)
        # numpy's LAPACK (what numpy and statsmodels users compare with), per pixel
        X = np.sqrt(Wc.cpu().numpy()).T[:, :, None] * An[None]  # (P, obs, coef)
        R = cast(np.ndarray, np.linalg.qr(X, mode="r"))  # mode "r": R alone
        try:
            Ri = np.linalg.inv(R)  # (XᵀX)⁻¹ = Ri Riᵀ
            keep = np.ones(part.numel(), dtype=bool)
        except np.linalg.LinAlgError:  # an exactly singular R: that pixel keeps the normal
            Ri, keep = _inverses(R)  # equations' spread, the others take QR's
        on = part[torch.from_numpy(keep)]
        var = torch.from_numpy((Ri[keep] * Ri[keep]).sum(-1).T.copy())
        spread.var[:, on] = var.to(spread.var.device, spread.var.dtype)
        if spread.cov is not None:
            cov = torch.from_numpy(Ri[keep] @ Ri[keep].transpose(0, 2, 1))
            spread.cov[:, :, on] = _to_pixels_last(cov).to(spread.cov.device, spread.cov.dtype)


def _inverses(R: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each of a stack's matrices inverted alone; and which were invertible."""
    out = np.zeros_like(R)
    keep = np.zeros(R.shape[0], dtype=bool)
    for i in range(R.shape[0]):
        try:
            out[i] = np.linalg.inv(R[i])
            keep[i] = True
        except np.linalg.LinAlgError:
            pass
    return out, keep


def _svd_spans(A: torch.Tensor, Wp: torch.Tensor, pol: Policy) -> torch.Tensor:
    """Per pixel, whether the constant lies in the column space of its weighted rows."""
    spread = _svd_solve(A, torch.zeros_like(Wp), Wp, "minnorm", pol, False)[1]
    assert spread is not None
    return spread.spans


def _solve_per_pixel(
    A: torch.Tensor,
    B0: torch.Tensor,
    Wp: torch.Tensor,
    pol: Policy,
    svd_chunk: int,
    active: torch.Tensor | None,
    full: bool | None,
    spans_known: bool,
    unit: bool,
    n_valid: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, Spread | None]:
    obs, coef = A.shape
    if pol.policy == "minnorm" and pol.rcond is not None:
        return _svd_every_pixel(A, B0, Wp, pol, svd_chunk, active, full)
    lam = pol.ridge if pol.policy == "ridge" else 0.0
    use_dual = pol.policy != "cholesky" and coef > obs
    # only ridge's dual needs 0/1 weights to solve by gaps; unit: the caller knows they are
    zero_one = unit or not (lam and use_dual) or bool(((Wp == 0) | (Wp == 1)).all())
    H = gapwise_dual(A, pol, full is not None, zero_one)
    Ld = S = T = None
    Lp: PackedFactor | None = None
    if H is not None:
        x, good = _dual_schur(A, B0, Wp > 0, lam, H, active)
    elif use_dual:
        x, good, (Ld, S) = _dual(A, B0, Wp, lam)
    else:
        x, good, (Lp, T) = _primal(A, B0, Wp, lam, unit, full is False)
        if not lam:
            # Fewer valid rows than coefficients: singular normal equations, whatever the
            # pivots say (rounding can leave a last pivot of zero just above the relative
            # test when an earlier one was small); the SVD path gives the minimum-norm fit.
            nv = (Wp > 0).sum(0) if n_valid is None else n_valid
            good = good & (nv >= coef)
    spread = None
    if full is not None:
        if use_dual:
            assert Ld is not None and S is not None
            spread = _dual_spread(A, Ld, S, lam, full)
        else:
            assert Lp is not None
            spread = _primal_spread(Lp, T, lam, full)
        if spans_known:
            spread.spans[:] = True
        else:
            # the dual minimum-norm fit of a pixel that factored is exact on its rows
            check = good if active is None else good & active
            if use_dual and not lam:
                check = torch.zeros_like(good)
            todo = torch.nonzero(check).flatten()
            for start in range(0, todo.numel(), svd_chunk):
                sel = todo[start : start + svd_chunk]
                spread.spans[sel] = _svd_spans(A, Wp[:, sel], pol)
    status = _settle(
        A, pol, svd_chunk, active, good, x, spread, full, lambda c: (B0[:, c], Wp[:, c])
    )
    if spread is not None and H is None and not use_dual and not lam:
        _refine_spread(A, good, active, x, spread, lambda c: (B0[:, c], Wp[:, c]))
    return x, status, spread


def _refine_spread(
    A: torch.Tensor,
    good: torch.Tensor,
    active: torch.Tensor | None,
    x: torch.Tensor,
    spread: Spread,
    columns: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
) -> None:
    """:func:`_qr_spread` of the pixels the normal equations solved (Filip-class designs only).

    It costs about 16 times the per-pixel solve (measured on an AMD EPYC: Filip's
    design, 50,000 pixels with 5 % gaps, 1.34 s against 0.08 s), so only designs
    whose equilibrated condition number is ≥ :data:`QR_SPREAD_COND` take it.
    """
    if not _primal_setup(A, 0.0).qr_spread:
        return
    sel = torch.nonzero(good if active is None else good & active).flatten()
    if sel.numel():
        _qr_spread(A, columns, sel, x, spread)


def _svd_every_pixel(
    A: torch.Tensor,
    B0: torch.Tensor,
    Wp: torch.Tensor,
    pol: Policy,
    svd_chunk: int,
    active: torch.Tensor | None,
    full: bool | None,
) -> tuple[torch.Tensor, torch.Tensor, Spread | None]:
    """:func:`_solve_per_pixel` by the SVD of every pixel's rows (an explicit ``rcond``).

    The cutoff is on each pixel's own singular values, which the normal equations
    never see: without this, a pixel with gaps got the untruncated fit where lstsq
    truncates (and a pixel of the shared path did not).
    """
    coef, p = A.shape[1], B0.shape[1]
    x = torch.zeros((coef, p), dtype=B0.dtype, device=B0.device)
    spread = None
    if full is not None:
        nan = torch.full((coef, p), torch.nan, dtype=B0.dtype, device=B0.device)
        cov = nan[:, None, :].repeat(1, coef, 1) if full else None
        spread = Spread(nan, nan[0].clone(), cov, _true(p, B0.device))
    none = torch.zeros(p, dtype=torch.bool, device=B0.device)
    status = _settle(
        A, pol, svd_chunk, active, none, x, spread, full, lambda c: (B0[:, c], Wp[:, c])
    )
    return x, status, spread


def _settle(
    A: torch.Tensor,
    pol: Policy,
    svd_chunk: int,
    active: torch.Tensor | None,
    good: torch.Tensor,
    x: torch.Tensor,
    spread: Spread | None,
    full: bool | None,
    columns: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
) -> torch.Tensor:
    """Every pixel's status, the ``active`` ones that did not factor well re-solved.

    Those (not ``good``) are solved again by the policy's fallback, into ``x`` and
    ``spread``. ``columns(sel)``: ``B0`` and ``Wp`` of the pixels ``sel`` (only those are read).
    """
    status = torch.full((x.shape[1],), OK, dtype=torch.int8, device=A.device)
    bad = torch.nonzero(~good if active is None else active & ~good).flatten()
    if bad.numel() == 0:
        return status
    how = pol.policy
    if how == "cholesky":
        if pol.fallback == "none":
            x[:, bad] = torch.nan
            status[bad] = SINGULAR
            if spread is not None:
                spread.var[:, bad] = torch.nan
                spread.edf[bad] = torch.nan
                if spread.cov is not None:
                    spread.cov[:, :, bad] = torch.nan
            return status
        how = pol.fallback
        status[bad] = FELL_BACK_RIDGE if how == "ridge" else FELL_BACK_MINNORM
    for start in range(0, bad.numel(), svd_chunk):
        sel = bad[start : start + svd_chunk]
        x[:, sel], part, det = _svd_solve(A, *columns(sel), how, pol, full)
        if spread is not None and part is not None:
            spread.put(sel, part)
        # truly rank-deficient rows: underdetermined, whatever the fallback
        short = sel[~det.all(dim=0)]
        status[short] = UNDERDETERMINED
    return status


def fit_unit(
    A: torch.Tensor,
    src: np.ndarray,
    pol: Policy,
    n_valid: torch.Tensor,
    active: torch.Tensor | None,
    spread: bool,
    svd_chunk: int = 4096,
) -> tuple[torch.Tensor, torch.Tensor, Spread | None, torch.Tensor, torch.Tensor | None] | None:
    """:func:`solve_per_pixel` of unit-weight columns, and their RMS; None where it cannot run.

    The columns of ``src`` (obs, P) take their 0/1 masks as weights (NaN and ±inf:
    invalid). The compiled kernel does each pixel's normal equations, factorisation, solve,
    refinement, residual sums (and with ``spread``, the variances and the data's sum
    of squares about its mean) in one read of its data, for the primal form without
    ridge (the per-pixel path's usual case). With ``spread`` the valid rows of every
    pixel are taken to span the constant (the caller knows the design does). Returns
    the coefficients, status, the :class:`Spread` (with ``spread``), the residual
    RMS and (with ``spread``) the RMS about the mean, over each pixel's
    ``n_valid`` rows. The pixels that fall back read their data again.
    """
    obs, coef = A.shape
    A = A.contiguous()
    if src.ndim == 2 and not kernel.rows_contiguous(src):
        # a gathered batch (numpy's fancy indexing lays its columns out one by one)
        src = np.ascontiguousarray(src)
    if (
        pol.policy == "ridge"
        or (pol.policy == "minnorm" and pol.rcond is not None)  # every pixel by SVD
        or (pol.policy != "cholesky" and coef > obs)
        or not 1 <= coef <= kernel.MAX_ORDER
        or src.dtype not in (np.float32, np.float64)
        or src.ndim != 2
        or src.shape[1] == 0
        or src.strides[0] % src.itemsize
        or src.strides[0] < 0
        or not kernel.usable(A, n_valid)
    ):
        return None
    setup = _primal_setup(A, 0.0)
    Rinv = None if setup.Rinv is None else setup.Rinv.contiguous()
    basis = setup.basis.contiguous()
    x, good, ss, var, tss = kernel.fit(
        src, basis, setup.pairs, A, Rinv, PIVOT_TOL, REFINE_TOL, REFINE_STEPS, spread
    )
    # as _solve_per_pixel: too few rows for the coefficients go to the SVD path
    good &= n_valid >= coef
    sp = None
    if spread:
        assert var is not None
        sp = _spread_of(var, None, 0.0, False, coef, x.shape[1], x.device)

    @functools.cache
    def loaded(key: bytes) -> tuple[torch.Tensor, torch.Tensor]:
        cols = np.frombuffer(key, dtype=np.int64)
        got = kernel.load(np.ascontiguousarray(src[:, cols]), True)
        assert got is not None and got[1] is not None
        return got[0], got[1]

    def columns(sel: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return loaded(sel.numpy().astype(np.int64).tobytes())

    status = _settle(A, pol, svd_chunk, active, good, x, sp, False if spread else None, columns)
    if sp is not None:
        _refine_spread(A, good, active, x, sp, columns)
    # the sums as residual_moments takes them; its redo (and the fallen-back pixels,
    # whose coefficients changed) from the columns read again
    fi = torch.finfo(ss.dtype)
    small = 4 * obs * fi.tiny / fi.eps
    sums = [ss] if tss is None else [ss, tss]
    again = ~good
    for t in sums:
        again |= ~((t >= small) & (t <= fi.max))
    if active is not None:  # the others are dropped
        again &= active
    # numpy's: torch's sqrt wakes its thread pool, which then spins on the cores the
    # kernel's next batch runs on (the masked benchmark: 40 → 60 ms a solve); quiet
    # about pixels without valid rows (0 / 0: inactive, dropped), as torch is
    with np.errstate(divide="ignore", invalid="ignore"):
        for t in sums:
            np.sqrt(np.divide(t.numpy(), n_valid.numpy(), out=t.numpy()), out=t.numpy())
    redo = torch.nonzero(again).flatten()
    if redo.numel():
        B0c, Wc = columns(redo)
        # a fallen-back pixel's rows may miss the constant by the SVD's test: uncentred
        spans = None if sp is None else sp.spans[redo]
        centred = spans is None or bool(spans.all())
        fixed = residual_moments(
            A, B0c, Wc, x[:, redo].contiguous(), n_valid[redo], spread, centred
        )
        assert fixed is not None
        ss[redo] = fixed[0]
        if tss is not None and spans is not None:
            tss[redo] = torch.where(spans, fixed[2], fixed[3])
    return x, status, sp, ss, tss
