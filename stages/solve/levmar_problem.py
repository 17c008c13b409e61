"""The validated inputs of the nonlinear fit: the user's model batched, the pixels' data.

``f(t, p)`` is written for one sample; :func:`problem` checks the arrays, folds
NaN, the mask and zero weights into one validity mask, applies the bounds'
change of variables (:mod:`.levmar_bounds`) and batches ``f`` and its Jacobian
over pixels with ``torch.func.vmap`` (``jacfwd``, or ``jacrev`` when there are
more parameters than observations).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Literal

import numpy as np
import torch
from torch.func import jacfwd, jacrev, vmap

from gridsolve.stages.solve.levmar_bounds import BoundsLike, Box

#: A single-sample model: observation coordinates (n_obs, …) and parameters (n_param,)
#: to values (n_obs,).
Model = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

#: A batched function of parameter rows: u (k, n) → (k, …).
Rows = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class Problem:
    """The validated inputs of one fit: the batched model and the pixels' data."""

    values: Callable[[torch.Tensor], torch.Tensor]  # u (k, n) → f (k, m)
    jacobian: Callable[[torch.Tensor], torch.Tensor]  # u (k, n) → ∂f/∂u (k, m, n)
    jacobian_p: Callable[[torch.Tensor], torch.Tensor]  # p (k, n) → ∂f/∂p (k, m, n)
    b: torch.Tensor  # (P, m), 0 where not valid
    valid: torch.Tensor  # (P, m) bool
    sqrtw: torch.Tensor  # (P, m), 0 where not valid
    n_valid: torch.Tensor  # (P,) int
    box: Box | None
    unit_weights: bool = False  # no weights given: √w is 1 wherever valid

    def take(self, rows: torch.Tensor) -> Problem:
        """The problem of pixels ``rows`` (an index tensor) alone, in that order."""
        return replace(
            self,
            b=self.b[rows],
            valid=self.valid[rows],
            sqrtw=self.sqrtw[rows],
            n_valid=self.n_valid[rows],
        )

    @staticmethod
    def join(parts: Sequence[Problem]) -> Problem:
        """One problem of the pixels of ``parts`` (the same model and settings), in order."""
        return replace(
            parts[0],
            b=torch.cat([x.b for x in parts]),
            valid=torch.cat([x.valid for x in parts]),
            sqrtw=torch.cat([x.sqrtw for x in parts]),
            n_valid=torch.cat([x.n_valid for x in parts]),
        )

    def residuals(self, u: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """Weighted residuals ``√w (f − b)`` (k, m) of pixels ``idx`` at ``u``, 0 if not valid."""
        r = self.values(u) - self.b[idx]
        if not self.unit_weights:  # with unit weights the product is r itself, bit for bit
            r = r * self.sqrtw[idx]
        return torch.where(self.valid[idx], r, _zero(r))

    def weighted_jacobian(
        self,
        u: torch.Tensor,
        idx: torch.Tensor,
        external: bool = False,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``√w ∂f/∂u`` (k, m, n) of pixels ``idx`` at ``u``; 0 rows where not valid.

        ``external``: ``u`` are the model's parameters ``p``, differentiated directly.
        ``out``: a (k, m, n) tensor (or view) to write the result into.
        """
        J = (self.jacobian_p if external else self.jacobian)(u)
        if not self.unit_weights:
            J = J * self.sqrtw[idx][..., None]
        return torch.where(self.valid[idx][..., None], J, _zero(J), out=out)


def _zero(like: torch.Tensor) -> torch.Tensor:
    """A 0-dim zero of ``like``'s dtype and device (``torch.where``'s other, broadcast)."""
    return torch.zeros((), dtype=like.dtype, device=like.device)


def _batched(
    f: Model, t: torch.Tensor, n_param: int, how: Literal["auto", "fwd", "rev"]
) -> tuple[Callable[[torch.Tensor], torch.Tensor], Callable[[torch.Tensor], torch.Tensor]]:
    """(values, jacobian) of ``f`` at (k, n) parameter rows, vmapped over the rows."""
    fwd = how == "fwd" or (how == "auto" and n_param <= t.shape[0])
    jac = (jacfwd if fwd else jacrev)(f, argnums=1)
    values_v = vmap(f, in_dims=(None, 0))
    jac_v = vmap(jac, in_dims=(None, 0))
    return (lambda u: values_v(t, u)), (lambda u: jac_v(t, u))


def _as(x: torch.Tensor | np.ndarray, like: torch.Tensor) -> torch.Tensor:
    return torch.as_tensor(x, device=like.device).to(like.dtype)


def problem(
    f: Model,
    t: torch.Tensor,
    b: torch.Tensor,
    p0: torch.Tensor,
    weights: torch.Tensor | None,
    mask: torch.Tensor | None,
    bounds: BoundsLike | None,
    how: Literal["auto", "fwd", "rev"],
    jacobians: tuple[Rows, Rows] | None = None,
) -> tuple[Problem, torch.Tensor]:
    """The problem and the internal start (P, n) from the user's arguments, checked.

    ``jacobians``: (∂f/∂u, ∂f/∂p) of these ``f``, ``t`` and bounds already batched
    (compiled: :mod:`.levmar_compiled`), used instead of batching them again.
    """
    if b.ndim != 2 or b.dtype not in (torch.float32, torch.float64):
        raise ValueError(
            f"b must be a float32 or float64 (pixel, obs) array, got {tuple(b.shape)} {b.dtype}"
        )
    n_pix, n_obs = b.shape
    t = _as(t, b)
    p0 = _as(p0, b)
    if p0.ndim not in (1, 2) or (p0.ndim == 2 and p0.shape[0] != n_pix):
        raise ValueError(
            f"p0 must be (n_param,) or (n_pix={n_pix}, n_param), got {tuple(p0.shape)}"
        )
    if t.shape[:1] != (n_obs,):
        raise ValueError(f"t must have n_obs={n_obs} rows like b, got {tuple(t.shape)}")
    n_param = p0.shape[-1]
    start = p0.expand(n_pix, n_param).clone()
    w = torch.ones_like(b) if weights is None else _as(weights, b).expand(n_pix, n_obs)
    valid = torch.isfinite(b) & torch.isfinite(w) & (w > 0)
    if mask is not None:
        valid &= torch.as_tensor(mask, device=b.device).to(torch.bool).expand(n_pix, n_obs)
    if bool((w < 0).any()):
        raise ValueError("weights must be >= 0 (0: the observation is not used)")
    box = None if bounds is None else Box.of(bounds, n_param, b)
    model = f if box is None else (lambda t_, u: f(t_, box.to_external(u)))
    values, jac = _batched(model, t, n_param, how)
    if jacobians is not None:
        jac, jac_p = jacobians
    else:
        jac_p = jac if box is None else _batched(f, t, n_param, how)[1]
    zero = torch.zeros_like(b)
    prob = Problem(
        values=values,
        jacobian=jac,
        jacobian_p=jac_p,
        b=torch.where(valid, b, zero),
        valid=valid,
        sqrtw=torch.where(valid, torch.sqrt(torch.where(valid, w, zero)), zero),
        n_valid=valid.sum(dim=-1),
        box=box,
        unit_weights=weights is None,
    )
    return prob, start if box is None else box.to_internal(start)
