"""Per-pixel status codes of the nonlinear fit (CF ``flag_values`` / ``flag_meanings``).

Codes 0–2 and 5 mean what they mean in the linear solve's ``STATUS_FLAGS``
(:mod:`gridsolve.schemas.contracts`), so a reader of either product meets the
same numbers for the same situations; the others are the ways an iterative fit
can stop short.

One code per pixel, the first that applies in this order: ``all_missing``,
``too_few_observations``, ``model_not_finite``, ``iteration_limit``, ``stalled``,
``at_bound``, ``singular``, ``converged``. A pixel is ``converged`` only when one of
MINPACK's convergence tests (ftol, xtol or gtol; which one is in
``LMResult.reason``) held at its last step, no parameter sits at a bound and the
Jacobian at the solution has full rank.
"""

from __future__ import annotations

from enum import IntEnum

import torch


class FitStatus(IntEnum):
    """Why the fit of a pixel stopped (int8 codes of the ``status`` variable)."""

    #: a MINPACK convergence test held (ftol, xtol or gtol), full-rank Jacobian, inside bounds
    CONVERGED = 0
    #: no valid observation: not fitted, parameters NaN
    ALL_MISSING = 1
    #: fewer valid observations than parameters: not fitted, parameters NaN
    TOO_FEW_OBSERVATIONS = 2
    #: the iteration limit (``max_iter`` trial steps) was reached first
    ITERATION_LIMIT = 3
    #: no further progress possible at machine precision, tolerances not met
    #: (MINPACK's info 6, 7 and 8: ftol, xtol or gtol "too small")
    STALLED = 4
    #: converged, but the Jacobian at the solution is rank-deficient: covariance NaN
    SINGULAR = 5
    #: converged with a parameter at (within ``BOUND_RTOL`` of) one of its bounds
    AT_BOUND = 6
    #: the model or its Jacobian is not finite at the start or at an accepted point:
    #: parameters NaN at the start, the last accepted point otherwise
    MODEL_NOT_FINITE = 7


#: CF ``flag_meanings`` of each code (``flag_attrs(..., FIT_STATUS_FLAGS)``).
FIT_STATUS_FLAGS: dict[int, str] = {int(s): s.name.lower() for s in FitStatus}

#: MINPACK's ``info`` values kept in ``LMResult.reason`` (0: not fitted).
REASONS: dict[int, str] = {
    0: "not fitted",
    1: "ftol: actual and predicted relative reductions of the cost at most ftol",
    2: "xtol: relative change of the scaled parameters at most xtol",
    3: "ftol and xtol",
    4: "gtol: cosine between residuals and every Jacobian column at most gtol",
    5: "iteration limit",
    6: "ftol too small: no further reduction of the cost is possible",
    7: "xtol too small: no further improvement of the parameters is possible",
    8: "gtol too small: residuals orthogonal to the Jacobian to machine precision",
}

#: A parameter within this fraction of its bound interval (two-sided bounds), or of
#: max(1, |bound|) (one-sided), is at its bound.
BOUND_RTOL = 1e-6


def assign_status(
    n_valid: torch.Tensor,
    n_param: int,
    reason: torch.Tensor,
    not_finite: torch.Tensor,
    at_bound: torch.Tensor,
    singular: torch.Tensor,
) -> torch.Tensor:
    """The int8 status of every pixel from what the fit found, by the order in the docstring.

    ``reason`` holds MINPACK's info per pixel (0 while it never stopped, 5 at the
    iteration limit); the others are bool per pixel.
    """
    status = torch.full_like(reason, int(FitStatus.CONVERGED), dtype=torch.int8)
    stops = [
        (singular, FitStatus.SINGULAR),
        (at_bound, FitStatus.AT_BOUND),
        ((reason >= 6) & (reason <= 8), FitStatus.STALLED),
        ((reason == 5) | (reason == 0), FitStatus.ITERATION_LIMIT),
        (not_finite, FitStatus.MODEL_NOT_FINITE),
        (n_valid < n_param, FitStatus.TOO_FEW_OBSERVATIONS),
        (n_valid == 0, FitStatus.ALL_MISSING),
    ]
    # lowest precedence first: each later rule overwrites the earlier ones
    for where, code in stops:
        status = torch.where(where, torch.full_like(status, int(code)), status)
    return status
