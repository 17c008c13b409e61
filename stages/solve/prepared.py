"""The ``lstsq`` solve's once-per-stage part: the shared design's operator and its facts.

The numerical policy and the fewest valid observations a config asks for, the
float32 limits, the prepared metadata (:class:`LstsqPrepared`) and
:class:`SharedOperator`, built by :func:`make_operator` after refusing designs
the policy or float32 cannot solve meaningfully.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from gridsolve.schemas.errors import ContractError, NumericalError
from gridsolve.schemas.kinds.solve import LstsqSolve
from gridsolve.schemas.metadata import SolvePrepared
from gridsolve.stages.engine.store import Artifact, native_order
from gridsolve.stages.solve.policy import OK, UNDERDETERMINED, Policy
from gridsolve.stages.solve.shared_operator import Operator, spans_constant, svd_operator

STAGE = "solve/lstsq"


#: Above this condition number a float32 solve loses more than ~0.1% (measured
#: in tests/stages/test_solve.py); refuse it and ask for float64.
FLOAT32_MAX_COND = 1e4


#: Under float32, a pixel whose float32 products may err by more than this
#: fraction of its residual RMS is computed in float64 (and stored as float32):
#: the products' rounding is about eps32 · √obs · max |b|, which swamps the
#: noise of data far from zero (pressure in hPa: a 1000 offset, 0.1 noise) and
#: with it the coefficients, standard errors and t.
FLOAT32_PRODUCT_TOL = 1e-5


#: Under float32, a pixel with a value larger than this (in magnitude) is
#: computed in float64 and stored as float32: products and sums of such
#: values can overflow float32 long before the results do.
FLOAT32_SAFE_MAX = 2.0**100


FLOAT32_RANGE = (float(np.finfo(np.float32).tiny), float(np.finfo(np.float32).max))


def policy_of(config: LstsqSolve) -> Policy:
    """The numerical policy a config asks for."""
    return Policy(config.policy, config.ridge, config.rcond, config.fallback)


def min_valid_of(config: LstsqSolve, coef: int) -> int:
    """Fewest valid observations a pixel needs."""
    if config.min_valid is not None:
        return config.min_valid
    return coef if config.policy == "cholesky" else 1


class LstsqPrepared(SolvePrepared):
    """The ``lstsq`` solve's own prepared metadata: the shared operator's facts."""

    rank: int
    cond: float
    method: str
    min_valid: int
    abs_max: float | None = None
    spans_const: bool = False


@dataclass(frozen=True)
class SharedOperator:
    """The once-per-stage part of a solve: the shared design's solution operator."""

    A: np.ndarray  # (obs, coef) float64
    sqrtw: np.ndarray  # (obs,) float64
    P: np.ndarray  # (coef, obs) float64, sqrt-weights folded in: c = P @ b
    #: (k, obs) with ‖Q b‖ = ‖b − A c‖ when the fit is an orthogonal projection
    #: (unweighted minnorm or cholesky) and k ≤ coef makes it the cheaper way; else None
    Q: np.ndarray | None
    cond: float
    rank: int
    method: str
    min_valid: int
    #: largest |value| of the whole cube (from the load stage); None: unknown
    data_max: float | None = None
    #: (coef,) identifiable coefficients of the shared design; None: all
    identifiable: np.ndarray | None = None
    #: the design spans the constant on its rows of weight > 0 (so on every subset)
    spans_const: bool = False
    #: (coef,) the coefficients the shared design's rows of weight > 0 determine,
    #: whatever the policy; None: all (full numerical rank)
    determined: np.ndarray | None = None

    @classmethod
    def from_artifact(cls, art: Artifact) -> SharedOperator:
        """Read it back from the prepared artifact."""
        meta = LstsqPrepared.of(art)
        return cls(
            A=np.array(art.array("A")),
            sqrtw=np.array(art.array("sqrtw")),
            P=np.array(art.array("P")),
            Q=np.array(art.array("Q")) if "Q" in art else None,
            cond=meta.cond,
            rank=meta.rank,
            method=meta.method,
            min_valid=meta.min_valid,
            data_max=meta.abs_max,
            identifiable=np.array(art.array("identifiable")).astype(bool)
            if "identifiable" in art
            else None,
            spans_const=meta.spans_const,
            determined=np.array(art.array("determined")).astype(bool)
            if "determined" in art
            else None,
        )


def make_operator(
    A: np.ndarray,
    sqrtw: np.ndarray,
    config: LstsqSolve,
    svd: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None,
    data_max: float | None = None,
) -> SharedOperator:
    """The shared operator for ``config``, after refusing setups it cannot solve meaningfully.

    ``data_max``, the largest |value| of the whole cube when known, spares the
    tiles a pass over their data to look for values near the dtype's limits.
    """
    A, sqrtw = native_order(A), native_order(sqrtw)
    n_obs, coef = A.shape
    _refuse_zero_weights(sqrtw)
    op = svd_operator(A * sqrtw[:, None], policy_of(config), svd=svd)
    _refuse_singular_cholesky(op, config, n_obs, coef)
    _refuse_coarse_float32(op, config)
    Q = _residual_basis(A, sqrtw, op, config)
    return SharedOperator(
        A=A,
        sqrtw=sqrtw,
        P=op.P * sqrtw[None, :],
        Q=Q,
        cond=op.cond,
        rank=op.rank,
        method=op.method,
        min_valid=min_valid_of(config, coef),
        data_max=data_max,
        identifiable=op.identifiable,
        spans_const=spans_constant(A[sqrtw > 0], policy_of(config)),
        determined=op.determined,
    )


def _refuse_zero_weights(sqrtw: np.ndarray) -> None:
    """Raise a ContractError when no observation has a weight > 0."""
    if not (sqrtw > 0).any():
        raise ContractError(
            "the shared weights are all zero: no observation has weight > 0",
            stage=STAGE,
            fix="check load.weights (does it name the right variable?): "
            "at least one observation needs a weight > 0",
        )


def _refuse_singular_cholesky(op: Operator, config: LstsqSolve, n_obs: int, coef: int) -> None:
    """Raise a NumericalError when policy cholesky meets a design it cannot factorise."""
    if config.policy == "cholesky" and op.status != OK:
        why = (
            f"coef ({coef}) > obs ({n_obs}), so AᵀA is singular"
            if coef > n_obs
            else f"the design has rank {op.rank} < coef {coef}"
        )
        raise NumericalError(
            f"policy cholesky cannot solve this design: {why}",
            stage=STAGE,
            expected=f"a design of full column rank {coef}",
            found=f"rank {op.rank}",
            fix="set solve.policy: minnorm (minimum-norm solution), or solve.policy: ridge "
            "with solve.ridge > 0; or use fewer coefficients",
        )


def _refuse_coarse_float32(op: Operator, config: LstsqSolve) -> None:
    """Raise a NumericalError when float32 cannot resolve a design this ill-conditioned."""
    if config.dtype == "float32" and op.cond > FLOAT32_MAX_COND:
        raise NumericalError(
            "float32 is too coarse for this design",
            stage=STAGE,
            expected=f"an effective condition number ≤ {FLOAT32_MAX_COND:g} for float32",
            found=f"{op.cond:.3g} (float32 keeps ~7 digits; "
            f"about {np.log10(op.cond):.1f} are lost)",
            fix="set solve.dtype: float64, or use a better-scaled design "
            "(e.g. design.scale: true, fewer polynomial degrees)",
        )


def _residual_basis(
    A: np.ndarray, sqrtw: np.ndarray, op: Operator, config: LstsqSolve
) -> np.ndarray | None:
    """The :attr:`SharedOperator.Q` of this design, or None where it does not apply or pay."""
    rank_left = A.shape[0] - op.rank
    if (
        # underdetermined: the minimum-norm fit is still the projection onto range(A)
        op.status in (OK, UNDERDETERMINED)
        and config.policy != "ridge"
        and (sqrtw == 1).all()
        and rank_left <= A.shape[1]
    ):
        # b − A c = (I − U_r U_rᵀ) b: its norm is that of b's part outside range(A).
        U_full = np.linalg.svd(A, full_matrices=True)[0]
        return np.ascontiguousarray(U_full[:, op.rank :].T)
    return None
