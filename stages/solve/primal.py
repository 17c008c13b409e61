"""The primal per-pixel solve (coef ≤ obs): normal equations in an orthonormal basis of the design.

Factored by the packed Cholesky and refined (corrected semi-normal equations); the
basis and its small factorisations are kept per design (:func:`_primal_setup`).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from gridsolve.stages.solve import kernel
from gridsolve.stages.solve.cholesky import PackedFactor, _step, lower_pairs, packed_cholesky
from gridsolve.stages.solve.columns import colmm, colmm_sub
from gridsolve.stages.solve.policy import EPS64, QR_SPREAD_COND, REFINE_COND, REFINE_STEPS


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
