"""The ``solve`` contract: coefficients and diagnostics at every pixel, tile by tile."""

from __future__ import annotations

from gridsolve.schemas.contracts import ArraySpec
from gridsolve.schemas.metadata import SolvePrepared, SolveTile
from gridsolve.stages.engine.contract import KindContract, PartContract, add
from gridsolve.stages.solve import outputs

CONTRACT = add(
    KindContract(
        kind="solve",
        tiled=True,
        parts={
            "prepare": PartContract(meta=SolvePrepared),
            "tile": PartContract(
                # what every solve makes; an implementation's own (lstsq's coefficients,
                # curvefit's params) are in its StageDecl.outputs
                arrays={
                    "residual_rms": ArraySpec(("y", "x"), "f", "RMS of the residuals"),
                    "n_valid": ArraySpec(("y", "x"), "iu", "valid observations used"),
                    "status": ArraySpec(("y", "x"), "iu", "solve status flag"),
                },
                meta=SolveTile,
            ),
        },
        variables=outputs.variables,
        summary="least squares at every pixel",
    )
)
