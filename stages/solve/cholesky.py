"""Batched Cholesky factorisations over pixels (square and packed) and their solves.

And the refinement step (:func:`_step`) the primal and dual solves share.
"""

from __future__ import annotations

import functools

import torch

from gridsolve.stages.solve import kernel
from gridsolve.stages.solve.columns import _max_abs
from gridsolve.stages.solve.policy import PIVOT_TOL, REFINE_TOL


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
    if ok.device.type == "cpu" and all(kernel.usable(*pair) for pair in pairs):
        # one pass over each pair instead of a dozen reductions and full-size selects
        okc = ok.contiguous()
        flags = kernel.step(*pairs[0], okc, conv, REFINE_TOL)
        for v, d in pairs[1:]:  # the same pixels corrected (the flags depend on ok, conv)
            kernel.step(v, d, okc, conv, REFINE_TOL)
        return flags, [v for v, _ in pairs]
    if conv is None:
        out = [v.add_(d) for v, d in pairs]
        return ok & _converged(pairs[0][1], out[0]), out
    more = ok & ~conv
    out = [torch.where(more, v + d, v) for v, d in pairs]
    return conv | (more & _converged(pairs[0][1], out[0])), out
