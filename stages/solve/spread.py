"""The uncertainty statistics of per-pixel solutions (:class:`Spread`), from their factorisations.

Every solution is ``c = P_w S b`` for an operator ``P_w`` of the weighted rows
``X = S A``, so the coefficients' unscaled covariance is ``P_w P_wᵀ``; for designs at
float64's limit, a QR of each pixel's rows and compensated residuals (:func:`_qr_spread`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import numpy as np
import torch

from gridsolve.stages.solve import kernel
from gridsolve.stages.solve.cholesky import PackedFactor
from gridsolve.stages.solve.policy import IDENT_TOL


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
