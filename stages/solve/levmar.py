"""Per-pixel nonlinear least squares of a single-sample model: batched Levenberg–Marquardt.

Design requirements (issue 31, DESIGN.md §13):

* The user writes ``f(t, p)`` for ONE sample: ``t`` the observation coordinates
  (n_obs, …), ``p`` the parameter vector (n_param,), returning (n_obs,). It is
  batched unchanged with ``torch.func.vmap`` over pixels; per-pixel Jacobians come
  from ``vmap(jacfwd(f, argnums=1))`` (``jacrev`` when there are more parameters
  than observations).
* Every pixel minimises ``Σ_i w_i (b_i − f(t_i; p))²`` over its valid observations
  (mask True, b finite, weight > 0) on its own: own damping λ, own trust region,
  own step acceptance; a pixel that stopped no longer changes, and the loop ends
  when every pixel has stopped or after ``max_iter`` trial steps.
* The iteration is MINPACK's ``lmder`` (Moré 1978), the code behind
  ``scipy.optimize.curve_fit(method="lm")``: scaling ``D`` from the Jacobian's
  column norms, trust radius Δ and λ updated by the gain ratio ρ, the same ftol /
  xtol / gtol tests and defaults, so a pixel converges where curve_fit does and to
  the same point (see :mod:`.levmar_linalg` for the one difference: unpivoted QR).
* The covariance is curve_fit's ``pcov``: ``(JᵀWJ)⁻¹`` at the solution, times
  ``cost / (n_valid − n_param)`` unless ``absolute_sigma``; NaN where it is not
  defined (rank-deficient Jacobian, no degrees of freedom for the scale).
* Every pixel gets a status (:class:`.levmar_status.FitStatus`, CF flags): it is
  ``converged`` only where a convergence test held.

Where it runs: the ``solve`` implementation ``curvefit`` (``stages/solve/curvefit.py``)
calls it on each tile's pixels, chunk by chunk, with ``b`` the load's (pixel, obs) block
(NaN: gaps), the load's weights, ``t`` the observation coordinate as ``solve.t`` says
and ``f`` the user's ``solve.target``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Literal

import numpy as np
import torch

from gridsolve.stages.solve.levmar_bounds import BoundsLike, Box
from gridsolve.stages.solve.levmar_linalg import covariance
from gridsolve.stages.solve.levmar_problem import Model, Problem, Rows, problem
from gridsolve.stages.solve.levmar_state import State, refresh_jacobian, start, trial_step
from gridsolve.stages.solve.levmar_status import FitStatus, assign_status


@dataclass(frozen=True)
class LMResult:
    """What the fit found at every pixel (tensors on the input's device).

    ``params`` (pixel, param); ``covariance`` (pixel, param, param) and
    ``param_stderr`` (pixel, param), NaN where undefined; ``cost`` = Σ w r² at the
    solution; ``n_iter`` trial steps taken; ``residual_rms`` the unweighted RMS of
    ``b − f`` over the valid observations; ``n_valid`` valid observations;
    ``status`` int8 :class:`FitStatus` codes; ``reason`` MINPACK's ``info``
    (``levmar_status.REASONS``).
    """

    params: torch.Tensor
    covariance: torch.Tensor
    param_stderr: torch.Tensor
    cost: torch.Tensor
    n_iter: torch.Tensor
    residual_rms: torch.Tensor
    n_valid: torch.Tensor
    status: torch.Tensor
    reason: torch.Tensor

    def converged(self) -> torch.Tensor:
        """Per pixel: whether its status is ``converged``."""
        return self.status == int(FitStatus.CONVERGED)

    def arrays(self) -> dict[str, np.ndarray]:
        """Every field as a numpy array (on the CPU), by name."""
        return {k: v.detach().cpu().numpy() for k, v in vars(self).items()}


def default_max_iter(n_param: int) -> int:
    """Trial steps per pixel when none are given: MINPACK's ``maxfev`` for ``lmder``."""
    return 100 * (n_param + 1)


def fit_batched(
    f: Model,
    t: torch.Tensor,
    b: torch.Tensor,
    p0: torch.Tensor,
    *,
    weights: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
    bounds: BoundsLike | None = None,
    max_iter: int | None = None,
    xtol: float | None = None,
    ftol: float | None = None,
    gtol: float = 0.0,
    factor: float = 100.0,
    absolute_sigma: bool = False,
    jacobian: Literal["auto", "fwd", "rev"] = "auto",
) -> LMResult:
    """Least-squares fit of ``f(t, p)`` to ``b`` at every pixel, each pixel on its own.

    ``b`` (pixel, obs) float32/float64, NaN where missing; ``mask`` (pixel, obs)
    True where observed; ``weights`` (pixel, obs) or (obs,) are 1/σ² (0: not used);
    ``p0`` the start, (param,) or (pixel, param); ``bounds`` (lower, upper), scalars
    or one value per parameter, ±inf for none (see :mod:`.levmar_bounds`).

    ``max_iter`` trial steps (one model evaluation each; default 100·(n_param + 1),
    MINPACK's ``maxfev`` for ``lmder``); ``xtol``, ``ftol`` (default √eps of the
    dtype: curve_fit's 1.49e-8 in float64), ``gtol`` and ``factor`` as in
    ``scipy.optimize.leastsq``. ``absolute_sigma``: the covariance is not scaled
    by the residual variance (weights are 1/σ² of known errors). Deterministic:
    the same inputs give bit-identical results on the same device; a pixel's
    result can change in its last bits with its position in the batch (torch's
    vectorised and scalar math kernels round differently).
    """
    batch = begin(
        f,
        t,
        b,
        p0,
        weights=weights,
        mask=mask,
        bounds=bounds,
        max_iter=max_iter,
        xtol=xtol,
        ftol=ftol,
        gtol=gtol,
        factor=factor,
        jacobian=jacobian,
    )
    batch.advance()
    return batch.finish(absolute_sigma)


@dataclass
class Batch:
    """Pixels part way through the fit: their problem, their state and the loop's settings.

    Every pixel iterates on its own, so a batch can be split (:meth:`take`) and
    batches of the same fit joined (:func:`join`) between loop passes: a pixel's
    path does not depend on the pixels beside it (up to the last bits, see
    :func:`fit_batched`). The chunked fit (``curvefit.fit_pixels``) uses this to
    pool the slow pixels of many chunks instead of paying each chunk's tail of
    passes that move a few pixels each.
    """

    prob: Problem
    st: State
    limit: int
    tols: tuple[float, float]
    factor: float
    gtol: float

    def __len__(self) -> int:
        return int(self.st.u.shape[0])

    def advance(self, until_below: float = 0.0) -> None:
        """Loop passes until every pixel has stopped, or stop early.

        Early: after at least one pass, when fewer than ``until_below`` × the pixels
        that ran at the start of this call still run (0: never).
        """
        floor = until_below * int(self.st.active.sum())
        for passes in range(self.limit):
            refresh_jacobian(self.prob, self.st, self.factor, self.gtol)
            running = int(self.st.active.sum())
            if running == 0 or (passes > 0 and running < floor):
                return
            trial_step(self.prob, self.st, self.tols, self.limit)

    def running(self) -> torch.Tensor:
        """Per pixel: whether it still iterates."""
        return self.st.active.clone()

    def take(self, rows: torch.Tensor) -> Batch:
        """The batch of pixels ``rows`` (an index tensor), in that order."""
        return replace(self, prob=self.prob.take(rows), st=self.st.take(rows))

    def finish(self, absolute_sigma: bool = False) -> LMResult:
        """The result of every pixel of the batch, as it stands."""
        return _finish(self.prob, self.st, absolute_sigma)


def join(batches: Sequence[Batch]) -> Batch:
    """One batch of the pixels of ``batches`` (of the same fit), in order."""
    first = batches[0]
    for other in batches[1:]:
        # the same fit: its weighting, box and loop settings (the model is the caller's)
        if not (_same_box(other.prob.box, first.prob.box)) or (
            other.prob.unit_weights,
            other.limit,
            other.tols,
            other.factor,
            other.gtol,
        ) != (first.prob.unit_weights, first.limit, first.tols, first.factor, first.gtol):
            raise ValueError("join: the batches are not of the same fit")
    return replace(
        first,
        prob=Problem.join([x.prob for x in batches]),
        st=State.join([x.st for x in batches]),
    )


def _same_box(a: Box | None, b: Box | None) -> bool:
    if a is None or b is None:
        return a is b
    return bool(torch.equal(a.lo, b.lo) and torch.equal(a.hi, b.hi))


def begin(
    f: Model,
    t: torch.Tensor,
    b: torch.Tensor,
    p0: torch.Tensor,
    *,
    weights: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
    bounds: BoundsLike | None = None,
    max_iter: int | None = None,
    xtol: float | None = None,
    ftol: float | None = None,
    gtol: float = 0.0,
    factor: float = 100.0,
    jacobian: Literal["auto", "fwd", "rev"] = "auto",
    jacobians: tuple[Rows, Rows] | None = None,
) -> Batch:
    """The batch of every pixel at its start.

    Arguments as :func:`fit_batched`'s; ``jacobians`` as :func:`.levmar_problem.problem`'s.
    """
    prob, u0 = problem(f, t, b, p0, weights, mask, bounds, jacobian, jacobians)
    n_param = u0.shape[-1]
    eps = torch.finfo(b.dtype).eps
    tol_x = eps**0.5 if xtol is None else xtol
    tol_f = eps**0.5 if ftol is None else ftol
    if min(tol_x, tol_f, gtol) < 0 or factor <= 0:
        raise ValueError("xtol, ftol and gtol must be >= 0 and factor > 0")
    limit = default_max_iter(n_param) if max_iter is None else max_iter
    if limit < 1:
        raise ValueError(f"max_iter must be >= 1, got {max_iter}")
    return Batch(prob, start(prob, u0), limit, (tol_f, tol_x), factor, gtol)


def _finish(prob: Problem, st: State, absolute_sigma: bool) -> LMResult:
    """The result: parameters in the model's space, covariance at the solution, status."""
    n_param = st.u.shape[-1]
    fitted = (prob.n_valid >= n_param) & ~st.not_finite_at_start
    p = st.u if prob.box is None else prob.box.to_external(st.u)
    p = torch.where(fitted[:, None], p, torch.nan)
    cov = torch.full((*p.shape, n_param), torch.nan, dtype=p.dtype, device=p.device)
    singular = torch.zeros_like(fitted)
    idx = torch.nonzero(fitted & torch.isfinite(p).all(dim=-1)).flatten()
    if idx.numel():
        # in the model's own parameters (not the bounded internal ones): the
        # covariance of p, defined at a bound too
        J = prob.weighted_jacobian(p[idx], idx, external=True)
        cov[idx], singular[idx] = covariance(J, p[idx])
    cost = st.fnorm**2
    dof = prob.n_valid - n_param
    if not absolute_sigma:
        scale = torch.where(dof > 0, cost / dof.clamp(min=1), torch.nan)
        cov = cov * scale[:, None, None]
    cov = torch.where(fitted[:, None, None], cov, torch.nan)
    resid = torch.where(prob.valid, st.e / torch.where(prob.valid, prob.sqrtw, 1.0), 0.0)
    rms = torch.sqrt((resid**2).sum(dim=-1) / prob.n_valid.clamp(min=1))
    at_bound = torch.zeros_like(fitted) if prob.box is None else prob.box.at_bound(p)
    status = assign_status(prob.n_valid, n_param, st.reason, st.not_finite, at_bound, singular)
    return LMResult(
        params=p,
        covariance=cov,
        param_stderr=torch.sqrt(cov.diagonal(dim1=-2, dim2=-1)),
        cost=torch.where(fitted, cost, torch.nan),
        n_iter=st.n_iter,
        residual_rms=torch.where(fitted, rms, torch.nan),
        n_valid=prob.n_valid,
        status=status,
        reason=st.reason,
    )
