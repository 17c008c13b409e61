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

from collections.abc import Mapping

import numpy as np

from gridsolve.schemas.artifacts import Tile
from gridsolve.schemas.errors import NumericalError
from gridsolve.schemas.kinds.solve import LstsqSolve
from gridsolve.schemas.metadata import LoadMeta
from gridsolve.stages.engine.blocks import read_block
from gridsolve.stages.engine.context import StageContext
from gridsolve.stages.engine.store import Artifact, StageOutput
from gridsolve.stages.solve.block import solve_block
from gridsolve.stages.solve.prepared import FLOAT32_RANGE, STAGE, SharedOperator, make_operator


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
