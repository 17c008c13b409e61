"""The ``model`` contract: a single-sample model's outputs and per-sample gradients per pixel."""

from __future__ import annotations

from gridsolve.schemas.contracts import ArraySpec
from gridsolve.schemas.metadata import ModelPrepared, ModelTile
from gridsolve.stages.engine.contract import KindContract, PartContract, add
from gridsolve.stages.model import outputs

CONTRACT = add(
    KindContract(
        kind="model",
        tiled=True,
        parts={
            "prepare": PartContract(meta=ModelPrepared),
            "tile": PartContract(
                arrays={
                    "prediction": ArraySpec(("output", "y", "x"), "f", "model outputs"),
                    "model_status": ArraySpec(("y", "x"), "iu", "model status flag"),
                },
                meta=ModelTile,
            ),
        },
        variables=outputs.variables,
        summary="per-sample outputs and gradients of a single-sample model",
    )
)
