"""The ``solve`` stage: coefficients and diagnostics at every pixel, tile by tile.

Once per stage (``prepare``) the shared design's operator ``P`` is built from
the float64 SVD of the normal-equations stage, for the chosen policy; a
design that the policy cannot solve (``cholesky`` on a rank-deficient design)
or that float32 cannot resolve is refused here, before any tile runs.

Per tile, pixels are grouped by their pattern of valid observations:

* every pixel whose observations are all valid uses ``P``: one matrix product;
* a gap pattern shared by at least ``patterns.GROUP_MIN`` pixels of the whole
  grid (a time step missing everywhere) gets its own SVD operator: one more
  matrix product;
* the other pixels (clouds: nearly every pixel its own pattern) and pixels
  with their own weights are solved with per-pixel normal equations in float64
  (see :mod:`stages.solve.linalg`).

Pixels with no valid observation, or fewer than ``min_valid``, get NaN
coefficients and a status code; so do those a policy cannot solve.

With ``uncertainty`` set, every path also gives each pixel the unscaled
covariance ``P_w P_wᵀ`` of its solution operator (once per shared operator or
gap pattern; per pixel from the per-pixel factorisations, see
:mod:`stages.solve.linalg`), and the statistics follow per pixel: ``dof = n_valid
− tr(H)`` (the rank; ``Σ s²/(s²+λ)`` under ridge), ``σ² = Σ w r² / dof``,
standard errors, and R², centred when the pixel's valid rows span the
constant, uncentred otherwise (statsmodels). The t-statistics
(``t_values`` of ``stages/solve/outputs.py``: coefficient / standard error, as
stored) and the two-sided p-values (``p_values`` of t and ``dof``: Student t;
the normal distribution under ``cov_scale: unscaled``) are derived data: the
writer computes them where it writes them, tile by tile (a scipy call per value
costs more than the rest of the uncertainty, and a stored t was 20 MB of fresh
memory per 250,000 pixels of ten coefficients, a fifth of the uncertainty's cost).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np
import torch

from gridsolve.schemas.artifacts import Tile
from gridsolve.schemas.contracts import STATUS_FLAGS, ArraySpec, flag_counts
from gridsolve.schemas.errors import ContractError, NumericalError
from gridsolve.schemas.kinds.solve import LstsqSolve
from gridsolve.schemas.metadata import LoadMeta, SolvePrepared
from gridsolve.stages.engine.blocks import read_block
from gridsolve.stages.engine.context import StageContext, chunk_size, resolve_device, work_share
from gridsolve.stages.engine.store import Artifact, StageOutput, native_order
from gridsolve.stages.load import patterns
from gridsolve.stages.solve import kernel, linalg
from gridsolve.stages.solve.columns import (
    colmm,
    colmm_sub,
    column_rms,
    host_empty,
    residual_moments,
    stable_sum,
)
from gridsolve.stages.solve.dual import gapwise_dual
from gridsolve.stages.solve.policy import (
    ALL_MISSING,
    FELL_BACK_RIDGE,
    OK,
    REFINE_COND,
    SINGULAR,
    SOLVED,
    TOO_FEW,
    UNDERDETERMINED,
    Policy,
)
from gridsolve.stages.solve.shared_operator import (
    Operator,
    operator_spread,
    spans_constant,
    svd_operator,
)
from gridsolve.stages.solve.spread import Spread, spread_bytes

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

#: What ``uncertainty: stderr`` adds per tile (``cov`` adds ``coef_cov (coef, coef2, y, x)``).
UNCERTAINTY_OUTPUTS = {
    "coef_stderr": ArraySpec(("coef", "y", "x"), "f"),
    "dof": ArraySpec(("y", "x"), "f"),
    "r2": ArraySpec(("y", "x"), "f"),
    "uncertainty_flags": ArraySpec(("y", "x"), "i"),
}


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


def prepare(config: LstsqSolve, inputs: Mapping[str, Artifact], ctx: StageContext) -> StageOutput:
    """The shared operator, stored once for every tile."""
    ne, design = inputs["normal_equations"], inputs["design"]
    abs_max = LoadMeta.of(inputs["load"]).abs_max if "load" in inputs else None
    lo, hi = FLOAT32_RANGE
    if config.dtype == "float32" and abs_max and not lo <= abs_max <= hi:
        raise NumericalError(
            "the cube's values do not fit float32",
            stage=STAGE,
            expected=f"a largest |value| between {lo:.3g} and {hi:.3g} for solve.dtype: float32 "
            "(coefficients and residual RMS are stored as float32, in the data's units)",
            found=f"largest |value| {abs_max:.3g}",
            fix="set solve.dtype: float64, or rescale the data (e.g. change its units)",
        )
    A = np.array(design.array("A"))
    svd = (np.array(ne.array("U")), np.array(ne.array("s")), np.array(ne.array("Vt")))
    op = make_operator(A, np.array(ne.array("sqrtw")), config, svd, abs_max)
    arrays = {"P": op.P, "A": op.A, "sqrtw": op.sqrtw}
    if op.Q is not None:
        arrays["Q"] = op.Q
    if op.identifiable is not None:
        arrays["identifiable"] = op.identifiable.astype(np.uint8)
    if op.determined is not None:
        arrays["determined"] = op.determined.astype(np.uint8)
    return StageOutput(
        arrays=arrays,
        meta={
            "rank": op.rank,
            "cond": op.cond,
            "method": op.method,
            "min_valid": op.min_valid,
            "abs_max": op.data_max,
            "coef": int(A.shape[1]),
            "obs": int(A.shape[0]),
            "spans_const": op.spans_const,
            # the shared design's coefficients its rows do not determine (gap-free pixels)
            "undetermined_columns": []
            if op.determined is None
            else np.flatnonzero(~op.determined).tolist(),
            "uncertainty": config.uncertainty,
            "cov_scale": config.cov_scale,
        },
    )


def _fit_columns(
    B: np.ndarray,
    P: np.ndarray,
    A: np.ndarray,
    Q: np.ndarray | None,
    dtype: np.dtype,
    device: torch.device,
    store: np.dtype | None = None,
    data_max: float | None = None,
    sw: np.ndarray | None = None,
    centred: bool = True,
    refine: bool = False,
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray | None]:
    """Coefficients ``P @ B`` and residual RMS of finite columns sharing one operator.

    ``refine``: one step of refinement against the data, ``C += P (B − A C)``, and the
    residual of the refined coefficients (for an ill-conditioned design, see
    :data:`REFINE_COND`).

    With the rows' square-root weights ``sw``, also the root means of the
    weighted squared residuals and of the weighted squares of ``B`` about its
    weighted mean (``centred``) or about zero (see :func:`_fit`); else None.

    Computed in ``dtype``, except that under float32 a column with a value
    beyond :data:`FLOAT32_SAFE_MAX`, or whose float32 products cannot resolve its
    residual (:data:`FLOAT32_PRODUCT_TOL`), is computed in float64. A column whose
    coefficients do not fit ``store`` (default ``dtype``), the dtype they are
    stored in, gets an infinite residual RMS: solve_block refuses it.
    ``data_max`` bounds |B| when known (else B is scanned).
    """
    top = data_max
    if top is None:
        top = float(max(B.max(), -B.min())) if B.size else 0.0
    n_px = B.shape[1]
    wide = np.zeros(n_px, dtype=bool)
    if dtype == np.float32 and top > FLOAT32_SAFE_MAX:
        wide = np.maximum(B.max(axis=0), -B.min(axis=0)) > FLOAT32_SAFE_MAX
    if not wide.any():
        C, rms, wrms, trms = _fit(B, P, A, Q, dtype, device, sw, centred, refine)
    else:
        C = np.empty((P.shape[0], n_px), dtype=dtype)
        rms = np.full(n_px, np.nan, dtype=dtype)  # the wide columns' are found below
        wrms = None if sw is None else np.empty(n_px)
        trms = None if sw is None else np.empty(n_px)

    def fit_in(cols: np.ndarray, cdtype: np.dtype) -> None:
        if cols.any():
            C[:, cols], rms[cols], w_, t_ = _fit(
                B[:, cols], P, A, Q, cdtype, device, sw, centred, refine
            )
            if wrms is not None and trms is not None and w_ is not None and t_ is not None:
                wrms[cols], trms[cols] = w_, t_

    if wide.any():
        fit_in(~wide, dtype)
    if dtype == np.float32:
        # the wide columns' NaN RMS never reads as coarse: each is fitted once, below
        fit_in(wide | _coarse_in_float32(B, P, rms, top), np.dtype(np.float64))
    limit = float(np.finfo(store or dtype).max)
    # |c| ≤ ‖P‖∞ · max |b|: only near the limit is the (full) pass over C needed.
    if P.size and top * float(np.abs(P).sum(axis=1).max()) >= 0.5 * limit:
        with np.errstate(invalid="ignore"):
            rms[~(np.abs(C) <= limit).all(axis=0)] = np.inf
    return C, rms, wrms, trms


def _coarse_in_float32(B: np.ndarray, P: np.ndarray, rms: np.ndarray, top: float) -> np.ndarray:
    """Which columns of ``B`` float32 products cannot fit to :data:`FLOAT32_PRODUCT_TOL`.

    Those whose largest |value| is too far above their residual RMS ``rms`` (found
    in float32). A column with no residual degrees of freedom (no more rows than
    coefficients) has no noise to swamp and keeps float32. ``top`` bounds |B|: the
    columns are scanned only when it does not clear every one of them.
    """
    n = B.shape[0]
    none = np.zeros(B.shape[1], dtype=bool)
    if n <= P.shape[0] or not B.size:
        return none
    scale = float(np.finfo(np.float32).eps) * np.sqrt(n) / FLOAT32_PRODUCT_TOL
    rms64 = rms.astype(np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        if not (top * scale > rms64).any():
            return none
        coarse: np.ndarray = np.abs(B).max(axis=0).astype(np.float64) * scale > rms64
    return coarse


def _fit(
    B: np.ndarray,
    P: np.ndarray,
    A: np.ndarray,
    Q: np.ndarray | None,
    dtype: np.dtype,
    device: torch.device,
    sw: np.ndarray | None = None,
    centred: bool = True,
    refine: bool = False,
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray | None]:
    Bt = torch.from_numpy(np.ascontiguousarray(B, dtype=dtype)).to(device)
    Pt = torch.from_numpy(np.ascontiguousarray(P, dtype=dtype)).to(device)
    Ct = colmm(Pt, Bt, out=host_empty((P.shape[0], B.shape[1]), Pt.dtype, device))
    if refine:
        # one correction against the data: P's rounding grows with the design's
        # condition, the residual's does not (Wampler1: residual 1e-7 → 2e-10, QR's 7e-10)
        At = torch.from_numpy(np.ascontiguousarray(A, dtype=dtype)).to(device)
        Ct += colmm(Pt, Bt - colmm(At, Ct))
        Q = None  # the residual of the refined coefficients, below
    if Q is not None:
        R = colmm(torch.from_numpy(np.ascontiguousarray(Q, dtype=dtype)).to(device), Bt)
    else:
        At = torch.from_numpy(np.ascontiguousarray(A, dtype=dtype)).to(device)
        R = Bt - colmm(At, Ct)
    n = B.shape[0]
    rms = column_rms(R, n)
    if sw is None:
        return Ct.cpu().numpy(), rms.cpu().numpy(), None, None
    # Q is only used unweighted: then the weighted residual RMS is the RMS itself.
    unit = bool((sw == 1).all())
    swt = torch.from_numpy(np.ascontiguousarray(sw[:, None], dtype=dtype)).to(device)
    wrms = rms if unit else column_rms(R * swt, n)
    if centred:
        w = swt * swt
        mean = stable_sum(Bt * w) / w.sum()
        D = Bt - mean[None, :] if unit else (Bt - mean[None, :]) * swt
    else:
        D = Bt if unit else Bt * swt
    trms = column_rms(D, n)
    return (
        Ct.cpu().numpy(),
        rms.cpu().numpy(),
        wrms.cpu().numpy().astype(np.float64),
        trms.cpu().numpy().astype(np.float64),
    )


def _refuse_out_of_range(
    rms: np.ndarray, status: np.ndarray, dtype: np.dtype, where: Callable[[int], str]
) -> None:
    """Refuse a block in which a solved pixel's results do not fit (never NaN marked ok).

    Every path gives such a pixel a non-finite residual RMS.
    """
    bad = ~np.isfinite(rms)
    if not bad.any():
        return
    bad &= np.isin(status, SOLVED)
    if not bad.any():
        return
    first = int(np.flatnonzero(bad)[0])
    fix = (
        "set solve.dtype: float64, or rescale the data (e.g. change its units)"
        if dtype == np.float32
        else "rescale the data (e.g. change its units) or the design's columns"
    )
    raise NumericalError(
        f"coefficients or residual RMS exceed {dtype}'s range at {int(bad.sum())} pixel(s)",
        stage=STAGE,
        expected=f"finite results (|value| ≤ {float(np.finfo(dtype).max):.3g} in {dtype})",
        found=f"non-finite results, first at {where(first)}",
        fix=fix,
    )


def solve_block(
    B: np.ndarray,
    op: SharedOperator,
    config: LstsqSolve,
    own_weights: np.ndarray | None = None,
    memory_budget: int = 2**30,
    gap_patterns: np.ndarray | None = None,
    where: Callable[[int], str] | None = None,
) -> StageOutput:
    """Coefficients (coef, P), residual RMS, valid counts and status of pixels ``B`` (obs, P).

    ``gap_patterns`` are the pattern hashes common in the whole grid (from the
    load stage); pixels with one of them share a factorisation. A solved pixel
    whose results do not fit ``config.dtype`` is refused (NumericalError),
    named by ``where`` (pixel index → text).
    """
    B = native_order(B)
    own_weights = None if own_weights is None else native_order(own_weights)
    gap_patterns = None if gap_patterns is None else native_order(gap_patterns)
    # A result beyond the dtype's range becomes inf when stored: refused below.
    with np.errstate(over="ignore"):
        out = _solve_block(B, op, config, own_weights, memory_budget, gap_patterns)
    a = out.arrays
    _refuse_out_of_range(
        a["residual_rms"],
        a["status"],
        np.dtype(config.dtype),
        where or (lambda i: f"pixel {i} of the block"),
    )
    return out


class _Moments:
    """The uncertainty results of a block, filled path by path as pixels are solved."""

    def __init__(self, coef: int, n_px: int, config: LstsqSolve) -> None:
        self.config = config
        dtype = np.dtype(config.dtype)
        specs = dict(UNCERTAINTY_OUTPUTS)
        if config.uncertainty == "cov":
            specs["coef_cov"] = ArraySpec(("coef", "coef2", "y", "x"), "f")
        # Filled as paths solve pixels; what none fills is set once, at the end (finish).
        self.out = {
            name: np.empty(
                (*[coef for d in spec.dims if d.startswith("coef")], n_px),
                dtype if spec.kinds == "f" else np.dtype(np.int8),
            )
            for name, spec in specs.items()
        }
        self.done = np.zeros(n_px, dtype=bool)

    def put(
        self,
        idx: np.ndarray | slice,
        C: np.ndarray,
        n_valid: np.ndarray,
        status: np.ndarray,
        wrms: np.ndarray | None,
        trms: np.ndarray | None,
        var: np.ndarray,
        edf: np.ndarray | float,
        cov: np.ndarray | None,
    ) -> None:
        """Pixels ``idx``, from their stored coefficients ``C`` (coef, n), counts and status.

        With their weighted residual and data RMS and their unscaled spread;
        ``var``/``cov`` without a pixel axis are shared by all of them.
        """
        if cov is None and self._put_compiled(idx, C, n_valid, status, wrms, trms, var, edf):
            self.done[idx] = True
            return
        unknown = np.full(C.shape[1], np.nan)
        stats = _statistics(
            C,
            n_valid,
            status,
            unknown if wrms is None else wrms,
            unknown if trms is None else trms,
            var,
            edf,
            cov,
            self.config,
        )
        for name, values in stats.items():
            self.out[name][..., idx] = values
        self.done[idx] = True

    def _put_compiled(
        self,
        idx: np.ndarray | slice,
        C: np.ndarray,
        n_valid: np.ndarray,
        status: np.ndarray,
        wrms: np.ndarray | None,
        trms: np.ndarray | None,
        var: np.ndarray,
        edf: np.ndarray | float,
    ) -> bool:
        """:meth:`put` by the compiled kernel, where it applies; whether it did.

        It applies to per-pixel moments without covariance, and writes straight into
        the outputs when they are float64 and ``idx`` is a slice.
        """
        if (
            "coef_cov" in self.out
            or wrms is None
            or trms is None
            or var.ndim != 2
            or not isinstance(edf, np.ndarray)
            or kernel.name() != "c"
        ):
            return False
        p = C.shape[1]

        def rows(a: np.ndarray) -> np.ndarray:
            a = a.astype(np.float64, copy=False)
            return a if a.strides[1] == a.itemsize else np.ascontiguousarray(a)

        direct = isinstance(idx, slice) and self.out["coef_stderr"].dtype == np.float64
        names = ("coef_stderr", "dof", "r2", "uncertainty_flags")
        if direct:
            dest = {name: self.out[name][..., idx] for name in names}
        else:
            dest = {
                name: np.empty_like(self.out[name][..., :p], dtype=np.float64) for name in names
            }
            dest["uncertainty_flags"] = np.empty(p, dtype=np.int8)
        kernel.statistics(
            rows(C),
            np.ascontiguousarray(status, dtype=np.int8),
            np.ascontiguousarray(n_valid, dtype=np.int32),
            np.ascontiguousarray(wrms, dtype=np.float64),
            np.ascontiguousarray(trms, dtype=np.float64),
            rows(var),
            np.ascontiguousarray(edf, dtype=np.float64),
            self.config.policy == "ridge",
            self.config.cov_scale == "residual",
            SOLVED,
            FELL_BACK_RIDGE,
            dest,
        )
        if not direct:
            for name, values in dest.items():
                self.out[name][..., idx] = values
        return True

    def finish(self, C: np.ndarray, status: np.ndarray) -> dict[str, np.ndarray]:
        """The results of every pixel: those no path filled have NaN and their flags."""
        left = ~self.done
        if left.any():
            solved = _solved(C[:, left], status[left])
            for name, arr in self.out.items():
                if name == "uncertainty_flags":
                    # solved without a spread: not identifiable, no dof (as NaN moments give)
                    arr[left] = np.where(solved, 1 | 2, 4)
                else:
                    arr[..., left] = np.nan
        return self.out


def _shared_spread(
    op: SharedOperator, rows: np.ndarray, full: bool
) -> tuple[np.ndarray, float, np.ndarray | None]:
    """Unscaled spread of the shared operator restricted to ``rows`` (its zero-weight rows out)."""
    sw = op.sqrtw[rows]
    ident = op.identifiable if op.identifiable is not None else np.ones(op.A.shape[1], bool)
    if op.determined is not None:  # ridge's spread of a column the rows do not determine
        ident = ident & op.determined
    Pw, Aw = op.P[:, rows] / sw[None, :], op.A[rows] * sw[:, None]
    return operator_spread(Pw, Aw, ident, full)


def _solved(C: np.ndarray, status: np.ndarray) -> np.ndarray:
    solved: np.ndarray = np.isin(status, SOLVED) & np.isfinite(C).all(axis=0)
    return solved


def _statistics(
    C: np.ndarray,
    n_valid: np.ndarray,
    status: np.ndarray,
    wrms: np.ndarray,
    trms: np.ndarray,
    var: np.ndarray,
    edf: np.ndarray | float,
    cov: np.ndarray | None,
    config: LstsqSolve,
) -> dict[str, np.ndarray]:
    """Standard errors, dof, R², flags (and covariance) of pixels solved together.

    ``var`` (coef, n) or (coef,) and ``cov`` are the unscaled spread, NaN where
    a coefficient is not identifiable; the p-values are the writer's
    (``stages/solve/outputs.py`` ``p_values``).
    """
    dtype = np.dtype(config.dtype)
    solved = _solved(C, status)
    n = n_valid.astype(np.float64)
    var = var if var.ndim == 2 else var[:, None]
    with np.errstate(all="ignore"):
        dof = np.where(solved, n - edf, np.nan)
        # the effective rank is an integer unless ridge shrinks it: drop its rounding
        if config.policy != "ridge":
            whole = np.round(dof)
            exact = (np.abs(dof - whole) <= 1e-6) & (status != FELL_BACK_RIDGE)
            dof = np.where(exact, whole, dof) + 0.0  # no −0
        if config.cov_scale == "residual":
            # σ = wrms·√(n/dof), in roots so that squares of extreme data cannot overflow
            sigma = np.where(solved & (dof > 0), wrms * np.sqrt(n / dof), np.nan)
        else:
            sigma = np.where(solved, 1.0, np.nan)
        stderr = np.sqrt(var) * sigma
        r2 = np.where(solved, 1.0 - (wrms / trms) ** 2, np.nan)
    # var ≥ 0 or NaN (not identifiable): a column sum is NaN exactly where one is
    unidentified = np.isnan(var.sum(axis=0))
    flags = np.where(solved, unidentified * 1 + ~(dof > 0) * 2, 4).astype(np.int8)
    out = {
        "coef_stderr": stderr.astype(dtype, copy=False),
        "dof": dof.astype(dtype, copy=False),
        "r2": r2.astype(dtype, copy=False),
        "uncertainty_flags": flags,
    }
    if cov is not None:
        cov = cov if cov.ndim == 3 else cov[:, :, None]
        with np.errstate(all="ignore"):
            out["coef_cov"] = (cov * (sigma * sigma)).astype(dtype, copy=False)
    return out


@dataclass
class _Block:
    """A block being solved: its inputs and settings, its status, paths taken and timings."""

    B: np.ndarray  # (obs, P)
    op: SharedOperator
    config: LstsqSolve
    dtype: np.dtype  # of the stored results
    device: torch.device
    pol: Policy
    full: bool  # the covariance is asked for
    mom: _Moments | None  # None: no uncertainty asked for
    clock: float  # when the block started (perf_counter)
    seconds: dict[str, float]
    paths: dict[str, int]
    status: np.ndarray  # (P,) int8

    @classmethod
    def start(cls, B: np.ndarray, op: SharedOperator, config: LstsqSolve) -> _Block:
        """A block of pixels ``B`` with nothing solved yet."""
        dtype = np.dtype(config.dtype)
        device = resolve_device(config.device)
        pol = policy_of(config)
        clock = time.perf_counter()
        n_px = B.shape[1]
        full = config.uncertainty == "cov"
        mom = _Moments(op.A.shape[1], n_px, config) if config.uncertainty != "none" else None
        return cls(
            B=B,
            op=op,
            config=config,
            dtype=dtype,
            device=device,
            pol=pol,
            full=full,
            mom=mom,
            clock=clock,
            seconds={"mask": 0.0, "shared": 0.0, "pattern": 0.0, "per_pixel": 0.0},
            paths={"shared": 0, "pattern": 0, "per_pixel": 0},
            status=np.zeros(n_px, dtype=np.int8),
        )


@dataclass
class _Gappy:
    """Results of a block with gaps, each pixel's set by the path that solves it.

    The coefficients of pixels no path solves are NaN (:func:`_unsolved_are_nan`).
    """

    valid: np.ndarray  # (obs, P) the observations each pixel's fit uses
    n_valid: np.ndarray  # (P,) int32
    solvable: np.ndarray  # (P,) enough valid observations
    per_pixel: np.ndarray  # (P,) left to the per-pixel path
    C: np.ndarray  # (coef, P) in the stored dtype
    rms: np.ndarray  # (P,) in the stored dtype
    #: (coef, P) the coefficients each pixel's valid rows do not determine; None: none yet
    undetermined: np.ndarray | None = None

    def mark(self, idx: np.ndarray | slice, undetermined: np.ndarray) -> None:
        """Record which coefficients of pixels ``idx`` are undetermined: (coef, n) or (coef, 1)."""
        if self.undetermined is None:
            if not undetermined.any():
                return
            self.undetermined = np.zeros(self.C.shape, dtype=bool)
        self.undetermined[:, idx] = undetermined


@dataclass(frozen=True)
class _GroupOperator:
    """The operator that one group of pixels sharing a gap pattern is solved with."""

    P: np.ndarray  # (coef, rows), sqrt-weights folded in
    Q: np.ndarray | None  # see SharedOperator.Q
    status: int
    cond: float
    path: str  # "shared" or "pattern"
    spans: bool  # the rows span the constant (R² centred)
    spread: tuple[np.ndarray, float, np.ndarray | None] | None  # None: not asked for, or unknown
    determined: np.ndarray | None  # (coef,) the coefficients the rows determine; None: all


@dataclass(frozen=True)
class _PixelSystems:
    """What every batch of the per-pixel path shares."""

    At: torch.Tensor  # (obs, coef) float64 design on the device
    w_shared: torch.Tensor  # (obs, 1) shared weights on the device
    unweighted: bool  # the shared weights are all 1
    own_weights: np.ndarray | None  # (obs, P) each pixel's own weights

    @property
    def unit(self) -> bool:
        """Every pixel's weights are its 0/1 mask of valid observations."""
        return self.unweighted and self.own_weights is None


def _solve_block(
    B: np.ndarray,
    op: SharedOperator,
    config: LstsqSolve,
    own_weights: np.ndarray | None,
    memory_budget: int,
    gap_patterns: np.ndarray | None,
) -> StageOutput:
    """What :func:`solve_block` returns, before refusing results beyond the dtype's range."""
    if gap_patterns is None:
        gap_patterns = np.zeros(0, dtype=np.uint64)
    blk = _Block.start(B, op, config)
    enough = B.shape[0] >= op.min_valid  # else every pixel is too_few, gaps or not
    # The mask at once: a sum to test for gaps first costs as much as the mask (measured:
    # 2.2 ms each at 50 × 250,000 float32), and gappy blocks need the mask anyway.
    finite = np.isfinite(B)
    gap_free = bool(finite.all())
    if own_weights is None and (op.sqrtw > 0).all() and gap_free and enough:
        # No gaps: every pixel uses the shared operator; no grouping, no copies.
        return _solve_gapless(blk)
    g = _start_gappy(blk, finite, own_weights)
    if own_weights is None:
        _solve_patterns(blk, g, finite, gap_patterns)
    _solve_per_pixel(blk, g, own_weights, memory_budget)
    _unsolved_are_nan(g)
    return _gappy_output(blk, g)


def _unsolved_are_nan(g: _Gappy) -> None:
    """NaN coefficients for the pixels no path solves (too few valid observations)."""
    unsolved = np.flatnonzero(~g.solvable)
    if len(unsolved):
        g.C[:, unsolved] = np.nan


def _solve_gapless(blk: _Block) -> StageOutput:
    """The results of a block without gaps or zero weights: all by the shared operator."""
    op, mom = blk.op, blk.mom
    n_obs = op.A.shape[0]
    n_px = blk.B.shape[1]
    blk.seconds["mask"] = time.perf_counter() - blk.clock
    t0 = time.perf_counter()
    C, rms, wrms, trms = _fit_columns(
        blk.B,
        op.P,
        op.A,
        op.Q,
        blk.dtype,
        blk.device,
        data_max=op.data_max,
        sw=op.sqrtw if mom is not None else None,
        centred=op.spans_const,
        refine=_refines(blk, op.cond),
    )
    blk.paths["shared"] = n_px
    if op.determined is not None:
        blk.status[:] = UNDERDETERMINED
    arrays = {
        "coefficients": C,
        "residual_rms": rms,
        "n_valid": np.full(n_px, n_obs, dtype=np.int32),
        "status": blk.status,
    }
    # every pixel's undetermined coefficients are the shared design's: the writer takes
    # them from the prepared meta (a (coef, P) mask here was 25 MB a tile of the seed demo)
    if mom is not None:
        all_rows = np.ones(n_obs, dtype=bool)
        spread = _shared_spread(op, all_rows, blk.full)
        mom.put(slice(None), C, arrays["n_valid"], blk.status, wrms, trms, *spread)
        arrays.update(mom.finish(C, blk.status))
    blk.seconds["shared"] = time.perf_counter() - t0
    return StageOutput(
        arrays=arrays,
        meta={
            "status_counts": {STATUS_FLAGS[int(blk.status[0])]: n_px} if n_px else {},
            "paths": blk.paths,
            "seconds": blk.seconds,
        },
    )


def _start_gappy(blk: _Block, finite: np.ndarray, own_weights: np.ndarray | None) -> _Gappy:
    """Valid observations and their counts of a block with gaps; sets the unsolvable's status."""
    op, status = blk.op, blk.status
    sqrtw = op.sqrtw
    coef = op.A.shape[1]
    n_px = blk.B.shape[1]
    valid = finite
    if own_weights is not None:
        valid = finite & (own_weights > 0)
    elif not (sqrtw > 0).all():
        valid = finite & (sqrtw > 0)[:, None]
    # Not filled with NaN first: every solvable pixel is written by exactly one path, so
    # only the others' are set (_unsolved_are_nan); at coef 100 × 250,000 pixels the
    # fill was a 200 MB pass.
    C = np.empty((coef, n_px), dtype=blk.dtype)
    rms = np.full(n_px, np.nan, dtype=blk.dtype)
    # summed as bytes (numpy sums bools through int64: 10× slower); a count ≤ 255 fits one
    acc = np.uint8 if valid.shape[0] <= 255 else np.int32
    n_valid = np.add.reduce(valid.view(np.uint8), axis=0, dtype=acc).astype(np.int32)
    status[n_valid == 0] = ALL_MISSING
    status[(n_valid > 0) & (n_valid < op.min_valid)] = TOO_FEW
    solvable = n_valid >= op.min_valid
    return _Gappy(valid, n_valid, solvable, solvable.copy(), C, rms)


def _solve_patterns(blk: _Block, g: _Gappy, finite: np.ndarray, gap_patterns: np.ndarray) -> None:
    """Solve the pixels whose gap pattern is the full one or common in the grid, by pattern."""
    # Pixels whose gap pattern is the full one, or common in the whole grid,
    # share one factorisation per pattern; see stages.patterns.
    full_h = patterns.full_hash(blk.op.A.shape[0])
    if len(gap_patterns):
        h = patterns.pattern_hash(finite)
    else:  # no common gap pattern in the grid: only the full one is shared
        h = np.where(finite.all(axis=0), full_h, np.uint64(0))
    grouped = g.solvable & ((h == full_h) | np.isin(h, gap_patterns))
    idx_all = np.flatnonzero(grouped)
    order = np.argsort(h[idx_all], kind="stable")
    keys, starts = np.unique(h[idx_all][order], return_index=True)
    blk.seconds["mask"] = time.perf_counter() - blk.clock
    stops = np.append(starts[1:], len(order)) if len(keys) else starts
    for k, start, stop in zip(keys, starts, stops, strict=True):
        t0 = time.perf_counter()
        idx = idx_all[order[start:stop]]
        same = (finite[:, idx] == finite[:, idx[:1]]).all(axis=0)
        idx = idx[same]  # a hash collision (never seen) leaves the others per pixel
        path = _solve_group(blk, g, finite, idx, bool(k == full_h))
        blk.paths[path] += len(idx)
        blk.seconds[path] += time.perf_counter() - t0


def _solve_group(
    blk: _Block, g: _Gappy, finite: np.ndarray, idx: np.ndarray, full_pattern: bool
) -> str:
    """Solve pixels ``idx``, which share one gap pattern, with one operator; returns the path."""
    op, mom = blk.op, blk.mom
    rows = finite[:, idx[0]] & (op.sqrtw > 0)  # the valid observations of the group
    gop = _shared_restricted(blk, rows) if full_pattern else _pattern_operator(blk, rows)
    gdtype = blk.dtype if gop.cond <= FLOAT32_MAX_COND else np.dtype(np.float64)
    g.C[:, idx], g.rms[idx], wrms, trms = _fit_columns(
        blk.B[np.ix_(rows, idx)],
        gop.P,
        op.A[rows],
        gop.Q,
        gdtype,
        blk.device,
        blk.dtype,
        op.data_max,
        sw=op.sqrtw[rows] if mom is not None else None,
        centred=gop.spans,
        refine=_refines(blk, gop.cond),
    )
    blk.status[idx] = gop.status
    if gop.determined is not None and gop.status != SINGULAR:
        g.mark(idx, ~gop.determined[:, None])
    if mom is not None and gop.spread is not None:
        mom.put(idx, g.C[:, idx], g.n_valid[idx], blk.status[idx], wrms, trms, *gop.spread)
    g.per_pixel[idx] = False
    return gop.path


def _refines(blk: _Block, cond: float) -> bool:
    """Whether a shared operator of condition ``cond`` is refined (:data:`REFINE_COND`)."""
    # float32 operators are refused above FLOAT32_MAX_COND (1e4), far below
    return blk.dtype == np.float64 and np.isfinite(cond) and cond >= REFINE_COND


def _shared_restricted(blk: _Block, rows: np.ndarray) -> _GroupOperator:
    """The shared operator restricted to ``rows``, the observations of weight > 0."""
    op = blk.op
    # P's columns of zero-weight observations are zero: drop them.
    return _GroupOperator(
        P=op.P[:, rows],
        Q=op.Q if rows.all() else None,
        status=OK if op.determined is None else UNDERDETERMINED,
        cond=op.cond,
        path="shared",
        spans=op.spans_const,
        spread=_shared_spread(op, rows, blk.full) if blk.mom is not None else None,
        determined=op.determined,
    )


def _pattern_operator(blk: _Block, rows: np.ndarray) -> _GroupOperator:
    """A gap pattern's own SVD operator, on its valid observations ``rows``."""
    A, sqrtw = blk.op.A, blk.op.sqrtw
    g_op = svd_operator(A[rows] * sqrtw[rows, None], blk.pol)
    P = g_op.P * sqrtw[rows][None, :]
    spread: tuple[np.ndarray, float, np.ndarray | None] | None = None
    spans = blk.op.spans_const
    if blk.mom is not None:
        Aw = A[rows] * sqrtw[rows, None]
        # None: the pattern's Cholesky succeeded, so every coefficient is identifiable
        ident = g_op.identifiable if g_op.identifiable is not None else np.ones(A.shape[1], bool)
        if g_op.determined is not None:  # ridge's spread of a column the rows do not determine
            ident = ident & g_op.determined
        spread = operator_spread(g_op.P, Aw, ident, blk.full)
        spans = spans or spans_constant(A[rows], blk.pol)
    return _GroupOperator(
        P=P,
        Q=None,
        status=g_op.status,
        cond=g_op.cond,
        path="pattern",
        spans=spans,
        spread=spread,
        determined=g_op.determined,
    )


def _solve_per_pixel(
    blk: _Block, g: _Gappy, own_weights: np.ndarray | None, memory_budget: int
) -> None:
    """Solve the pixels no shared operator took with their own normal equations (float64)."""
    op = blk.op
    todo = np.flatnonzero(g.per_pixel)
    blk.paths["per_pixel"] = len(todo)
    t0 = time.perf_counter()
    if len(todo):
        systems = _PixelSystems(
            At=torch.from_numpy(op.A).to(blk.device),
            w_shared=torch.from_numpy(op.sqrtw**2).to(blk.device)[:, None],
            unweighted=bool((op.sqrtw == 1).all()),
            own_weights=own_weights,
        )
        by_gaps = gapwise_dual(systems.At, blk.pol, blk.mom is not None, systems.unit)
        max_gaps = op.A.shape[0] - int(g.n_valid[todo].min())
        chunk = _per_pixel_chunk(blk, memory_budget, max_gaps if by_gaps is not None else None)
        for sel, active in _per_pixel_batches(todo, g.per_pixel, blk.B.shape[1], chunk):
            if not active.any():
                continue
            _solve_batch(blk, g, systems, sel, active)
        g.rms[todo[blk.status[todo] == SINGULAR]] = np.nan
    blk.seconds["per_pixel"] = time.perf_counter() - t0


def _per_pixel_chunk(blk: _Block, memory_budget: int, max_gaps: int | None) -> int:
    """Pixels per batch of the per-pixel path (``max_gaps``: it solves by gaps, at most so many)."""
    config = blk.config
    n_obs, coef = blk.op.A.shape
    if max_gaps is not None:
        # dual._dual_schur: a dozen obs-long vectors, the coefficients, and each
        # pixel's gap block and its factor. Larger batches than the other paths: its
        # per-gap-count loops cost per batch, not per pixel.
        per_px = 8 * (12 * n_obs + 3 * coef + max_gaps * max_gaps)
        fit = chunk_size(work_share(memory_budget), per_px, minimum=1024)
        return config.chunk_pixels or min(65536, fit)
    big = max(coef, n_obs) if (config.policy != "cholesky" and coef > n_obs) else coef
    per_px_bytes = 8 * (3 * big * big + 8 * n_obs + 6 * coef)
    if blk.mom is not None:  # the spread's per-pixel factors, and the moments' columns
        dual = config.policy != "cholesky" and coef > n_obs
        per_px_bytes += spread_bytes(
            coef, n_obs, blk.full, config.policy == "ridge", dual, blk.device
        )
    fit = chunk_size(work_share(memory_budget), per_px_bytes, minimum=1024)
    # 16384: measured on the masked benchmark (coef 10, obs 50), 8192 costs 8% more
    # (a fixed cost per batch), 32768 60% more (a batch's arrays leave the cache).
    return config.chunk_pixels or min(16384, fit)


def _per_pixel_batches(
    todo: np.ndarray, per_pixel: np.ndarray, n_px: int, chunk: int
) -> list[tuple[slice | np.ndarray, np.ndarray]]:
    """The per-pixel path's batches: (the pixels of the batch, which of them to solve)."""
    # Mostly per-pixel tiles (clouds) go through contiguous column ranges,
    # which avoids gathering and scattering; the few other pixels in a range
    # are computed too and dropped (a pixel's result does not depend on its
    # neighbours in the batch). Tiles with few such pixels gather them.
    if len(todo) >= n_px // 2:
        return [
            (slice(s0, min(s0 + chunk, n_px)), per_pixel[s0 : s0 + chunk])
            for s0 in range(0, n_px, chunk)
        ]
    return [
        (todo[s0 : s0 + chunk], np.ones(len(todo[s0 : s0 + chunk]), dtype=bool))
        for s0 in range(0, len(todo), chunk)
    ]


def _batch_weights(
    systems: _PixelSystems,
    sel: slice | np.ndarray,
    vmask: np.ndarray,
    Vt_: torch.Tensor,
    device: torch.device,
) -> torch.Tensor:
    """The weights (obs, batch) of the pixels ``sel``: 0 for their invalid observations."""
    if systems.own_weights is not None:
        return torch.from_numpy(systems.own_weights[:, sel]).to(device) * Vt_
    if systems.unweighted:
        return torch.from_numpy(vmask.astype(np.float64)).to(device)
    return systems.w_shared * Vt_


def _solve_batch(
    blk: _Block,
    g: _Gappy,
    systems: _PixelSystems,
    sel: slice | np.ndarray,
    active: np.ndarray,
) -> None:
    """Solve the ``active`` pixels of batch ``sel`` and store their results (and moments)."""
    device, At, mom = blk.device, systems.At, blk.mom

    @functools.cache
    def valid_rows() -> tuple[np.ndarray, torch.Tensor]:
        # only where the kernels do not take the batch (a copy of the batch's mask)
        vmask = np.ascontiguousarray(g.valid[:, sel])
        return vmask, torch.from_numpy(vmask).to(device)

    act = torch.from_numpy(active).to(device)
    n_v = torch.from_numpy(g.n_valid[sel].astype(np.float64)).to(device)
    done = None
    if (
        device.type == "cpu"
        and systems.unit
        and (mom is None or (not blk.full and blk.op.spans_const))
    ):
        # the whole fit of each pixel in one read of its data (the usual masked case)
        fit = linalg.fit_unit(At, blk.B[:, sel], blk.pol, n_v, act, mom is not None)
        if fit is not None:
            x, px_status, sp, r_t, tr_t = fit
            done = _Solved(x, px_status, sp, r_t, r_t, tr_t)
    if done is None:
        done = _solve_batch_apart(blk, systems, sel, act, n_v, valid_rows)
    if done.spread is not None and done.spread.rss is not None and done.wrms is not None:
        done = _with_qr_rss(done, done.spread.rss, n_v, systems.unit)
    xs, sts, r, sp = (
        done.x.cpu().numpy(),
        done.status.cpu().numpy(),
        done.rms.cpu().numpy(),
        done.spread,
    )
    wrms = None if done.wrms is None else done.wrms.cpu().numpy()
    trms = None if done.trms is None else done.trms.cpu().numpy()
    var = edf = cov = None
    if mom is not None and sp is not None:
        var, edf = sp.var.cpu().numpy(), sp.edf.cpu().numpy()
        cov = None if sp.cov is None else sp.cov.cpu().numpy()
    undet = _undetermined(blk, g, sel, active, sts)
    if undet is not None and var is not None:
        # ridge's spread of a coefficient the rows do not determine means nothing
        var[undet] = np.nan
        if cov is not None:
            cov[undet[:, None, :] | undet[None, :, :]] = np.nan
    for on, pick in _stretches(sel, active):
        # Solved in float64: a coefficient beyond the stored dtype is inf once stored,
        # and so is its pixel's residual RMS (checked here, on the batch, while it is hot).
        stored = xs[:, pick].astype(g.C.dtype, copy=False)
        rms = np.where(np.isfinite(stored).all(axis=0), r[pick], np.inf)
        g.C[:, on], g.rms[on], blk.status[on] = stored, rms, sts[pick]
        if undet is not None:
            g.mark(on, undet[:, pick])
        if mom is not None and var is not None and edf is not None:
            assert wrms is not None and trms is not None
            mom.put(
                on,
                g.C[:, on],
                g.n_valid[on],
                blk.status[on],
                wrms[pick],
                trms[pick],
                var[:, pick],
                edf[pick],
                None if cov is None else cov[:, :, pick],
            )


def _with_qr_rss(done: _Solved, rss: torch.Tensor, n_v: torch.Tensor, unit: bool) -> _Solved:
    """``done`` with the weighted residual RMS from the spread's residual sum (where it has one).

    The residuals ``b − Ac`` of a design at float64's limit (equilibrated condition ≥
    ``policy.QR_SPREAD_COND``) lose digits to the columns' cancellation; the spread's
    compensated ones do not (see ``spread._qr_spread``). With unit weights the plain
    RMS is the weighted one (so such a design's ``residual_rms`` is the more exact one
    when uncertainty is asked for).
    """
    assert done.wrms is not None
    have = torch.isfinite(rss)
    wrms = torch.where(have, torch.sqrt(rss / n_v), done.wrms)
    rms = torch.where(have, wrms, done.rms) if unit else done.rms
    return dataclasses.replace(done, wrms=wrms, rms=rms)


def _undetermined(
    blk: _Block, g: _Gappy, sel: slice | np.ndarray, active: np.ndarray, status: np.ndarray
) -> np.ndarray | None:
    """(coef, batch): the coefficients the batch's pixels' valid rows do not determine.

    Only pixels with fewer valid rows than coefficients, or that the fallback found
    rank-deficient, or every pixel when the whole design is rank-deficient, are
    examined (an SVD of their rows); their ``status`` (of the batch, updated) becomes
    underdetermined. None when no pixel of the batch is.
    """
    coef = blk.op.A.shape[1]
    short = active & (g.n_valid[sel] < coef) & (status != SINGULAR)
    short |= active & (status == UNDERDETERMINED)
    shared = blk.op.determined
    if shared is not None:
        # the whole design leaves coefficients undetermined, so does every subset of its
        # rows; a pixel's own ridge factorisation succeeds all the same (found by the
        # property test: ridge on a design with two equal columns gave ok pixels)
        short |= active & (status != SINGULAR)
    if not short.any():
        return None
    cols = np.flatnonzero(short)
    out = np.zeros((coef, len(active)), dtype=bool)
    if shared is not None and not shared.any():
        # no subset of rows determines what all the rows do not (coef > obs: none)
        out[:, cols] = True
    else:
        idx = cols + sel.start if isinstance(sel, slice) else sel[cols]
        valid = torch.from_numpy(g.valid[:, idx].astype(np.float64)).to(blk.device)
        At = torch.from_numpy(blk.op.A).to(blk.device)
        out[:, cols] = ~linalg.determined_columns(At, valid, blk.pol).cpu().numpy()
    status[cols[out[:, cols].any(axis=0)]] = UNDERDETERMINED
    return out


#: Most stretches of solved pixels a batch is stored in before it is scattered instead.
_MAX_STRETCHES = 16


def _stretches(
    sel: slice | np.ndarray, active: np.ndarray
) -> list[tuple[slice | np.ndarray, slice | np.ndarray]]:
    """Where the ``active`` pixels of batch ``sel`` go, and where they are in the batch.

    Runs of consecutive pixels as slices when there are few (a cloudy tile's batch
    misses only the odd pixel another path took): views, where an index would
    gather and scatter every column; else one index of them all.
    """
    if isinstance(sel, slice):
        edges = np.flatnonzero(np.diff(active.astype(np.int8), prepend=0, append=0))
        if len(edges) <= 2 * _MAX_STRETCHES:
            return [
                (slice(sel.start + a, sel.start + b), slice(a, b))
                for a, b in zip(edges[::2].tolist(), edges[1::2].tolist(), strict=True)
            ]
        return [(np.flatnonzero(active) + sel.start, active)]
    return [(sel, active)]


@dataclass(frozen=True)
class _Solved:
    """A per-pixel batch's solution, residual RMS and (with uncertainty) its moments."""

    x: torch.Tensor  # (coef, P) float64
    status: torch.Tensor  # (P,) int8
    spread: Spread | None  # with uncertainty
    rms: torch.Tensor  # (P,) residual RMS over the valid rows
    wrms: torch.Tensor | None  # weighted residual RMS (with uncertainty)
    trms: torch.Tensor | None  # weighted RMS of the data about its mean, or zero where
    # the pixel's rows do not span the constant (with uncertainty)


def _solve_batch_apart(
    blk: _Block,
    systems: _PixelSystems,
    sel: slice | np.ndarray,
    act: torch.Tensor,
    n_v: torch.Tensor,
    valid_rows: Callable[[], tuple[np.ndarray, torch.Tensor]],
) -> _Solved:
    """A batch solved by separate passes over its data (any weights, policy and device)."""
    device, At, mom, unit = blk.device, systems.At, blk.mom, systems.unit
    # Invalid observations are NaN, ±inf or carry zero weight: zero them (linalg's
    # contract: B0 is 0 where the weight is), weight them 0.
    # unit: the weights are the finite values' mask, made in the same pass
    loaded = kernel.load(blk.B[:, sel], unit) if device.type == "cpu" else None
    W01 = None
    if loaded is None:
        B0 = torch.from_numpy(blk.B[:, sel]).to(device, torch.float64, copy=True)
        B0.nan_to_num_(0.0, 0.0, 0.0)
    else:  # the same values, in one pass
        B0, W01 = loaded
    Wp = W01 if W01 is not None else _batch_weights(systems, sel, *valid_rows(), device)
    sp = None
    if mom is None:
        x, px_status = linalg.solve_per_pixel(
            At, B0, Wp, blk.pol, active=act, unit=unit, n_valid=n_v
        )
    else:
        x, px_status, sp = linalg.solve_per_pixel_spread(
            At,
            B0,
            Wp,
            blk.pol,
            full=blk.full,
            spans_known=blk.op.spans_const,
            active=act,
            unit=unit,
            n_valid=n_v,
        )
    # compiled: the residual RMS and the moments in one read of the batch's data
    # unit weights: the weighted RMS is the plain one; every pixel's rows span the
    # constant: R² is centred, so the uncentred sum is not needed either
    centred_only = unit and sp is not None and bool(sp.spans.all())
    fused = residual_moments(At, B0, Wp, x, n_v, full=mom is not None, centred_only=centred_only)
    if fused is None:
        R = colmm_sub(B0, At, x).mul_(valid_rows()[1])
        r_t = column_rms(R, n_v)
        if sp is None:
            return _Solved(x, px_status, sp, r_t, None, None)
        wr, tr = _batch_moments(R, B0, Wp, n_v, r_t, sp.spans, unit)
        return _Solved(x, px_status, sp, r_t, wr, tr)
    r_t = fused[0]
    if sp is None:
        return _Solved(x, px_status, sp, r_t, None, None)
    wr = r_t if unit else fused[1]
    return _Solved(x, px_status, sp, r_t, wr, torch.where(sp.spans, fused[2], fused[3]))


def _batch_moments(
    R: torch.Tensor,
    B0: torch.Tensor,
    Wp: torch.Tensor,
    n_v: torch.Tensor,
    r_t: torch.Tensor,
    spans: torch.Tensor,
    plain: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per pixel of a batch: the weighted residual RMS and the weighted RMS of the data.

    The latter about the data's weighted mean where the pixel's valid rows span
    the constant (``spans``), else about zero. ``plain``: ``Wp`` is the 0/1 mask.
    """
    SW = Wp if plain else Wp.sqrt()
    wr = r_t if plain else column_rms(R * SW, n_v)
    # Means by a matrix product (one kernel, not a row-by-row sum): the centred sum
    # below is exact about any centre, and off by n·(error of the mean)², which is
    # far below its own rounding, so the mean need not be summed in a fixed order.
    ones = torch.ones((1, B0.shape[0]), dtype=B0.dtype, device=B0.device)
    # plain: B0 is 0 where invalid, Σ Wp = n_valid
    mean = colmm(ones, B0)[0] / n_v if plain else colmm(ones, Wp * B0)[0] / colmm(ones, Wp)[0]

    def centred(cols: slice | torch.Tensor) -> torch.Tensor:
        # plain: b − m on valid rows and 0 − 1·m·0 = 0 on the others, in one pass
        if plain:
            return torch.addcmul(B0[:, cols], Wp[:, cols], mean[None, cols], value=-1)
        return (B0[:, cols] - mean[None, cols]).mul_(SW[:, cols])

    # Σ d² by the same product (no fixed order needed: R² is not bit-compared); columns
    # whose sum overflowed or may have lost squares to underflow are redone with care.
    ss = colmm(ones, centred(slice(None)).square_())[0]
    fi = torch.finfo(ss.dtype)
    redo = ~((ss >= 4 * B0.shape[0] * fi.tiny / fi.eps) & (ss <= fi.max))
    tr = torch.sqrt(ss / n_v)
    if bool(redo.any()):
        cols = torch.nonzero(redo).flatten()
        tr[cols] = column_rms(centred(cols), n_v[cols])
    if not bool(spans.all()):
        tr = torch.where(spans, tr, column_rms(B0 * SW, n_v))
    return wr, tr


def _gappy_output(blk: _Block, g: _Gappy) -> StageOutput:
    """The arrays of a block with gaps (and their statistics), with counts, paths and timings."""
    counts_by_status = flag_counts(blk.status, STATUS_FLAGS)
    arrays = {
        "coefficients": g.C,
        "residual_rms": g.rms,
        "n_valid": g.n_valid,
        "status": blk.status,
    }
    if g.undetermined is not None:
        arrays["undetermined"] = g.undetermined.astype(np.uint8)
    if blk.mom is not None:
        arrays.update(blk.mom.finish(g.C, blk.status))
    return StageOutput(
        arrays=arrays,
        meta={"status_counts": counts_by_status, "paths": blk.paths, "seconds": blk.seconds},
    )


def run_tile(
    config: LstsqSolve,
    inputs: Mapping[str, Artifact],
    prepared: Artifact,
    tile: Tile,
    ctx: StageContext,
) -> StageOutput:
    """Coefficients, residual RMS, valid counts and status of one tile."""
    load = inputs["load"]
    load_meta = LoadMeta.of(load)
    op = SharedOperator.from_artifact(prepared)
    n_obs = op.A.shape[0]
    B = read_block(load, "cube", tile).reshape(n_obs, -1)
    weights_info = load_meta.aux.get("weights")
    own_w = None
    if weights_info is not None and not weights_info.shared:
        own_w = read_block(load, "weights", tile).reshape(n_obs, -1).astype(np.float64)
    gaps = np.array(load.array("gap_patterns")) if "gap_patterns" in load else None
    ny, nx = tile.shape

    def where(i: int) -> str:
        return load_meta.pixel_name(tile.y0 + i // nx, tile.x0 + i % nx)

    out = solve_block(B, op, config, own_w, ctx.memory_budget, gaps, where)
    out.arrays = {k: v.reshape(*v.shape[:-1], ny, nx) for k, v in out.arrays.items()}
    return out
