"""The dual per-pixel solve (coef > obs): ``c = AᵀS (SAAᵀS + λI)⁻¹ S b``, an obs × obs system.

Per pixel (:func:`_dual`), or by gaps from one shared inverse (:func:`_dual_schur`).
"""

from __future__ import annotations

import torch

from gridsolve.stages.solve import kernel
from gridsolve.stages.solve.cholesky import _step, batched_cholesky, cholesky_solve
from gridsolve.stages.solve.columns import colmm, colmm_sub, host_empty
from gridsolve.stages.solve.policy import PIVOT_TOL, REFINE_STEPS, Policy


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


#: A group of :func:`_dual_schur`'s pixels with the same gap count k: the slice
#: ``[a, b)`` of the sorted pixels, their gap rows (k, n) and the factors of ``H``'s
#: submatrices on them (k, k, n).
_Group = tuple[int, int, torch.Tensor, torch.Tensor]


def _gap_groups(
    A: torch.Tensor,
    B0: torch.Tensor,
    valid: torch.Tensor,
    H: torch.Tensor,
    active: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, list[_Group]]:
    """:func:`_dual_schur`'s pixels sorted by gap count, and each count's factored group.

    Returns the sort order, the valid rows (0/1) and data of the sorted pixels,
    which pixels factored well, and the groups.
    """
    ones = torch.ones((1, A.shape[0]), dtype=A.dtype, device=A.device)
    k_of = A.shape[0] - colmm(ones, valid.to(A.dtype))[0].round().to(torch.int64)
    if active is not None:
        k_of = torch.where(active, k_of, 0)
    order = torch.argsort(k_of, stable=True)
    ks, counts = torch.unique_consecutive(k_of[order], return_counts=True)
    # Everything below works on the pixels sorted by k: each group is a slice (a view).
    # (torch.gather: indexing the columns, valid[:, order], costs 7× more)
    by_k = order.expand(valid.shape[0], -1)
    on = torch.gather(valid, 1, by_k).to(A.dtype)
    if active is not None:
        on[:, k_of[order] == 0] = 1.0  # inactive pixels: solved as if gap-free, dropped later
    # Only valid rows' data: H is applied to all rows (an inf, or data under weight 0,
    # elsewhere would spoil the first iterate).
    B0s = torch.gather(B0, 1, by_k) * on
    # the gap rows of every pixel, pixel after pixel, ascending within a pixel
    gap_rows = torch.nonzero(on.T == 0)[:, 1]
    ok = torch.ones(B0.shape[1], dtype=torch.bool, device=A.device)
    groups: list[_Group] = []
    # gathered and factored in one pass: torch's gather of the submatrices alone cost
    # 119 ms of the masked coef 100 > obs 50 case's 1 s (25 M entries at 20 % gaps)
    Hc = H.contiguous()
    fused = kernel.usable(Hc)
    s0 = r0 = 0
    for k, n in zip(ks.tolist(), counts.tolist(), strict=True):
        if k:
            rows = gap_rows[r0 : r0 + k * n].reshape(n, k).T.contiguous()  # (k, n)
            # square factors: a group has ~1000s of pixels, so a packed one's k²/2
            # operations per factor (instead of k) cost more than they save
            if fused:
                L, good = kernel.gap_factor(Hc, rows, PIVOT_TOL)
            else:
                L, good = batched_cholesky(H[rows[:, None, :], rows[None, :, :]])
            ok[s0 : s0 + n] = good
            groups.append((s0, s0 + n, rows, L))
            r0 += k * n
        s0 += n
    return order, on, B0s, ok, groups


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
    order, on, B0s, ok, groups = _gap_groups(A, B0, valid, H, active)
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
