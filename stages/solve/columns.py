"""Pixel-last column operations: padded products, batch-independent sums, overflow-free RMS.

And each pixel's residual and data moments (:func:`residual_moments`).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from gridsolve.stages.solve import kernel

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


def _pow2_exponent(X: torch.Tensor) -> torch.Tensor:
    """Per column, ``e`` with 2^(e-1) ≤ max |x| < 2^e (0 for a zero column), 2^-e finite."""
    _, e = torch.frexp(_max_abs(X))
    return e.clamp_min(math.frexp(torch.finfo(X.dtype).tiny)[1])


def _max_abs(X: torch.Tensor) -> torch.Tensor:
    """Per column, the largest magnitude (NaN where a column has one)."""
    # max and −min: no |X| array (half the time of X.abs().amax at coef 100)
    return torch.maximum(X.amax(dim=0), -X.amin(dim=0))
