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
  (see :mod:`stages.linalg`).

Pixels with no valid observation, or fewer than ``min_valid``, get NaN
coefficients and a status code; so do those a policy cannot solve.

With ``uncertainty`` set, every path also gives each pixel the unscaled
covariance ``P_w P_wᵀ`` of its solution operator (once per shared operator or
gap pattern; per pixel from the per-pixel factorisations, see
:mod:`stages.solve.linalg`), and the statistics follow per pixel: ``dof = n_valid
− tr(H)`` (the rank; ``Σ s²/(s²+λ)`` under ridge), ``σ² = Σ w r² / dof``,
standard errors, t-statistics and two-sided p-values (Student t with ``dof``;
the normal distribution under ``cov_scale: unscaled``), and R², centred when
the pixel's valid rows span the constant, uncentred otherwise (statsmodels).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import scipy.special
import torch

from gridsolve.schemas.artifacts import Tile
from gridsolve.schemas.config import LstsqSolve
from gridsolve.schemas.contracts import STATUS_FLAGS, ArraySpec
from gridsolve.schemas.errors import ContractError, NumericalError
from gridsolve.stages.engine.blocks import read_block
from gridsolve.stages.engine.context import StageContext, chunk_size, resolve_device
from gridsolve.stages.engine.registry import StageDecl, register
from gridsolve.stages.engine.store import Artifact, StageOutput
from gridsolve.stages.load import patterns
from gridsolve.stages.solve import linalg

VERSION = "1"
STAGE = "solve/lstsq"

#: Above this condition number a float32 solve loses more than ~0.1% (measured
#: in tests/stages/test_solve.py); refuse it and ask for float64.
FLOAT32_MAX_COND = 1e4
#: Under float32, a pixel with a value larger than this (in magnitude) is
#: computed in float64 and stored as float32: products and sums of such
#: values can overflow float32 long before the results do.
FLOAT32_SAFE_MAX = 2.0**100
FLOAT32_RANGE = (float(np.finfo(np.float32).tiny), float(np.finfo(np.float32).max))

TILE_OUTPUTS = {
    "coefficients": ArraySpec(("coef", "y", "x"), "f"),
    "residual_rms": ArraySpec(("y", "x"), "f"),
    "n_valid": ArraySpec(("y", "x"), "i"),
    "status": ArraySpec(("y", "x"), "i"),
}
#: What ``uncertainty: stderr`` adds per tile (``cov`` adds ``coef_cov (coef, coef2, y, x)``).
UNCERTAINTY_OUTPUTS = {
    "coef_stderr": ArraySpec(("coef", "y", "x"), "f"),
    "t_value": ArraySpec(("coef", "y", "x"), "f"),
    "p_value": ArraySpec(("coef", "y", "x"), "f"),
    "dof": ArraySpec(("y", "x"), "f"),
    "r2": ArraySpec(("y", "x"), "f"),
    "uncertainty_flags": ArraySpec(("y", "x"), "i"),
}
#: Bits of ``uncertainty_flags`` (CF flag_masks).
UNCERTAINTY_FLAGS = {
    1: "rank_deficient",  # some coefficients are not identifiable: their stderr, t, p are NaN
    2: "no_residual_dof",  # dof ≤ 0: the residual variance, hence the scaled stderr, is undefined
    4: "not_solved",  # the coefficients are NaN (see status)
}


def policy_of(config: LstsqSolve) -> linalg.Policy:
    """The numerical policy a config asks for."""
    return linalg.Policy(config.policy, config.ridge, config.rcond, config.fallback)


def min_valid_of(config: LstsqSolve, coef: int) -> int:
    """Fewest valid observations a pixel needs."""
    if config.min_valid is not None:
        return config.min_valid
    return coef if config.policy == "cholesky" else 1


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

    @classmethod
    def from_artifact(cls, art: Artifact) -> SharedOperator:
        """Read it back from the prepared artifact."""
        return cls(
            A=np.array(art.array("A")),
            sqrtw=np.array(art.array("sqrtw")),
            P=np.array(art.array("P")),
            Q=np.array(art.array("Q")) if "Q" in art else None,
            cond=float(art.meta["cond"]),
            rank=int(art.meta["rank"]),
            method=str(art.meta["method"]),
            min_valid=int(art.meta["min_valid"]),
            data_max=art.meta.get("abs_max"),
            identifiable=np.array(art.array("identifiable")).astype(bool)
            if "identifiable" in art
            else None,
            spans_const=bool(art.meta.get("spans_const", False)),
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
    n_obs, coef = A.shape
    if not (sqrtw > 0).any():
        raise ContractError(
            "the shared weights are all zero: no observation has weight > 0",
            stage=STAGE,
            fix="check load.weights (does it name the right variable?): "
            "at least one observation needs a weight > 0",
        )
    op = linalg.svd_operator(A * sqrtw[:, None], policy_of(config), svd=svd)
    if config.policy == "cholesky" and op.status != linalg.OK:
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
    Q = None
    rank_left = n_obs - op.rank
    if (
        op.status == linalg.OK
        and config.policy != "ridge"
        and (sqrtw == 1).all()
        and rank_left <= coef
    ):
        # b − A c = (I − U_r U_rᵀ) b: its norm is that of b's part outside range(A).
        U_full = np.linalg.svd(A, full_matrices=True)[0]
        Q = np.ascontiguousarray(U_full[:, op.rank :].T)
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
        spans_const=linalg.spans_constant(A[sqrtw > 0], policy_of(config)),
    )


def prepare(config: LstsqSolve, inputs: Mapping[str, Artifact], ctx: StageContext) -> StageOutput:
    """The shared operator, stored once for every tile."""
    ne, design = inputs["normal_equations"], inputs["design"]
    abs_max = inputs["load"].meta.get("abs_max") if "load" in inputs else None
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
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray | None]:
    """Coefficients ``P @ B`` and residual RMS of finite columns sharing one operator.

    With the rows' square-root weights ``sw``, also the root means of the
    weighted squared residuals and of the weighted squares of ``B`` about its
    weighted mean (``centred``) or about zero (see :func:`_fit`); else None.

    Computed in ``dtype``, except that under float32 a column with a value
    beyond :data:`FLOAT32_SAFE_MAX` is computed in float64. A column whose
    coefficients do not fit ``store`` (default ``dtype``), the dtype they are
    stored in, gets an infinite residual RMS: solve_block refuses it.
    ``data_max`` bounds |B| when known (else B is scanned).
    """
    top = data_max
    if top is None:
        top = float(max(B.max(), -B.min())) if B.size else 0.0
    if dtype == np.float32 and top > FLOAT32_SAFE_MAX:
        wide = np.maximum(B.max(axis=0), -B.min(axis=0)) > FLOAT32_SAFE_MAX
        C = np.empty((P.shape[0], B.shape[1]), dtype=dtype)
        rms = np.empty(B.shape[1], dtype=dtype)
        wrms = None if sw is None else np.empty(B.shape[1])
        trms = None if sw is None else np.empty(B.shape[1])
        for cols, cdtype in ((~wide, dtype), (wide, np.dtype(np.float64))):
            if cols.any():
                C[:, cols], rms[cols], w_, t_ = _fit(
                    B[:, cols], P, A, Q, cdtype, device, sw, centred
                )
                if wrms is not None and trms is not None and w_ is not None and t_ is not None:
                    wrms[cols], trms[cols] = w_, t_
    else:
        C, rms, wrms, trms = _fit(B, P, A, Q, dtype, device, sw, centred)
    limit = float(np.finfo(store or dtype).max)
    # |c| ≤ ‖P‖∞ · max |b|: only near the limit is the (full) pass over C needed.
    if P.size and top * float(np.abs(P).sum(axis=1).max()) >= 0.5 * limit:
        with np.errstate(invalid="ignore"):
            rms[~(np.abs(C) <= limit).all(axis=0)] = np.inf
    return C, rms, wrms, trms


def _fit(
    B: np.ndarray,
    P: np.ndarray,
    A: np.ndarray,
    Q: np.ndarray | None,
    dtype: np.dtype,
    device: torch.device,
    sw: np.ndarray | None = None,
    centred: bool = True,
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray | None]:
    Bt = torch.from_numpy(np.ascontiguousarray(B, dtype=dtype)).to(device)
    Ct = linalg.colmm(torch.from_numpy(np.ascontiguousarray(P, dtype=dtype)).to(device), Bt)
    if Q is not None:
        R = linalg.colmm(torch.from_numpy(np.ascontiguousarray(Q, dtype=dtype)).to(device), Bt)
    else:
        At = torch.from_numpy(np.ascontiguousarray(A, dtype=dtype)).to(device)
        R = Bt - linalg.colmm(At, Ct)
    n = B.shape[0]
    rms = linalg.column_rms(R, n)
    if sw is None:
        return Ct.cpu().numpy(), rms.cpu().numpy(), None, None
    # Q is only used unweighted: then the weighted residual RMS is the RMS itself.
    unit = bool((sw == 1).all())
    swt = torch.from_numpy(np.ascontiguousarray(sw[:, None], dtype=dtype)).to(device)
    wrms = rms if unit else linalg.column_rms(R * swt, n)
    if centred:
        w = swt * swt
        mean = linalg.stable_sum(Bt * w) / w.sum()
        D = Bt - mean[None, :] if unit else (Bt - mean[None, :]) * swt
    else:
        D = Bt if unit else Bt * swt
    trms = linalg.column_rms(D, n)
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
    bad &= np.isin(status, (linalg.OK, linalg.FELL_BACK_RIDGE, linalg.FELL_BACK_MINNORM))
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
    """Per-pixel pieces of the uncertainty of a block, filled path by path (float64)."""

    def __init__(self, coef: int, n_px: int, full: bool) -> None:
        self.wrms = np.full(n_px, np.nan)  # √(Σ w r² / n_valid)
        self.trms = np.full(n_px, np.nan)  # √(Σ w (b − b̄_w)² / n_valid), or about 0
        self.edf = np.full(n_px, np.nan)  # effective number of parameters tr(H)
        self.var = np.full((coef, n_px), np.nan)  # unscaled variances; NaN: not identifiable
        self.cov = np.full((coef, coef, n_px), np.nan) if full else None

    def put(
        self,
        idx: np.ndarray,
        wrms: np.ndarray | None,
        trms: np.ndarray | None,
        var: np.ndarray,
        edf: np.ndarray | float,
        cov: np.ndarray | None,
    ) -> None:
        """Pixels ``idx``; ``var``/``cov`` without a pixel axis are shared by all of them."""
        if wrms is not None and trms is not None:
            self.wrms[idx], self.trms[idx] = wrms, trms
        self.edf[idx] = edf
        self.var[:, idx] = var if var.ndim == 2 else var[:, None]
        if self.cov is not None and cov is not None:
            self.cov[:, :, idx] = cov if cov.ndim == 3 else cov[:, :, None]


def _shared_spread(
    op: SharedOperator, rows: np.ndarray, full: bool
) -> tuple[np.ndarray, float, np.ndarray | None]:
    """Unscaled spread of the shared operator restricted to ``rows`` (its zero-weight rows out)."""
    sw = op.sqrtw[rows]
    ident = op.identifiable if op.identifiable is not None else np.ones(op.A.shape[1], bool)
    Pw, Aw = op.P[:, rows] / sw[None, :], op.A[rows] * sw[:, None]
    return linalg.operator_spread(Pw, Aw, ident, full)


def _statistics(
    C: np.ndarray,
    n_valid: np.ndarray,
    status: np.ndarray,
    mom: _Moments,
    config: LstsqSolve,
) -> dict[str, np.ndarray]:
    """Standard errors, t, p-values, dof, R², flags (and covariance) of a block's pixels."""
    dtype = np.dtype(config.dtype)
    ok_codes = (linalg.OK, linalg.FELL_BACK_RIDGE, linalg.FELL_BACK_MINNORM)
    solved = np.isin(status, ok_codes) & np.isfinite(C).all(axis=0)
    n = n_valid.astype(np.float64)
    with np.errstate(all="ignore"):
        dof = np.where(solved, n - mom.edf, np.nan)
        # the effective rank is an integer unless ridge shrinks it: drop its rounding
        if config.policy != "ridge":
            whole = np.round(dof)
            exact = (np.abs(dof - whole) <= 1e-6) & (status != linalg.FELL_BACK_RIDGE)
            dof = np.where(exact, whole, dof) + 0.0  # no −0
        if config.cov_scale == "residual":
            # σ = wrms·√(n/dof), in roots so that squares of extreme data cannot overflow
            sigma = np.where(solved & (dof > 0), mom.wrms * np.sqrt(n / dof), np.nan)
        else:
            sigma = np.where(solved, 1.0, np.nan)
        stderr = sigma * np.sqrt(mom.var)
        t = C.astype(np.float64) / stderr
        # scipy.stats.t.sf(x, dof) is scipy.special.stdtr(dof, −x): called directly, it
        # skips the distribution's argument checks (2.5× faster on millions of values).
        if config.cov_scale == "residual":
            p = 2.0 * scipy.special.stdtr(np.where(dof > 0, dof, np.nan), -np.abs(t))
        else:
            p = 2.0 * scipy.special.ndtr(-np.abs(t))
        r2 = np.where(solved, 1.0 - (mom.wrms / mom.trms) ** 2, np.nan)
    flags = (
        (solved & np.isnan(mom.var).any(axis=0)) * 1 + (solved & ~(dof > 0)) * 2 + (~solved) * 4
    ).astype(np.int8)
    out = {
        "coef_stderr": stderr.astype(dtype),
        "t_value": t.astype(dtype),
        "p_value": p.astype(dtype),
        "dof": dof.astype(dtype),
        "r2": r2.astype(dtype),
        "uncertainty_flags": flags,
    }
    if mom.cov is not None:
        with np.errstate(all="ignore"):
            out["coef_cov"] = (mom.cov * (sigma * sigma)).astype(dtype)
    return out


def _solve_block(
    B: np.ndarray,
    op: SharedOperator,
    config: LstsqSolve,
    own_weights: np.ndarray | None,
    memory_budget: int,
    gap_patterns: np.ndarray | None,
) -> StageOutput:
    if gap_patterns is None:
        gap_patterns = np.zeros(0, dtype=np.uint64)
    A, sqrtw = op.A, op.sqrtw
    n_obs, coef = A.shape
    dtype = np.dtype(config.dtype)
    device = resolve_device(config.device)
    pol = policy_of(config)
    clock = time.perf_counter()
    seconds = {"mask": 0.0, "shared": 0.0, "pattern": 0.0, "per_pixel": 0.0}
    paths = {"shared": 0, "pattern": 0, "per_pixel": 0}
    n_px = B.shape[1]
    full = config.uncertainty == "cov"
    mom = _Moments(coef, n_px, full) if config.uncertainty != "none" else None

    status = np.zeros(n_px, dtype=np.int8)
    finite = np.isfinite(B)
    if own_weights is None and (sqrtw > 0).all() and finite.all():
        # No gaps: every pixel uses the shared operator; no grouping, no copies.
        seconds["mask"] = time.perf_counter() - clock
        t0 = time.perf_counter()
        C, rms, wrms, trms = _fit_columns(
            B,
            op.P,
            A,
            op.Q,
            dtype,
            device,
            data_max=op.data_max,
            sw=sqrtw if mom is not None else None,
            centred=op.spans_const,
        )
        paths["shared"] = n_px
        arrays = {
            "coefficients": C,
            "residual_rms": rms,
            "n_valid": np.full(n_px, n_obs, dtype=np.int32),
            "status": status,
        }
        if mom is not None:
            all_rows = np.ones(n_obs, dtype=bool)
            mom.put(np.arange(n_px), wrms, trms, *_shared_spread(op, all_rows, full))
            arrays.update(_statistics(C, arrays["n_valid"], status, mom, config))
        seconds["shared"] = time.perf_counter() - t0
        return StageOutput(
            arrays=arrays,
            meta={"status_counts": {"ok": n_px}, "paths": paths, "seconds": seconds},
        )

    valid = finite
    if own_weights is not None:
        valid = finite & (own_weights > 0)
    elif not (sqrtw > 0).all():
        valid = finite & (sqrtw > 0)[:, None]
    C = np.full((coef, n_px), np.nan, dtype=dtype)
    rms = np.full(n_px, np.nan, dtype=dtype)
    n_valid = valid.sum(axis=0).astype(np.int32)
    status[n_valid == 0] = linalg.ALL_MISSING
    status[(n_valid > 0) & (n_valid < op.min_valid)] = linalg.TOO_FEW
    solvable = n_valid >= op.min_valid
    per_pixel = solvable.copy()
    if own_weights is None:
        # Pixels whose gap pattern is the full one, or common in the whole grid,
        # share one factorisation per pattern; see stages.patterns.
        full_h = patterns.full_hash(n_obs)
        if len(gap_patterns):
            h = patterns.pattern_hash(finite)
        else:  # no common gap pattern in the grid: only the full one is shared
            h = np.where(finite.all(axis=0), full_h, np.uint64(0))
        grouped = solvable & ((h == full_h) | np.isin(h, gap_patterns))
        idx_all = np.flatnonzero(grouped)
        order = np.argsort(h[idx_all], kind="stable")
        keys, starts = np.unique(h[idx_all][order], return_index=True)
        seconds["mask"] = time.perf_counter() - clock
        stops = np.append(starts[1:], len(order)) if len(keys) else starts
        for k, start, stop in zip(keys, starts, stops, strict=True):
            t0 = time.perf_counter()
            idx = idx_all[order[start:stop]]
            same = (finite[:, idx] == finite[:, idx[:1]]).all(axis=0)
            idx = idx[same]  # a hash collision (never seen) leaves the others per pixel
            rows = finite[:, idx[0]] & (sqrtw > 0)  # the valid observations of the group
            spread: tuple[np.ndarray, float, np.ndarray | None] | None = None
            spans = op.spans_const
            if k == full_h:
                # P's columns of zero-weight observations are zero: drop them.
                P, Q, st, cond = op.P[:, rows], op.Q if rows.all() else None, linalg.OK, op.cond
                path = "shared"
                if mom is not None:
                    spread = _shared_spread(op, rows, full)
            else:
                g_op = linalg.svd_operator(A[rows] * sqrtw[rows, None], pol)
                P, Q, st, cond = g_op.P * sqrtw[rows][None, :], None, g_op.status, g_op.cond
                path = "pattern"
                if mom is not None and g_op.identifiable is not None:
                    Aw = A[rows] * sqrtw[rows, None]
                    spread = linalg.operator_spread(g_op.P, Aw, g_op.identifiable, full)
                    spans = spans or linalg.spans_constant(A[rows], pol)
            gdtype = dtype if cond <= FLOAT32_MAX_COND else np.dtype(np.float64)
            C[:, idx], rms[idx], wrms, trms = _fit_columns(
                B[np.ix_(rows, idx)],
                P,
                A[rows],
                Q,
                gdtype,
                device,
                dtype,
                op.data_max,
                sw=sqrtw[rows] if mom is not None else None,
                centred=spans,
            )
            if mom is not None and spread is not None:
                mom.put(idx, wrms, trms, *spread)
            status[idx] = st
            per_pixel[idx] = False
            paths[path] += len(idx)
            seconds[path] += time.perf_counter() - t0

    todo = np.flatnonzero(per_pixel)
    paths["per_pixel"] = len(todo)
    t0 = time.perf_counter()
    if len(todo):
        big = max(coef, n_obs) if (config.policy != "cholesky" and coef > n_obs) else coef
        per_px_bytes = 8 * (3 * big * big + 8 * n_obs + 6 * coef)
        if mom is not None:  # the spread's per-pixel factors (linalg._primal/_dual_spread)
            per_px_bytes += 8 * (4 * coef * coef + 2 * n_obs * coef + 4 * n_obs)
        fit = chunk_size(memory_budget // 4, per_px_bytes, minimum=1024)
        chunk = config.chunk_pixels or min(8192, fit)
        At = torch.from_numpy(A).to(device)
        w_shared = torch.from_numpy(sqrtw**2).to(device)[:, None]
        unweighted = bool((sqrtw == 1).all())
        # Mostly per-pixel tiles (clouds) go through contiguous column ranges,
        # which avoids gathering and scattering; the few other pixels in a range
        # are computed too and dropped (a pixel's result does not depend on its
        # neighbours in the batch). Tiles with few such pixels gather them.
        if len(todo) >= n_px // 2:
            batches: list[tuple[slice | np.ndarray, np.ndarray]] = [
                (slice(s0, min(s0 + chunk, n_px)), per_pixel[s0 : s0 + chunk])
                for s0 in range(0, n_px, chunk)
            ]
        else:
            batches = [
                (todo[s0 : s0 + chunk], np.ones(len(todo[s0 : s0 + chunk]), dtype=bool))
                for s0 in range(0, len(todo), chunk)
            ]
        for sel, active in batches:
            if not active.any():
                continue
            vmask = np.ascontiguousarray(valid[:, sel])
            Vt_ = torch.from_numpy(vmask).to(device)
            # Invalid observations are NaN or carry zero weight: zero them, weight them 0.
            B0 = torch.from_numpy(B[:, sel]).to(device, torch.float64, copy=True).nan_to_num_(0.0)
            if own_weights is not None:
                Wp: torch.Tensor = torch.from_numpy(own_weights[:, sel]).to(device) * Vt_
            elif unweighted:
                Wp = torch.from_numpy(vmask.astype(np.float64)).to(device)
            else:
                Wp = w_shared * Vt_
            act = torch.from_numpy(active).to(device)
            sp = None
            if mom is None:
                x, px_status = linalg.solve_per_pixel(At, B0, Wp, pol, active=act)
            else:
                x, px_status, sp = linalg.solve_per_pixel_spread(
                    At, B0, Wp, pol, full=full, spans_known=op.spans_const, active=act
                )
            R = (B0 - linalg.colmm(At, x)).mul_(Vt_)
            n_v = torch.from_numpy(n_valid[sel].astype(np.float64)).to(device)
            r_t = linalg.column_rms(R, n_v)
            r = r_t.cpu().numpy()
            if mom is not None and sp is not None:
                plain = own_weights is None and unweighted
                SW = Wp if plain else Wp.sqrt()  # plain: Wp is the 0/1 mask
                wr = r_t if plain else linalg.column_rms(R * SW, n_v)
                if plain:  # B0 is 0 where invalid, Σ Wp = n_valid
                    mean = linalg.stable_sum(B0) / n_v
                else:
                    mean = linalg.stable_sum(Wp * B0) / linalg.stable_sum(Wp)
                tr = linalg.column_rms((B0 - mean[None, :]).mul_(SW), n_v)
                if not bool(sp.spans.all()):
                    tr = torch.where(sp.spans, tr, linalg.column_rms(B0 * SW, n_v))
                on = np.arange(n_px)[sel][active]
                cov = None if sp.cov is None else sp.cov[:, :, active].cpu().numpy()
                mom.put(
                    on,
                    wr.cpu().numpy()[active],
                    tr.cpu().numpy()[active],
                    sp.var[:, active].cpu().numpy(),
                    sp.edf.cpu().numpy()[active],
                    cov,
                )
            xs, sts = x.cpu().numpy(), px_status.cpu().numpy()
            if isinstance(sel, slice) and active.all():
                C[:, sel], rms[sel], status[sel] = xs, r, sts
            else:
                cols = (np.flatnonzero(active) + sel.start) if isinstance(sel, slice) else sel
                C[:, cols], rms[cols], status[cols] = xs[:, active], r[active], sts[active]
        # Solved in float64: a coefficient beyond the stored dtype is inf now.
        over = ~np.isfinite(C[:, todo]).all(axis=0)
        rms[todo[over]] = np.inf
        rms[todo[status[todo] == linalg.SINGULAR]] = np.nan
    seconds["per_pixel"] = time.perf_counter() - t0

    counts_by_status = {
        STATUS_FLAGS[int(k)]: int(v)
        for k, v in zip(*np.unique(status, return_counts=True), strict=True)
    }
    arrays = {"coefficients": C, "residual_rms": rms, "n_valid": n_valid, "status": status}
    if mom is not None:
        arrays.update(_statistics(C, n_valid, status, mom, config))
    return StageOutput(
        arrays=arrays,
        meta={"status_counts": counts_by_status, "paths": paths, "seconds": seconds},
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
    op = SharedOperator.from_artifact(prepared)
    n_obs = op.A.shape[0]
    B = read_block(load, "cube", tile).reshape(n_obs, -1)
    weights_info = load.meta["aux"].get("weights")
    own_w = None
    if weights_info is not None and not weights_info["shared"]:
        own_w = read_block(load, "weights", tile).reshape(n_obs, -1).astype(np.float64)
    gaps = np.array(load.array("gap_patterns")) if "gap_patterns" in load else None
    ny, nx = tile.shape

    def where(i: int) -> str:
        return f"{load.meta['y_dim']}={tile.y0 + i // nx}, {load.meta['x_dim']}={tile.x0 + i % nx}"

    out = solve_block(B, op, config, own_w, ctx.memory_budget, gaps, where)
    out.arrays = {k: v.reshape(*v.shape[:-1], ny, nx) for k, v in out.arrays.items()}
    return out


def pixel_bytes(prepared: Mapping[str, Any]) -> int:
    """Memory one pixel of a tile holds here: its series, mask, weights and results."""
    n_obs, coef = int(prepared["obs"]), int(prepared["coef"])
    # uncertainty: float64 moments and the stored results (stderr, t, p; the covariance)
    extra = {"none": 0, "stderr": 6 * coef + 12, "cov": 6 * coef + 12 + 2 * coef * coef}
    return n_obs * (8 + 8 + 1) + 8 * (coef + 2) + 8 * extra[prepared.get("uncertainty", "none")]


register(
    StageDecl(
        kind="solve",
        impl="lstsq",
        version=VERSION,
        config=LstsqSolve,
        run=run_tile,
        prepare=prepare,
        tiled=True,
        inputs=("load", "design", "normal_equations"),
        outputs=TILE_OUTPUTS,
        pixel_bytes=pixel_bytes,
        counts="status_counts",
        summary="least squares per pixel: shared operator, gap patterns, per-pixel Cholesky",
    )
)
