"""Batched least-squares numerics, pixel-last (pixels are the last axis everywhere).

Two families:

* :func:`~gridsolve.stages.solve.shared_operator.svd_operator` — one design (or one
  gap pattern) shared by many pixels: a float64 SVD gives the solution operator ``P``
  (coef × obs) for the chosen policy, then ``C = P @ B`` is one matrix product over
  the pixels (``shared_operator.py``).
* :func:`solve_per_pixel` (this module) — every pixel with its own weights ``W_p``
  (its own gaps): per-pixel normal equations in float64, factored by a vectorised
  Cholesky (a loop over the matrix order, vectorised over pixels; far faster
  than a batched LAPACK call for small matrices on CPU) and refined twice
  (corrected semi-normal equations), so the error does not grow with the
  square of the condition number (``primal.py``, ``cholesky.py``). Pixels whose
  factorisation fails, or whose refinement does not converge, are solved by a
  batched SVD of their own weighted rows: the same answer ``numpy.linalg.lstsq`` gives.

When ``coef`` exceeds ``obs``, the minimum-norm and ridge solutions use the
dual form ``c = AᵀS (SAAᵀS + λI)⁻¹ S b`` (S = W_p^½), whose matrix is
obs × obs instead of coef × coef (``dual.py``).

Uncertainty (:class:`~gridsolve.stages.solve.spread.Spread`, ``spread.py``) comes
from the same factorisations: every
solution is ``c = P_w S b`` for an operator ``P_w`` of the weighted rows
``X = S A``, so under the WLS model (Cov(S b) = σ²I) the coefficients'
unscaled covariance is ``P_w P_wᵀ``: ``(XᵀX)⁻¹`` for a full-rank fit, the
pseudo-inverse's ``V Σ⁻² Vᵀ`` for minimum norm, and for ridge the sandwich
``(XᵀX+λI)⁻¹ XᵀX (XᵀX+λI)⁻¹``. The effective number of parameters is
``tr(X P_w)``: the rank, or ``Σ s²/(s²+λ)`` under ridge. Statuses, tolerances and
the :class:`~gridsolve.stages.solve.policy.Policy` are in ``policy.py``; pixel-last
column operations (products, sums, RMS) in ``columns.py``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import numpy as np
import torch

from gridsolve.stages.solve import kernel
from gridsolve.stages.solve.cholesky import PackedFactor
from gridsolve.stages.solve.columns import residual_moments, stable_sum
from gridsolve.stages.solve.dual import _dual, _dual_schur, gapwise_dual
from gridsolve.stages.solve.policy import (
    CONST_TOL,
    FELL_BACK_MINNORM,
    FELL_BACK_RIDGE,
    IDENT_TOL,
    OK,
    PIVOT_TOL,
    REFINE_STEPS,
    REFINE_TOL,
    SINGULAR,
    UNDERDETERMINED,
    Policy,
)
from gridsolve.stages.solve.primal import _primal, _primal_setup
from gridsolve.stages.solve.spread import (
    Spread,
    _dual_spread,
    _primal_spread,
    _qr_spread,
    _spread_of,
    _true,
)


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
    coef = A.shape[1]
    A = A.contiguous()
    if src.ndim == 2 and not kernel.rows_contiguous(src):
        # a gathered batch (numpy's fancy indexing lays its columns out one by one)
        src = np.ascontiguousarray(src)
    if not _fit_unit_runs(A, src, pol, n_valid):
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
    _unit_moments(A, good, active, n_valid, x, sp, ss, tss, spread, columns)
    return x, status, sp, ss, tss


def _fit_unit_runs(A: torch.Tensor, src: np.ndarray, pol: Policy, n_valid: torch.Tensor) -> bool:
    """Whether :func:`fit_unit`'s compiled kernel can take this design, policy and data."""
    obs, coef = A.shape
    return not (
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
    )


def _unit_moments(
    A: torch.Tensor,
    good: torch.Tensor,
    active: torch.Tensor | None,
    n_valid: torch.Tensor,
    x: torch.Tensor,
    sp: Spread | None,
    ss: torch.Tensor,
    tss: torch.Tensor | None,
    spread: bool,
    columns: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
) -> None:
    """:func:`fit_unit`'s residual sums ``ss`` (and ``tss``) turned into RMS, in place.

    Pixels whose sums overflowed or may have lost squares, and those that fell back
    (their coefficients changed), are redone from their columns read again.
    """
    obs = A.shape[0]
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
