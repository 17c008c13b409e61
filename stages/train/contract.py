"""The ``train`` contract: fitted weights of the model's module and the loss per epoch."""

from __future__ import annotations

from typing import Any

from gridsolve.schemas.contracts import ArraySpec
from gridsolve.stages.engine.contract import KindContract, Meta, PartContract, add
from gridsolve.stages.train import outputs


class TrainMeta(Meta):
    """What the model stage, the writer and the run summary read about a training run."""

    epochs_run: int
    steps: int
    params: dict[str, list[int]]
    counts: dict[str, int]
    history: list[dict[str, Any]]
    epsilon: float | None
    delta: float
    best_epoch: int | None
    weights_epoch: int
    weights_from: str


CONTRACT = add(
    KindContract(
        kind="train",
        tiled=False,
        parts={
            "whole": PartContract(
                arrays={
                    "train_loss": ArraySpec(
                        ("epoch",), "f", "mean loss of the training pixels after each epoch"
                    ),
                    "val_loss": ArraySpec(
                        ("epoch",), "f", "mean loss of the validation pixels after each epoch"
                    ),
                    "grad_norm": ArraySpec(
                        ("y", "x"), "f", "per-pixel gradient norm at the trained weights"
                    ),
                },
                meta=TrainMeta,
            )
        },
        extends=outputs.extends,
        summary="the model's weights fitted to the target over pixels (per-sample gradients)",
    )
)
