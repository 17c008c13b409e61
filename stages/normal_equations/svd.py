"""The ``normal_equations`` stage: the shared part of every pixel's least-squares problem.

For the shared design (and shared weights ``w``, if any) it stores, in float64,
the Gram matrix ``AᵀWA`` and the thin SVD of ``W^½A``. The SVD, not ``AᵀA``,
is what the solve stage factors: it keeps the design's own condition number
instead of squaring it, and it gives the rank used by the minimum-norm policy.

Per-pixel normal equations ``Aᵀ W_p A`` (pixels with missing data or their
own weights) are never stored: they need ``coef²`` numbers per pixel, so the
solve stage forms and factors them chunk by chunk.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from gridsolve.schemas.kinds.normal_equations import NoNormalEquations, SVDNormalEquations
from gridsolve.stages.design.builtin import conditioning
from gridsolve.stages.engine.context import StageContext
from gridsolve.stages.engine.registry import StageDecl, register, register_none
from gridsolve.stages.engine.store import Artifact, StageOutput

VERSION = "1"


def run(
    config: SVDNormalEquations, inputs: Mapping[str, Artifact], ctx: StageContext
) -> StageOutput:
    """Gram matrix and SVD of the (weighted) shared design."""
    A = np.asarray(inputs["design"].array("A"), dtype=np.float64)
    load = inputs["load"]
    sqrtw = (
        np.sqrt(np.asarray(load.array("weights"), dtype=np.float64))
        if "weights" in load
        else np.ones(A.shape[0])
    )
    Aw = A * sqrtw[:, None]
    U, s, Vt = np.linalg.svd(Aw, full_matrices=False)
    return StageOutput(
        arrays={"U": U, "s": s, "Vt": Vt, "sqrtw": sqrtw},
        meta={"weighted": "weights" in load, **conditioning(Aw)},
    )


register(
    StageDecl(
        kind="normal_equations",
        impl="svd",
        version=VERSION,
        config=SVDNormalEquations,
        run=run,
        inputs=("design", "load"),
        summary="float64 SVD of the (weighted) shared design",
    )
)


register_none(
    "normal_equations",
    NoNormalEquations,
    VERSION,
    "no normal equations: the solve needs none (solve impl curvefit)",
)
