"""Solving one block of pixels: the shared operator, gap patterns, then the per-pixel path.

:func:`solve_block` groups the pixels by their pattern of valid observations (see
:mod:`stages.solve.lstsq`), solves each group by the path that fits it, and refuses
solved pixels whose results do not fit the stored dtype.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from gridsolve.schemas.contracts import STATUS_FLAGS, flag_counts
from gridsolve.schemas.errors import NumericalError
from gridsolve.schemas.kinds.solve import LstsqSolve
from gridsolve.stages.engine.store import StageOutput, native_order
from gridsolve.stages.load import patterns
from gridsolve.stages.solve.block_state import _Block, _Gappy
from gridsolve.stages.solve.operator_fit import _fit_columns
from gridsolve.stages.solve.per_pixel import _solve_per_pixel
from gridsolve.stages.solve.policy import (
    ALL_MISSING,
    OK,
    REFINE_COND,
    SINGULAR,
    SOLVED,
    TOO_FEW,
    UNDERDETERMINED,
)
from gridsolve.stages.solve.prepared import FLOAT32_MAX_COND, STAGE, SharedOperator
from gridsolve.stages.solve.shared_operator import operator_spread, spans_constant, svd_operator
from gridsolve.stages.solve.uncertainty import _shared_spread


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
