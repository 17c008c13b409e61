"""The small dense algebra of the batched Levenberg–Marquardt fit, one system per pixel.

Everything follows MINPACK (Moré 1978; ``lmder``, ``lmpar``, ``qrsolv`` as scipy
ships them in ``scipy/optimize/src/minpack.c``) with one difference: the QR
factorisations are unpivoted (torch's batched ``geqrf``; no batched pivoted QR
exists). Pivoting only changes the Gauss–Newton step of a Jacobian with an exactly
zero ``R`` diagonal (MINPACK keeps the leading nonsingular block, so the solution
depends on the column order); every damped step and every full-rank result is the
same. The damped least-squares problem ``[R; √λ·D] x ≈ [Qᵀr; 0]`` is solved by a
second QR of the stacked (2n × n) matrix, as MINPACK's ``qrsolv`` does with
Givens rotations; the normal equations ``JᵀJ`` are never formed.
"""

from __future__ import annotations

import torch


def r_factor(A: torch.Tensor) -> torch.Tensor:
    """``R`` (k, min(m, n), n) of ``A = QR`` (k, m, n): ``torch.linalg.qr(A, mode="r").R``.

    Taken from LAPACK's ``geqrf`` directly: the same R, bit for bit, without the
    copies ``linalg.qr`` adds around it (about a third of its time on 50 × 5
    matrices). ``A`` in column-major layout (a ``.mT`` view) spares ``geqrf`` a
    transposing copy.
    """
    a, _ = torch.geqrf(A)
    return a[..., : min(A.shape[-2:]), :].triu()


def qr_of_jacobian(Je: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``R`` (k, n, n) of ``J = QR`` and the first n entries of ``Qᵀe`` (k, n), from ``[J e]``.

    ``Je`` (k, m, n + 1): the Jacobian with the residuals as its last column.
    """
    n = Je.shape[-1] - 1
    raug = r_factor(Je)
    return raug[..., :n, :n], raug[..., :n, n]


def _solve_upper(R: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    x: torch.Tensor = torch.linalg.solve_triangular(R, v[..., None], upper=True)[..., 0]
    return x


def _solve_upper_t(R: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``w`` with ``Rᵀ w = v`` (R upper triangular)."""
    w: torch.Tensor = torch.linalg.solve_triangular(R.mT, v[..., None], upper=False)[..., 0]
    return w


def _gauss_newton(
    R: torch.Tensor, qtb: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The Gauss–Newton step ``R⁻¹Qᵀr`` (MINPACK's least-squares solution where R is singular).

    Returns (x, Rm, full): ``Rm`` is R with the columns from the first zero diagonal
    on replaced by unit vectors (so it can be solved with), ``full`` whether R has
    no zero diagonal.
    """
    n = R.shape[-1]
    zero = R.diagonal(dim1=-2, dim2=-1) == 0
    from_first_zero = torch.cumsum(zero.to(torch.int32), dim=-1) > 0
    eye = torch.eye(n, dtype=R.dtype, device=R.device)
    Rm = torch.where(from_first_zero[..., None, :], eye, R)
    rhs = torch.where(from_first_zero, torch.zeros_like(qtb), qtb)
    return _solve_upper(Rm, rhs), Rm, ~from_first_zero.any(dim=-1)


def _damped(
    R: torch.Tensor, qtb: torch.Tensor, diag: torch.Tensor, par: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, S): the least-squares solution of ``[R; √par·D] x ≈ [Qᵀr; 0]`` and its R factor."""
    n = R.shape[-1]
    top = torch.cat([R, qtb[..., None]], dim=-1)
    bottom = torch.cat(
        [torch.diag_embed(torch.sqrt(par)[..., None] * diag), torch.zeros_like(qtb[..., None])],
        dim=-1,
    )
    raug = r_factor(torch.cat([top, bottom], dim=-2))
    S = raug[..., :n, :n]
    return _solve_upper(S, raug[..., :n, n]), S


def _norm(v: torch.Tensor) -> torch.Tensor:
    n: torch.Tensor = torch.linalg.vector_norm(v, dim=-1)
    return n


def lmpar(
    R: torch.Tensor,
    diag: torch.Tensor,
    qtb: torch.Tensor,
    delta: torch.Tensor,
    par: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """MINPACK's ``lmpar`` for every pixel: (x, λ) with ``‖D x‖`` within 10 % of ``delta``.

    ``x`` minimises ``‖R x − Qᵀr‖² + λ‖D x‖²`` (the step is ``−x``); λ = 0 when the
    Gauss–Newton step already lies inside the trust region. At most 10 Newton
    iterations on λ per pixel, as in MINPACK.
    """
    tiny = torch.finfo(R.dtype).tiny
    x, Rm, full = _gauss_newton(R, qtb)
    dxnorm = _norm(diag * x)
    fp = dxnorm - delta
    done = fp <= 0.1 * delta
    # Newton's step gives a lower bound parl for λ (zero where R is singular)
    w = _solve_upper_t(Rm, diag * (diag * x) / dxnorm[..., None])
    parl = torch.where(full & ~done, fp / delta / _norm(w) ** 2, torch.zeros_like(fp))
    gnorm = _norm((R.mT @ qtb[..., None])[..., 0] / diag)
    paru = gnorm / delta
    paru = torch.where(paru == 0, tiny / torch.clamp(delta, max=0.1), paru)
    par = torch.minimum(torch.maximum(par, parl), paru)
    par = torch.where(par == 0, gnorm / dxnorm, par)
    par = torch.where(done, torch.zeros_like(par), par)
    for it in range(1, 11):
        idx = torch.nonzero(~done).flatten()
        if idx.numel() == 0:
            break
        x_i, par_i, stop, parl_i, paru_i, fp_i = _lmpar_iteration(
            R[idx],
            diag[idx],
            qtb[idx],
            delta[idx],
            par[idx],
            parl[idx],
            paru[idx],
            fp[idx],
            last=it == 10,
        )
        x[idx], fp[idx], parl[idx], paru[idx] = x_i, fp_i, parl_i, paru_i
        par[idx] = par_i
        done[idx] = stop | (it == 10)
    return x, par


def _lmpar_iteration(
    R: torch.Tensor,
    diag: torch.Tensor,
    qtb: torch.Tensor,
    delta: torch.Tensor,
    par: torch.Tensor,
    parl: torch.Tensor,
    paru: torch.Tensor,
    fp_old: torch.Tensor,
    last: bool = False,
) -> tuple[torch.Tensor, ...]:
    """One Newton iteration of ``lmpar`` on λ: (x, λ, stop, parl, paru, fp).

    Where ``stop``, and everywhere on the ``last`` iteration (MINPACK's tenth,
    after which it returns), the returned λ is the one ``x`` was solved with;
    elsewhere it is the next λ to try.
    """
    tiny = torch.finfo(R.dtype).tiny
    par = torch.where(par == 0, torch.clamp(0.001 * paru, min=tiny), par)
    x, S = _damped(R, qtb, diag, par)
    dx = diag * x
    dxnorm = _norm(dx)
    fp = dxnorm - delta
    stop = (fp.abs() <= 0.1 * delta) | ((parl == 0) & (fp <= fp_old) & (fp_old < 0))
    w = _solve_upper_t(S, diag * dx / dxnorm[..., None])
    parc = fp / delta / _norm(w) ** 2
    parl_new = torch.where(fp > 0, torch.maximum(parl, par), parl)
    paru_new = torch.where(fp < 0, torch.minimum(paru, par), paru)
    par_new = torch.maximum(parl_new, par + parc)
    return (
        x,
        par if last else torch.where(stop, par, par_new),
        stop,
        torch.where(stop, parl, parl_new),
        torch.where(stop, paru, paru_new),
        fp,
    )


def covariance(J: torch.Tensor, p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(``(JᵀJ)⁻¹`` (k, n, n), singular (k,)) of weighted Jacobians (k, m, n) at ``p`` (k, n).

    ``J`` is singular where, in relative parameter changes (columns times ``|p_j|``,
    or 1 where ``p_j = 0``), a column lies within ``max(m, n)·eps`` of the span of the
    columns before it, relative to the largest column: a parameter without effect
    (a zero column, or a rate so large that its exponential underflows), or a
    combination of others. Its covariance is NaN.
    """
    m, n = J.shape[-2:]
    R = r_factor(J)[..., :n, :n]
    scale = torch.where(p != 0, p.abs(), 1.0)
    effect = R.diagonal(dim1=-2, dim2=-1).abs() * scale
    largest = (torch.linalg.vector_norm(J, dim=-2) * scale).amax(dim=-1, keepdim=True)
    tol = max(m, n) * torch.finfo(J.dtype).eps
    singular = (effect <= tol * largest).any(dim=-1)
    singular |= ~torch.isfinite(R).all(dim=-1).all(dim=-1)
    eye = torch.eye(n, dtype=J.dtype, device=J.device)
    Rs = torch.where(singular[..., None, None], eye, R)
    Rinv = torch.linalg.solve_triangular(Rs, eye.expand_as(Rs), upper=True)
    cov = Rinv @ Rinv.mT
    return torch.where(singular[..., None, None], torch.nan, cov), singular
