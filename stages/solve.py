"""The ``solve`` stage: coefficients and diagnostics at every pixel, tile by tile.

Once per stage (``prepare``) the shared design's operator ``P`` is built from
the float64 SVD of the normal-equations stage, for the chosen policy; a
design that the policy cannot solve (``cholesky`` on a rank-deficient design)
or that float32 cannot resolve is refused here, before any tile runs.

Per tile, pixels are grouped by their pattern of valid observations:

* every pixel whose observations are all valid uses ``P``: one matrix product;
* a gap pattern shared by at least :data:`GROUP_MIN` pixels (a missing time
  step across the grid) gets its own SVD operator: one more matrix product;
* the other pixels (clouds: nearly every pixel its own pattern) and pixels
  with their own weights are solved with per-pixel normal equations in float64
  (see :mod:`stages.linalg`).

Pixels with no valid observation, or fewer than ``min_valid``, get NaN
coefficients and a status code; so do those a policy cannot solve.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from schemas.artifacts import Tile
from schemas.config import LstsqSolve
from schemas.contracts import STATUS_FLAGS, ArraySpec
from schemas.errors import NumericalError
from stages import linalg
from stages.context import StageContext, chunk_size, resolve_device
from stages.load import read_block
from stages.registry import StageDecl, register
from stages.store import Artifact, StageOutput

VERSION = "1"
STAGE = "solve/lstsq"

#: Pixels that must share a gap pattern before it gets its own factorisation.
GROUP_MIN = 32
#: Above this condition number a float32 solve loses more than ~0.1% (measured
#: in tests/stages/test_solve.py); refuse it and ask for float64.
FLOAT32_MAX_COND = 1e4

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


def prepare(config: LstsqSolve, inputs: Mapping[str, Artifact], ctx: StageContext) -> StageOutput:
    """The shared operator (sqrt-weights folded in), after refusing unsolvable setups."""
    ne, design = inputs["normal_equations"], inputs["design"]
    A = np.asarray(design.array("A"))
    n_obs, coef = A.shape
    sqrtw = np.asarray(ne.array("sqrtw"))
    svd = (np.asarray(ne.array("U")), np.asarray(ne.array("s")), np.asarray(ne.array("Vt")))
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
            found=f"rank {op.rank}, condition number {ne.meta['cond']:.3g}",
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
    return StageOutput(
        arrays={"P": op.P * sqrtw[None, :], "A": A, "sqrtw": sqrtw},
        meta={
            "rank": op.rank,
            "cond": op.cond,
            "method": op.method,
            "min_valid": min_valid_of(config, coef),
            "coef": coef,
            "obs": n_obs,
        },
    )


def _groups(valid: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Pixels grouped by valid-observation pattern: (patterns, order, starts, counts)."""
    packed = np.ascontiguousarray(np.packbits(valid, axis=0).T)
    keys = packed.view(np.dtype((np.void, packed.shape[1]))).ravel()
    uniq, inverse, counts = np.unique(keys, return_inverse=True, return_counts=True)
    order = np.argsort(inverse, kind="stable")
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    patterns = np.unpackbits(uniq.view(np.uint8).reshape(len(uniq), -1), axis=1)[
        :, : valid.shape[0]
    ]
    return patterns.astype(bool), order, starts, counts


def run_tile(
    config: LstsqSolve,
    inputs: Mapping[str, Artifact],
    prepared: Artifact,
    tile: Tile,
    ctx: StageContext,
) -> StageOutput:
    """Coefficients, residual RMS, valid counts and status of one tile."""
    load = inputs["load"]
    A = np.array(prepared.array("A"))
    sqrtw = np.array(prepared.array("sqrtw"))
    n_obs, coef = A.shape
    dtype = np.dtype(config.dtype)
    device = resolve_device(config.device)
    pol = policy_of(config)
    min_valid = int(prepared.meta["min_valid"])

    B = read_block(load.meta, "cube", tile).reshape(n_obs, -1)
    n_px = B.shape[1]
    weights_info = load.meta["aux"].get("weights")
    own_w = None
    if weights_info is not None and not weights_info["shared"]:
        own_w = read_block(load.meta, "weights", tile).reshape(n_obs, -1).astype(np.float64)
        valid = np.isfinite(B) & (own_w > 0)
    else:
        valid = np.isfinite(B) & (sqrtw > 0)[:, None]
    n_valid = valid.sum(axis=0).astype(np.int32)

    C = np.full((coef, n_px), np.nan, dtype=dtype)
    rms = np.full(n_px, np.nan, dtype=dtype)
    status = np.zeros(n_px, dtype=np.int8)
    status[n_valid == 0] = linalg.ALL_MISSING
    status[(n_valid > 0) & (n_valid < min_valid)] = linalg.TOO_FEW
    solvable = n_valid >= min_valid
    paths = {"shared": 0, "pattern": 0, "per_pixel": 0}

    per_pixel = np.zeros(n_px, dtype=bool)
    if own_w is not None:
        per_pixel = solvable
    else:
        full = sqrtw > 0
        patterns, order, starts, counts = _groups(valid)
        for g in range(len(counts)):
            idx = order[starts[g] : starts[g] + counts[g]]
            if not solvable[idx[0]]:
                continue
            rows = patterns[g]
            if np.array_equal(rows, full):
                P, st, cond = (
                    np.array(prepared.array("P")),
                    linalg.OK,
                    float(prepared.meta["cond"]),
                )
                rows = np.ones(n_obs, dtype=bool)
                paths["shared"] += len(idx)
            elif counts[g] >= GROUP_MIN:
                op = linalg.svd_operator(A[rows] * sqrtw[rows, None], pol)
                P, st, cond = op.P * sqrtw[rows][None, :], op.status, op.cond
                paths["pattern"] += len(idx)
            else:
                per_pixel[idx] = True
                continue
            gdtype = dtype if cond <= FLOAT32_MAX_COND else np.dtype(np.float64)
            Bg = B[np.ix_(rows, idx)]
            if not np.isfinite(Bg).all():  # zero-weight rows may hold NaN
                Bg = np.where(valid[np.ix_(rows, idx)], Bg, 0)
            Pt = torch.from_numpy(np.ascontiguousarray(P, dtype=gdtype)).to(device)
            Bt = torch.from_numpy(np.ascontiguousarray(Bg, dtype=gdtype)).to(device)
            Ct = linalg.colmm(Pt, Bt)
            At = torch.from_numpy(np.ascontiguousarray(A[rows], dtype=gdtype)).to(device)
            R = Bt - linalg.colmm(At, Ct)
            C[:, idx] = Ct.cpu().numpy()
            rms[idx] = torch.sqrt(linalg.stable_sum(R * R) / R.shape[0]).cpu().numpy()
            status[idx] = st

    todo = np.flatnonzero(per_pixel)
    paths["per_pixel"] = len(todo)
    if len(todo):
        big = max(coef, n_obs) if (config.policy != "cholesky" and coef > n_obs) else coef
        per_px_bytes = 8 * (3 * big * big + 8 * n_obs + 6 * coef)
        chunk = config.chunk_pixels or min(8192, chunk_size(ctx.memory_budget // 4, per_px_bytes))
        At = torch.from_numpy(A).to(device)
        w_shared = torch.from_numpy(sqrtw**2).to(device)[:, None]
        for start in range(0, len(todo), chunk):
            sel = todo[start : start + chunk]
            Vt_ = torch.from_numpy(valid[:, sel]).to(device)
            Bt = torch.from_numpy(np.asarray(B[:, sel], dtype=np.float64)).to(device)
            B0 = torch.where(Vt_, Bt, torch.zeros((), dtype=torch.float64, device=device))
            if own_w is not None:
                Wp: torch.Tensor = torch.from_numpy(own_w[:, sel]).to(device) * Vt_
            else:
                Wp = w_shared * Vt_
            x, px_status = linalg.solve_per_pixel(At, B0, Wp, pol)
            R = torch.where(
                Vt_, B0 - linalg.colmm(At, x), torch.zeros((), dtype=torch.float64, device=device)
            )
            C[:, sel] = x.cpu().numpy().astype(dtype)
            n_v = torch.from_numpy(n_valid[sel].astype(np.float64)).to(device)
            rms[sel] = torch.sqrt(linalg.stable_sum(R * R) / n_v).cpu().numpy().astype(dtype)
            status[sel] = px_status.cpu().numpy()
        rms[todo[status[todo] == linalg.SINGULAR]] = np.nan

    ny, nx = tile.shape
    counts_by_status = {
        STATUS_FLAGS[int(k)]: int(v)
        for k, v in zip(*np.unique(status, return_counts=True), strict=True)
    }
    return StageOutput(
        arrays={
            "coefficients": C.reshape(coef, ny, nx),
            "residual_rms": rms.reshape(ny, nx),
            "n_valid": n_valid.reshape(ny, nx),
            "status": status.reshape(ny, nx),
        },
        meta={"status_counts": counts_by_status, "paths": paths},
    )


def tile_bytes_per_pixel(load_meta: Mapping[str, Any], coef: int, config: LstsqSolve) -> int:
    """Rough memory one pixel of a tile takes in this stage (inputs, outputs, masks)."""
    n_obs = int(load_meta["n_obs"])
    return 8 * n_obs * 2 + n_obs + np.dtype(config.dtype).itemsize * (coef + 1) + 8


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
