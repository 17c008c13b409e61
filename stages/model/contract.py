"""The ``model`` contract: a single-sample model's outputs and per-sample gradients per pixel."""

from __future__ import annotations

from gridsolve.schemas.contracts import ArraySpec
from gridsolve.stages.engine.contract import KindContract, Meta, PartContract, add
from gridsolve.stages.model import outputs


class ModelPrepared(Meta):
    """What the tiles, the tile plan and the writer read about the model."""

    params: dict[str, list[int]]
    input_shape: list[int]
    n_out: int
    dtype: str
    wrt: str
    jacobian: bool


class ModelTile(Meta):
    """Per-tile counts of each model status (summed for the run summary)."""

    model_status_counts: dict[str, int]


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
