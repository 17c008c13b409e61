"""The per-pixel state of the batched Levenberg–Marquardt loop and its two moves.

Each pixel runs MINPACK's ``lmder`` state machine (``scipy/optimize/src/minpack.c``):
an outer iteration computes the Jacobian at an accepted point, an inner one tries
steps from it until one is accepted. Batched, every loop pass

1. :func:`refresh_jacobian`: the pixels whose last step was accepted (or that just
   started) get their Jacobian, its QR, the scaling ``D`` and the gradient test;
2. :func:`trial_step`: every pixel still running tries one step from ``lmpar``,
   evaluates the model there, accepts or rejects it by the gain ratio ρ, updates
   its trust radius Δ and λ, and runs the convergence and termination tests.

Only the running pixels are computed (index sets), so a stopped pixel costs
nothing and never changes. MINPACK's own variable names are kept where they help
compare with its source (``fnorm``, ``xnorm``, ``delta``, ``par``, ``actred``,
``prered``, ``ratio``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields

import torch

from gridsolve.stages.solve.levmar_linalg import lmpar, qr_of_jacobian
from gridsolve.stages.solve.levmar_problem import Problem


@dataclass
class State:
    """Every pixel's iterate and MINPACK's bookkeeping for it (first dim: pixel)."""

    u: torch.Tensor  # (P, n) internal parameters
    e: torch.Tensor  # (P, m) weighted residuals √w (f − b) at u, 0 where not valid
    fnorm: torch.Tensor  # (P,) ‖e‖
    diag: torch.Tensor  # (P, n) scaling D
    delta: torch.Tensor  # (P,) trust radius Δ
    par: torch.Tensor  # (P,) λ
    xnorm: torch.Tensor  # (P,) ‖D u‖
    R: torch.Tensor  # (P, n, n) R of the Jacobian at u
    qtf: torch.Tensor  # (P, n) Qᵀe
    gnorm: torch.Tensor  # (P,) max cosine between e and a Jacobian column
    first: torch.Tensor  # (P,) bool: no step accepted yet (MINPACK's iter == 1)
    need_jac: torch.Tensor  # (P,) bool: u changed since the last Jacobian
    active: torch.Tensor  # (P,) bool: still iterating
    n_iter: torch.Tensor  # (P,) int32 trial steps
    reason: torch.Tensor  # (P,) int8 MINPACK info, 0 while running
    not_finite: torch.Tensor  # (P,) bool: model or Jacobian not finite where evaluated
    not_finite_at_start: torch.Tensor  # (P,) bool: already at the start

    def take(self, rows: torch.Tensor) -> State:
        """The state of pixels ``rows`` (an index tensor) alone, in that order."""
        return State(**{f.name: getattr(self, f.name)[rows] for f in fields(self)})

    @staticmethod
    def join(parts: Sequence[State]) -> State:
        """One state of the pixels of ``parts``, in order."""
        return State(
            **{f.name: torch.cat([getattr(x, f.name) for x in parts]) for f in fields(State)}
        )


def start(prob: Problem, u0: torch.Tensor) -> State:
    """The state at the start: residuals at ``u0``; pixels with too few observations never run."""
    n_pix, n = u0.shape
    like = prob.b
    e = torch.zeros_like(like)
    can = prob.n_valid >= n
    idx = torch.nonzero(can).flatten()
    if idx.numel():
        e[idx] = prob.residuals(u0[idx], idx)
    bad = can & ~torch.isfinite(e).all(dim=-1)
    e = torch.where(bad[:, None], torch.zeros_like(e), e)

    def zeros(*shape: int) -> torch.Tensor:
        return torch.zeros((n_pix, *shape), dtype=like.dtype, device=like.device)

    return State(
        u=u0.clone(),
        e=e,
        fnorm=torch.linalg.vector_norm(e, dim=-1),
        diag=zeros(n),
        delta=zeros(),
        par=zeros(),
        xnorm=zeros(),
        R=zeros(n, n),
        qtf=zeros(n),
        gnorm=zeros(),
        first=can.clone(),
        need_jac=can.clone(),
        active=can & ~bad,
        n_iter=torch.zeros(n_pix, dtype=torch.int32, device=like.device),
        reason=torch.zeros(n_pix, dtype=torch.int8, device=like.device),
        not_finite=bad.clone(),
        not_finite_at_start=bad,
    )


def refresh_jacobian(prob: Problem, st: State, factor: float, gtol: float) -> None:
    """The outer iteration of ``lmder`` for pixels at a new point: Jacobian, QR, D, gtol test."""
    idx = torch.nonzero(st.active & st.need_jac).flatten()
    if idx.numel() == 0:
        return
    u = st.u[idx]
    # [J e] in one buffer: the Jacobian is written where the QR reads it, beside the residuals
    k, n = u.shape
    # column-major, as LAPACK's QR reads it
    Je = torch.empty((k, n + 1, st.e.shape[-1]), dtype=u.dtype, device=u.device).mT
    J = prob.weighted_jacobian(u, idx, out=Je[..., :n])
    Je[..., n] = st.e[idx]
    acnorm = torch.linalg.vector_norm(J, dim=-2)
    # a finite column norm has finite entries: the full test only where a norm is not finite
    finite = torch.isfinite(acnorm).all(dim=-1)
    if not bool(finite.all()):
        finite = torch.isfinite(J).all(dim=-1).all(dim=-1)
        J.masked_fill_(~finite[:, None, None], 0.0)
        acnorm = torch.linalg.vector_norm(J, dim=-2)
    R, qtf = qr_of_jacobian(Je)
    first = st.first[idx]
    # scale by the column norms of the first Jacobian (MINPACK's mode 1), then never shrink
    diag = torch.where(first[:, None], torch.where(acnorm == 0, 1.0, acnorm), st.diag[idx])
    xnorm = torch.where(first, torch.linalg.vector_norm(diag * u, dim=-1), st.xnorm[idx])
    delta = torch.where(first, factor * xnorm, st.delta[idx])
    delta = torch.where(first & (delta == 0), factor, delta)
    fnorm = st.fnorm[idx]
    grad = (R.mT @ qtf[..., None])[..., 0] / fnorm[:, None]
    cosine = torch.where(acnorm != 0, grad.abs() / torch.where(acnorm != 0, acnorm, 1.0), 0.0)
    gnorm = torch.where(fnorm != 0, cosine.amax(dim=-1), 0.0)
    st.R[idx], st.qtf[idx], st.gnorm[idx] = R, qtf, gnorm
    st.diag[idx] = torch.maximum(diag, acnorm)
    st.xnorm[idx], st.delta[idx] = xnorm, delta
    st.need_jac[idx] = False
    converged = finite & (gnorm <= gtol)
    st.reason[idx] = torch.where(converged, 4, st.reason[idx]).to(torch.int8)
    st.not_finite[idx] |= ~finite
    st.active[idx] = ~converged & finite


def trial_step(prob: Problem, st: State, tols: tuple[float, float], limit: int) -> None:
    """One inner iteration of ``lmder`` at every running pixel: a step, accepted or not, tests."""
    idx = torch.nonzero(st.active).flatten()
    if idx.numel() == 0:
        return
    R, diag, delta, fnorm = st.R[idx], st.diag[idx], st.delta[idx], st.fnorm[idx]
    x, par = lmpar(R, diag, st.qtf[idx], delta, st.par[idx])
    step = -x
    u_new = st.u[idx] + step
    pnorm = torch.linalg.vector_norm(diag * step, dim=-1)
    first = st.first[idx]
    delta = torch.where(first, torch.minimum(delta, pnorm), delta)
    e_new = prob.residuals(u_new, idx)
    # a step to where the model is not finite is a failed step (infinite cost)
    # ‖e‖ is finite exactly where every entry is and the sum does not overflow (inf then too)
    fnorm1 = torch.linalg.vector_norm(e_new, dim=-1)
    fnorm1 = torch.where(torch.isfinite(fnorm1), fnorm1, torch.inf)
    actred = torch.where(0.1 * fnorm1 < fnorm, 1 - (fnorm1 / fnorm) ** 2, -1.0)
    temp1 = torch.linalg.vector_norm((R @ step[..., None])[..., 0], dim=-1) / fnorm
    temp2 = torch.sqrt(par) * pnorm / fnorm
    prered = temp1**2 + temp2**2 / 0.5
    dirder = -(temp1**2 + temp2**2)
    ratio = torch.where(prered != 0, actred / prered, 0.0)
    delta, par = _update_bound(delta, par, pnorm, ratio, actred, dirder, 0.1 * fnorm1 >= fnorm)
    ok = ratio >= 1e-4
    took = idx[ok]  # only the accepted steps move their pixels' point and residuals
    st.u[took], st.e[took] = u_new[ok], e_new[ok]
    xnorm = torch.where(ok, torch.linalg.vector_norm(diag * u_new, dim=-1), st.xnorm[idx])
    st.fnorm[idx] = torch.where(ok, fnorm1, fnorm)
    st.first[idx] = first & ~ok
    st.need_jac[idx] = ok
    st.xnorm[idx], st.delta[idx], st.par[idx] = xnorm, delta, par
    st.n_iter[idx] += 1
    info = _tests(actred, prered, ratio, delta, xnorm, st.gnorm[idx], st.n_iter[idx], tols, limit)
    st.reason[idx] = info
    st.active[idx] = info == 0


def _update_bound(
    delta: torch.Tensor,
    par: torch.Tensor,
    pnorm: torch.Tensor,
    ratio: torch.Tensor,
    actred: torch.Tensor,
    dirder: torch.Tensor,
    much_worse: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The trust radius Δ and λ after a step with gain ratio ``ratio`` (MINPACK's rule)."""
    temp = torch.where(actred < 0, 0.5 * dirder / (dirder + 0.5 * actred), 0.5)
    temp = torch.where(much_worse | (temp < 0.1), 0.1, temp)
    shrink = ratio <= 0.25
    grow = ~shrink & ((par == 0) | (ratio >= 0.75))
    delta = torch.where(shrink, temp * torch.minimum(delta, pnorm / 0.1), delta)
    delta = torch.where(grow, pnorm / 0.5, delta)
    par = torch.where(shrink, par / temp, torch.where(grow, 0.5 * par, par))
    return delta, par


def _tests(
    actred: torch.Tensor,
    prered: torch.Tensor,
    ratio: torch.Tensor,
    delta: torch.Tensor,
    xnorm: torch.Tensor,
    gnorm: torch.Tensor,
    n_iter: torch.Tensor,
    tols: tuple[float, float],
    limit: int,
) -> torch.Tensor:
    """MINPACK's ``info`` after a step (int8): 1–3 converged, 5–8 stopped short, 0 running."""
    ftol, xtol = tols
    eps = torch.finfo(delta.dtype).eps
    f_ok = (actred.abs() <= ftol) & (prered <= ftol) & (0.5 * ratio <= 1)
    x_ok = delta <= xtol * xnorm
    zero = torch.zeros_like(n_iter, dtype=torch.int8)
    info = torch.where(f_ok, 1, zero)
    info = torch.where(x_ok, 2, info)
    info = torch.where(f_ok & x_ok, 3, info)
    # tested only when none of the above holds; the last that holds wins, as in MINPACK
    short = torch.where(n_iter >= limit, 5, zero)
    short = torch.where((actred.abs() <= eps) & (prered <= eps) & (0.5 * ratio <= 1), 6, short)
    short = torch.where(delta <= eps * xnorm, 7, short)
    short = torch.where(gnorm <= eps, 8, short)
    return torch.where(info == 0, short, info).to(torch.int8)
