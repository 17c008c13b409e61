"""The ``solve/lstsq`` declaration: registered without importing its code (torch).

The implementation is ``stages/solve/lstsq.py``, imported on the first solve that
runs (see :class:`gridsolve.stages.engine.registry.Lazy`); what the plan and the
cache need before that (the contract, a pixel's memory) lives here.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gridsolve.schemas.contracts import ArraySpec
from gridsolve.schemas.kinds.solve import LstsqSolve
from gridsolve.schemas.metadata import SolvePrepared
from gridsolve.stages.engine.registry import Lazy, StageDecl, register

VERSION = "2"

TILE_OUTPUTS = {
    "coefficients": ArraySpec(("coef", "y", "x"), "f"),
    "residual_rms": ArraySpec(("y", "x"), "f"),
    "n_valid": ArraySpec(("y", "x"), "i"),
    "status": ArraySpec(("y", "x"), "i"),
}


def pixel_bytes(prepared: Mapping[str, Any]) -> int:
    """Memory one pixel of a tile holds here: its series, mask, weights and results."""
    meta = SolvePrepared.of(prepared)
    n_obs, coef = meta.obs, meta.coef
    # uncertainty: float64 moments and the stored results (stderr; the covariance); t and
    # p are the writer's
    extra = {"none": 0, "stderr": 5 * coef + 12, "cov": 5 * coef + 12 + 2 * coef * coef}
    # + coef: the undetermined-coefficient mask of a tile with underdetermined pixels
    return n_obs * (8 + 8 + 1) + 9 * coef + 16 + 8 * extra[meta.uncertainty]


register(
    StageDecl(
        kind="solve",
        impl="lstsq",
        version=VERSION,
        config=LstsqSolve,
        run=Lazy("gridsolve.stages.solve.lstsq:run_tile"),
        prepare=Lazy("gridsolve.stages.solve.lstsq:prepare"),
        tiled=True,
        inputs=("load", "design", "normal_equations"),
        outputs=TILE_OUTPUTS,
        pixel_bytes=pixel_bytes,
        counts="status_counts",
        summary="least squares per pixel: shared operator, gap patterns, per-pixel Cholesky",
    )
)
