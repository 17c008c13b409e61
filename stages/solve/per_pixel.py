"""The per-pixel path: pixels no shared operator takes, each by its own normal equations.

In batches sized to the memory budget, float64 (see :mod:`stages.solve.linalg`);
with uncertainty, each pixel's spread and moments too.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from gridsolve.stages.engine.context import chunk_size, work_share
from gridsolve.stages.solve import kernel, linalg
from gridsolve.stages.solve.block_state import _Block, _Gappy
from gridsolve.stages.solve.columns import colmm, colmm_sub, column_rms, residual_moments
from gridsolve.stages.solve.dual import gapwise_dual
from gridsolve.stages.solve.policy import SINGULAR, UNDERDETERMINED
from gridsolve.stages.solve.spread import Spread, spread_bytes


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
