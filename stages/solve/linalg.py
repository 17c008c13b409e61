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
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import scipy.linalg
import torch

from gridsolve.schemas.contracts import STATUS_CODES

EPS64 = float(np.finfo(np.float64).eps)
OK = STATUS_CODES["ok"]
ALL_MISSING = STATUS_CODES["all_missing"]
TOO_FEW = STATUS_CODES["too_few_observations"]
FELL_BACK_RIDGE = STATUS_CODES["fell_back_to_ridge"]
FELL_BACK_MINNORM = STATUS_CODES["fell_back_to_minimum_norm"]
SINGULAR = STATUS_CODES["singular"]

#: Refinement steps of the per-pixel normal equations, and the relative size
#: of the last correction above which a pixel goes to the SVD path instead.
REFINE_STEPS = 2
REFINE_TOL = 1e-11
#: A Cholesky pivot below this fraction of its diagonal entry means the
#: pixel's design is (nearly) rank-deficient, κ(A) ≳ 1e5: solve it by SVD.
PIVOT_TOL = 1e-10


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
    rank = int((s > cut * (s[0] if s.size else 0.0)).sum()) if s.size else 0
    how, status = pol.policy, OK
    if how == "cholesky":
        if rank == coef:
            try:
                factor = scipy.linalg.cho_factor(Aw.T @ Aw, lower=True, check_finite=False)
                P = scipy.linalg.cho_solve(factor, Aw.T, check_finite=False)
                inv = 1.0 / s
                return Operator(P, OK, rank, float(s[0] * inv.max()), "cholesky")
            except np.linalg.LinAlgError:
                pass
        if pol.fallback == "none":
            return Operator(np.full((coef, rows), np.nan), SINGULAR, rank, float("inf"), "singular")
        how = pol.fallback
        status = FELL_BACK_RIDGE if how == "ridge" else FELL_BACK_MINNORM
    inv = _filter(s, how, pol.ridge, cut)
    P = (Vt.T * inv) @ U.T
    cond = float(s[0] * inv.max()) if s.size and inv.max() > 0 else float("inf")
    return Operator(P, status, rank, cond, "svd-" + how)


# ---------------------------------------------------------------- per pixel
# Every operation along the pixel axis is elementwise, a matrix product, or a
# sum over a small axis in index order, so a pixel's result does not depend on
# which other pixels share its tile or chunk beyond the rounding of the matrix
# products: MKL picks kernels by the product's width and the CPU's
# instructions (on its AVX2 path the last bits change with the width). That is
# the agreement bound of stages/engine/agreement.py, not equal bits; see
# tests/stages/test_linalg.py and test_determinism.py. Very narrow products (a
# single column takes a matrix-vector path that rounds differently again) are
# padded to MIN_WIDTH so that small tiles stay close to large ones.
MIN_WIDTH = 64


def colmm(M: torch.Tensor, X: torch.Tensor) -> torch.Tensor:
    """``M @ X``, with narrow X padded on CPU so that it takes the matrix-matrix kernels."""
    n = X.shape[1]
    if X.device.type != "cpu" or n >= MIN_WIDTH:
        return M @ X
    padded = X.new_zeros((X.shape[0], MIN_WIDTH))
    padded[:, :n] = X
    return (M @ padded)[:, :n]


def stable_sum(x: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """Sum over ``dim`` in index order (batch-independent on CPU)."""
    if x.device.type != "cpu" or x.shape[dim] == 0:
        return x.sum(dim)
    acc = x.select(dim, 0).clone()
    for i in range(1, x.shape[dim]):
        acc += x.select(dim, i)
    return acc


def column_rms(R: torch.Tensor, n: torch.Tensor | float) -> torch.Tensor:
    """``√(Σ r² / n)`` of every column of ``R``, free of overflow and underflow in the squares.

    NaN or inf in a column gives NaN or inf for it, as the plain formula does.
    """
    if R.shape[0] == 0:
        return torch.zeros(R.shape[1], dtype=R.dtype, device=R.device)
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


def batched_cholesky(G: torch.Tensor, tol: float = PIVOT_TOL) -> tuple[torch.Tensor, torch.Tensor]:
    """Lower Cholesky factors of ``G`` (n, n, P), in place, and which pixels factored well.

    ``G``'s lower triangle is overwritten with the factor (its upper triangle
    is left as scratch). A pixel fails when a pivot falls below ``tol`` times
    its own diagonal entry: that column is (nearly) a combination of the
    earlier ones, so the normal equations cannot be trusted and the pixel
    goes to the SVD path.
    """
    n, _, p = G.shape
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
    for i in range(n):
        h[i] /= L[i, i]
        if i + 1 < n:
            h[i + 1 :].addcmul_(L[i + 1 :, i], h[i], value=-1)
    for i in range(n - 1, -1, -1):
        h[i] /= L[i, i]
        if i:
            h[:i].addcmul_(L[i, :i], h[i], value=-1)
    return h


def _pow2_exponent(X: torch.Tensor) -> torch.Tensor:
    """Per column, ``e`` with 2^(e-1) ≤ max |x| < 2^e (0 for a zero column), 2^-e finite."""
    _, e = torch.frexp(torch.maximum(X.amax(dim=0), -X.amin(dim=0)))
    return e.clamp_min(math.frexp(torch.finfo(X.dtype).tiny)[1])


def _converged(dx: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    # Squared norms: vector_norm along dim 0 is several times slower here. Both
    # scaled by x's power of two (exact), so that data near 1e±160 in float64
    # neither overflow nor underflow the squares.
    e = -_pow2_exponent(x)
    xs, dxs = torch.ldexp(x, e), torch.ldexp(dx, e)
    num = stable_sum(dxs * dxs)
    den = stable_sum(xs * xs)
    return torch.isfinite(den) & (num <= REFINE_TOL**2 * den + torch.finfo(x.dtype).tiny)


def _primal(
    A: torch.Tensor, B0: torch.Tensor, Wp: torch.Tensor, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    obs, coef = A.shape
    # Work in the orthonormal basis U of the design (A = U·diag(s)·Vᵀ): each
    # pixel's Gram matrix UᵀW_pU is then near the identity unless its gaps are
    # severe, however badly the user's columns are scaled; c = V·diag(1/s)·c'.
    U, s, Vh = torch.linalg.svd(A, full_matrices=False)
    precondition = bool(s[-1] > s[0] * EPS64 * max(obs, coef) * 1e3)
    if precondition:
        basis = U
        lam_vec = lam / (s * s) if lam else None
    else:
        basis = A
        lam_vec = torch.full((coef,), lam, dtype=A.dtype, device=A.device) if lam else None
    BB = (basis[:, :, None] * basis[:, None, :]).reshape(obs, coef * coef)
    G = colmm(BB.T, Wp).reshape(coef, coef, -1)
    if lam_vec is not None:
        idx = torch.arange(coef, device=A.device)
        G[idx, idx] += lam_vec[:, None]
    L, ok = batched_cholesky(G)
    WB = Wp * B0
    x = cholesky_solve(L, colmm(basis.T, WB))
    conv = ok
    for _ in range(REFINE_STEPS):
        g = colmm(basis.T, WB - Wp * colmm(basis, x))
        if lam_vec is not None:
            g = g - lam_vec[:, None] * x
        dx = cholesky_solve(L, g)
        x = x + dx
        conv = ok & _converged(dx, x)
        if bool(conv.eq(ok).all()):
            break
    if precondition:
        x = colmm(Vh.T / s[None, :], x)
    return x, conv


def _dual(
    A: torch.Tensor, B0: torch.Tensor, Wp: torch.Tensor, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
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
    conv = ok
    for _ in range(REFINE_STEPS):
        r = z - S * colmm(A, x) - lam * alpha
        da = cholesky_solve(L, r)
        alpha = alpha + da
        dx = colmm(A.T, S * da)
        x = x + dx
        conv = ok & _converged(dx, x)
        if bool(conv.eq(ok).all()):
            break
    return x, conv


def svd_per_pixel(
    A: torch.Tensor, B0: torch.Tensor, Wp: torch.Tensor, how: str, pol: Policy
) -> torch.Tensor:
    """Minimum-norm or ridge solution of each pixel by a batched SVD of its weighted rows."""
    obs, coef = A.shape
    S = torch.sqrt(Wp)  # (obs, P)
    X = S.T[:, :, None] * A[None]  # (P, obs, coef)
    y = (S * B0).T  # (P, obs)
    U, s, Vh = torch.linalg.svd(X, full_matrices=False)
    if how == "ridge":
        inv = s / (s * s + pol.ridge)
    else:
        cut = pol.cutoff(obs, coef) * s[:, :1]
        keep = s > cut
        inv = torch.where(keep, 1.0 / torch.where(keep, s, torch.ones_like(s)), torch.zeros_like(s))
    proj = stable_sum(U * y[:, :, None], dim=1)  # Uᵀy per pixel: (P, k)
    coeffs = stable_sum(Vh * (inv * proj)[:, :, None], dim=1)  # (P, coef)
    return coeffs.T


def solve_per_pixel(
    A: torch.Tensor,
    B0: torch.Tensor,
    Wp: torch.Tensor,
    pol: Policy,
    svd_chunk: int = 4096,
    active: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Coefficients (coef, P) and status (P,) of pixels with their own weights ``Wp`` (obs, P).

    ``B0`` holds zeros where ``Wp`` is zero. Every ``active`` pixel (default:
    all) has enough valid observations; the others are computed but never sent
    to the SVD path, and the caller drops them.
    """
    obs, coef = A.shape
    lam = pol.ridge if pol.policy == "ridge" else 0.0
    use_dual = pol.policy != "cholesky" and coef > obs
    x, good = (_dual if use_dual else _primal)(A, B0, Wp, lam)
    status = torch.full((B0.shape[1],), OK, dtype=torch.int8, device=A.device)
    bad = torch.nonzero(~good if active is None else active & ~good).flatten()
    if bad.numel() == 0:
        return x, status
    how = pol.policy
    if how == "cholesky":
        if pol.fallback == "none":
            x[:, bad] = torch.nan
            status[bad] = SINGULAR
            return x, status
        how = pol.fallback
        status[bad] = FELL_BACK_RIDGE if how == "ridge" else FELL_BACK_MINNORM
    for start in range(0, bad.numel(), svd_chunk):
        sel = bad[start : start + svd_chunk]
        x[:, sel] = svd_per_pixel(A, B0[:, sel], Wp[:, sel], how, pol)
    return x, status
