"""Fitting columns that share one operator: the shared design's, or a gap pattern's.

Coefficients ``P @ B`` and residual RMS (with uncertainty, the weighted moments)
in the stored dtype, with float32's coarse or too-wide columns redone in float64.
"""

from __future__ import annotations

import numpy as np
import torch

from gridsolve.stages.solve.columns import colmm, column_rms, host_empty, stable_sum
from gridsolve.stages.solve.prepared import FLOAT32_PRODUCT_TOL, FLOAT32_SAFE_MAX


def _fit_columns(
    B: np.ndarray,
    P: np.ndarray,
    A: np.ndarray,
    Q: np.ndarray | None,
    dtype: np.dtype,
    device: torch.device,
    store: np.dtype | None = None,
    data_max: float | None = None,
    sw: np.ndarray | None = None,
    centred: bool = True,
    refine: bool = False,
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray | None]:
    """Coefficients ``P @ B`` and residual RMS of finite columns sharing one operator.

    ``refine``: one step of refinement against the data, ``C += P (B − A C)``, and the
    residual of the refined coefficients (for an ill-conditioned design, see
    :data:`REFINE_COND`).

    With the rows' square-root weights ``sw``, also the root means of the
    weighted squared residuals and of the weighted squares of ``B`` about its
    weighted mean (``centred``) or about zero (see :func:`_fit`); else None.

    Computed in ``dtype``, except that under float32 a column with a value
    beyond :data:`FLOAT32_SAFE_MAX`, or whose float32 products cannot resolve its
    residual (:data:`FLOAT32_PRODUCT_TOL`), is computed in float64. A column whose
    coefficients do not fit ``store`` (default ``dtype``), the dtype they are
    stored in, gets an infinite residual RMS: solve_block refuses it.
    ``data_max`` bounds |B| when known (else B is scanned).
    """
    top = data_max
    if top is None:
        top = float(max(B.max(), -B.min())) if B.size else 0.0
    n_px = B.shape[1]
    wide = np.zeros(n_px, dtype=bool)
    if dtype == np.float32 and top > FLOAT32_SAFE_MAX:
        wide = np.maximum(B.max(axis=0), -B.min(axis=0)) > FLOAT32_SAFE_MAX
    if not wide.any():
        C, rms, wrms, trms = _fit(B, P, A, Q, dtype, device, sw, centred, refine)
    else:
        C = np.empty((P.shape[0], n_px), dtype=dtype)
        rms = np.full(n_px, np.nan, dtype=dtype)  # the wide columns' are found below
        wrms = None if sw is None else np.empty(n_px)
        trms = None if sw is None else np.empty(n_px)

    def fit_in(cols: np.ndarray, cdtype: np.dtype) -> None:
        if cols.any():
            C[:, cols], rms[cols], w_, t_ = _fit(
                B[:, cols], P, A, Q, cdtype, device, sw, centred, refine
            )
            if wrms is not None and trms is not None and w_ is not None and t_ is not None:
                wrms[cols], trms[cols] = w_, t_

    if wide.any():
        fit_in(~wide, dtype)
    if dtype == np.float32:
        # the wide columns' NaN RMS never reads as coarse: each is fitted once, below
        fit_in(wide | _coarse_in_float32(B, P, rms, top), np.dtype(np.float64))
    limit = float(np.finfo(store or dtype).max)
    # |c| ≤ ‖P‖∞ · max |b|: only near the limit is the (full) pass over C needed.
    if P.size and top * float(np.abs(P).sum(axis=1).max()) >= 0.5 * limit:
        with np.errstate(invalid="ignore"):
            rms[~(np.abs(C) <= limit).all(axis=0)] = np.inf
    return C, rms, wrms, trms


def _coarse_in_float32(B: np.ndarray, P: np.ndarray, rms: np.ndarray, top: float) -> np.ndarray:
    """Which columns of ``B`` float32 products cannot fit to :data:`FLOAT32_PRODUCT_TOL`.

    Those whose largest |value| is too far above their residual RMS ``rms`` (found
    in float32). A column with no residual degrees of freedom (no more rows than
    coefficients) has no noise to swamp and keeps float32. ``top`` bounds |B|: the
    columns are scanned only when it does not clear every one of them.
    """
    n = B.shape[0]
    none = np.zeros(B.shape[1], dtype=bool)
    if n <= P.shape[0] or not B.size:
        return none
    scale = float(np.finfo(np.float32).eps) * np.sqrt(n) / FLOAT32_PRODUCT_TOL
    rms64 = rms.astype(np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        if not (top * scale > rms64).any():
            return none
        coarse: np.ndarray = np.abs(B).max(axis=0).astype(np.float64) * scale > rms64
    return coarse


def _fit(
    B: np.ndarray,
    P: np.ndarray,
    A: np.ndarray,
    Q: np.ndarray | None,
    dtype: np.dtype,
    device: torch.device,
    sw: np.ndarray | None = None,
    centred: bool = True,
    refine: bool = False,
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray | None]:
    Bt = torch.from_numpy(np.ascontiguousarray(B, dtype=dtype)).to(device)
    Pt = torch.from_numpy(np.ascontiguousarray(P, dtype=dtype)).to(device)
    Ct = colmm(Pt, Bt, out=host_empty((P.shape[0], B.shape[1]), Pt.dtype, device))
    if refine:
        # one correction against the data: P's rounding grows with the design's
        # condition, the residual's does not (Wampler1: residual 1e-7 → 2e-10, QR's 7e-10)
        At = torch.from_numpy(np.ascontiguousarray(A, dtype=dtype)).to(device)
        Ct += colmm(Pt, Bt - colmm(At, Ct))
        Q = None  # the residual of the refined coefficients, below
    if Q is not None:
        R = colmm(torch.from_numpy(np.ascontiguousarray(Q, dtype=dtype)).to(device), Bt)
    else:
        At = torch.from_numpy(np.ascontiguousarray(A, dtype=dtype)).to(device)
        R = Bt - colmm(At, Ct)
    n = B.shape[0]
    rms = column_rms(R, n)
    if sw is None:
        return Ct.cpu().numpy(), rms.cpu().numpy(), None, None
    # Q is only used unweighted: then the weighted residual RMS is the RMS itself.
    unit = bool((sw == 1).all())
    swt = torch.from_numpy(np.ascontiguousarray(sw[:, None], dtype=dtype)).to(device)
    wrms = rms if unit else column_rms(R * swt, n)
    if centred:
        w = swt * swt
        mean = stable_sum(Bt * w) / w.sum()
        D = Bt - mean[None, :] if unit else (Bt - mean[None, :]) * swt
    else:
        D = Bt if unit else Bt * swt
    trms = column_rms(D, n)
    return (
        Ct.cpu().numpy(),
        rms.cpu().numpy(),
        wrms.cpu().numpy().astype(np.float64),
        trms.cpu().numpy().astype(np.float64),
    )
