"""Box bounds of the nonlinear fit as a change of variables (MINUIT's, as lmfit uses it).

Levenberg–Marquardt runs unconstrained on internal parameters ``u``; the model
sees ``p(u)``, which can never leave the box:

* both bounds: ``p = lo + (hi − lo)·(sin u + 1)/2``
* lower only:  ``p = lo − 1 + √(u² + 1)``
* upper only:  ``p = hi + 1 − √(u² + 1)``
* none:        ``p = u``

The transform is simple and keeps the fit a plain LM, at a known price: at a
bound ``dp/du = 0``. A start there would give the Jacobian a zero column and the
scaling ``D`` a zero, so the first step in ``u`` would be unbounded: a start is
moved into the box, at least ``START_MARGIN`` of its width (two-sided) or of
``max(1, |bound|)`` (one-sided) away from each bound. A solution at a bound is
flagged ``at_bound``; the covariance is computed from the Jacobian in ``p`` at the
solution, not in ``u``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from gridsolve.stages.solve.levmar_status import BOUND_RTOL

#: How far inside the box a start is put, as a fraction of the scale above.
START_MARGIN = 1e-2

BoundsLike = tuple[torch.Tensor | Sequence[float] | float, torch.Tensor | Sequence[float] | float]


@dataclass(frozen=True)
class Box:
    """Lower and upper bounds per parameter (±inf where there is none), on the fit's device."""

    lo: torch.Tensor
    hi: torch.Tensor

    @classmethod
    def of(cls, bounds: BoundsLike, n_param: int, like: torch.Tensor) -> Box:
        """The box of ``bounds`` = (lower, upper), each a scalar or one value per parameter."""
        lo, hi = (
            torch.as_tensor(v, dtype=like.dtype, device=like.device).expand(n_param).clone()
            for v in bounds
        )
        if torch.isnan(lo).any() or torch.isnan(hi).any() or bool((lo >= hi).any()):
            raise ValueError(
                f"bounds must be lower < upper for every parameter, got {lo.tolist()} and "
                f"{hi.tolist()}; use -inf/inf for a side without a bound"
            )
        return cls(lo, hi)

    def _parts(self) -> tuple[torch.Tensor, ...]:
        has_lo, has_hi = torch.isfinite(self.lo), torch.isfinite(self.hi)
        # finite stand-ins where a side is unbounded: the unused branches of the
        # transform stay finite, so neither their values nor their derivatives are NaN
        lo = torch.where(has_lo, self.lo, torch.zeros_like(self.lo))
        hi = torch.where(has_hi, self.hi, torch.ones_like(self.hi))
        return has_lo & has_hi, has_lo & ~has_hi, ~has_lo & has_hi, lo, hi

    def to_external(self, u: torch.Tensor) -> torch.Tensor:
        """The model's parameters ``p(u)`` of internal ones ``u`` (last dim: parameters)."""
        both, lower, upper, lo, hi = self._parts()
        root = torch.sqrt(u * u + 1)
        p = torch.where(both, lo + (hi - lo) * (torch.sin(u) + 1) / 2, u)
        p = torch.where(lower, lo - 1 + root, p)
        return torch.where(upper, hi + 1 - root, p)

    def _scale(self) -> torch.Tensor:
        """Per parameter: the box's width if two-sided, else max(1, |bound|)."""
        both, _, _, lo, hi = self._parts()
        one = torch.ones_like(self.lo)
        return torch.where(both, hi - lo, torch.maximum(one, torch.maximum(lo.abs(), hi.abs())))

    def to_internal(self, p: torch.Tensor) -> torch.Tensor:
        """Internal parameters ``u`` of a start ``p``, moved inside the box first."""
        both, lower, upper, lo, hi = self._parts()
        margin = START_MARGIN * self._scale()
        p = torch.minimum(torch.maximum(p, self.lo + margin), self.hi - margin)
        s = torch.clamp(2 * (p - lo) / (hi - lo) - 1, -1.0, 1.0)
        u = torch.where(both, torch.arcsin(s), p)
        u = torch.where(lower, torch.sqrt(torch.clamp((p - lo + 1) ** 2 - 1, min=0.0)), u)
        return torch.where(upper, torch.sqrt(torch.clamp((hi - p + 1) ** 2 - 1, min=0.0)), u)

    def at_bound(self, p: torch.Tensor) -> torch.Tensor:
        """Per pixel (rows of ``p``): whether a parameter is within ``BOUND_RTOL`` of a bound."""
        _, _, _, lo, hi = self._parts()
        tol = BOUND_RTOL * self._scale()
        near_lo = torch.isfinite(self.lo) & (p - lo <= tol)
        near_hi = torch.isfinite(self.hi) & (hi - p <= tol)
        return (near_lo | near_hi).any(dim=-1)
