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
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np
import torch

from gridsolve.schemas.artifacts import Tile
from gridsolve.schemas.config import LstsqSolve
from gridsolve.schemas.contracts import STATUS_FLAGS, ArraySpec
from gridsolve.schemas.errors import ContractError, NumericalError
from gridsolve.stages.engine.context import StageContext, chunk_size, resolve_device
from gridsolve.stages.engine.registry import StageDecl, register
from gridsolve.stages.engine.store import Artifact, StageOutput
from gridsolve.stages.load import patterns
from gridsolve.stages.load.netcdf import read_block
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
) -> tuple[np.ndarray, np.ndarray]:
    """Coefficients ``P @ B`` and residual RMS of finite columns sharing one operator.

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
        for cols, cdtype in ((~wide, dtype), (wide, np.dtype(np.float64))):
            if cols.any():
                C[:, cols], rms[cols] = _fit(B[:, cols], P, A, Q, cdtype, device)
    else:
        C, rms = _fit(B, P, A, Q, dtype, device)
    limit = float(np.finfo(store or dtype).max)
    # |c| ≤ ‖P‖∞ · max |b|: only near the limit is the (full) pass over C needed.
    if P.size and top * float(np.abs(P).sum(axis=1).max()) >= 0.5 * limit:
        with np.errstate(invalid="ignore"):
            rms[~(np.abs(C) <= limit).all(axis=0)] = np.inf
    return C, rms


def _fit(
    B: np.ndarray,
    P: np.ndarray,
    A: np.ndarray,
    Q: np.ndarray | None,
    dtype: np.dtype,
    device: torch.device,
) -> tuple[np.ndarray, np.ndarray]:
    Bt = torch.from_numpy(np.ascontiguousarray(B, dtype=dtype)).to(device)
    Ct = linalg.colmm(torch.from_numpy(np.ascontiguousarray(P, dtype=dtype)).to(device), Bt)
    if Q is not None:
        R = linalg.colmm(torch.from_numpy(np.ascontiguousarray(Q, dtype=dtype)).to(device), Bt)
    else:
        At = torch.from_numpy(np.ascontiguousarray(A, dtype=dtype)).to(device)
        R = Bt - linalg.colmm(At, Ct)
    rms = linalg.column_rms(R, B.shape[0])
    return Ct.cpu().numpy(), rms.cpu().numpy()


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

    status = np.zeros(n_px, dtype=np.int8)
    finite = np.isfinite(B)
    if own_weights is None and (sqrtw > 0).all() and finite.all():
        # No gaps: every pixel uses the shared operator; no grouping, no copies.
        seconds["mask"] = time.perf_counter() - clock
        t0 = time.perf_counter()
        C, rms = _fit_columns(B, op.P, A, op.Q, dtype, device, data_max=op.data_max)
        paths["shared"] = n_px
        seconds["shared"] = time.perf_counter() - t0
        return StageOutput(
            arrays={
                "coefficients": C,
                "residual_rms": rms,
                "n_valid": np.full(n_px, n_obs, dtype=np.int32),
                "status": status,
            },
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
            if k == full_h:
                # P's columns of zero-weight observations are zero: drop them.
                P, Q, st, cond = op.P[:, rows], op.Q if rows.all() else None, linalg.OK, op.cond
                path = "shared"
            else:
                g_op = linalg.svd_operator(A[rows] * sqrtw[rows, None], pol)
                P, Q, st, cond = g_op.P * sqrtw[rows][None, :], None, g_op.status, g_op.cond
                path = "pattern"
            gdtype = dtype if cond <= FLOAT32_MAX_COND else np.dtype(np.float64)
            C[:, idx], rms[idx] = _fit_columns(
                B[np.ix_(rows, idx)], P, A[rows], Q, gdtype, device, dtype, op.data_max
            )
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
            x, px_status = linalg.solve_per_pixel(At, B0, Wp, pol, active=act)
            R = (B0 - linalg.colmm(At, x)).mul_(Vt_)
            n_v = torch.from_numpy(n_valid[sel].astype(np.float64)).to(device)
            r = linalg.column_rms(R, n_v).cpu().numpy()
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
    return StageOutput(
        arrays={"coefficients": C, "residual_rms": rms, "n_valid": n_valid, "status": status},
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
    B = read_block(load.meta, "cube", tile).reshape(n_obs, -1)
    weights_info = load.meta["aux"].get("weights")
    own_w = None
    if weights_info is not None and not weights_info["shared"]:
        own_w = read_block(load.meta, "weights", tile).reshape(n_obs, -1).astype(np.float64)
    gaps = np.array(load.array("gap_patterns")) if "gap_patterns" in load else None
    ny, nx = tile.shape

    def where(i: int) -> str:
        return f"{load.meta['y_dim']}={tile.y0 + i // nx}, {load.meta['x_dim']}={tile.x0 + i % nx}"

    out = solve_block(B, op, config, own_w, ctx.memory_budget, gaps, where)
    out.arrays = {k: v.reshape(*v.shape[:-1], ny, nx) for k, v in out.arrays.items()}
    return out


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
        summary="least squares per pixel: shared operator, gap patterns, per-pixel Cholesky",
    )
)
