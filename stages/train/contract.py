"""The ``train`` contract: fitted weights of the model's module and the loss per epoch."""

from __future__ import annotations

from gridsolve.schemas.contracts import ArraySpec
from gridsolve.schemas.metadata import TrainMeta
from gridsolve.stages.engine.contract import KindContract, PartContract, add
from gridsolve.stages.train import outputs

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
