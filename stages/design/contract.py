"""The ``design`` contract: the design matrix shared by every pixel, float64."""

from __future__ import annotations

from gridsolve.schemas.contracts import ArraySpec
from gridsolve.schemas.metadata import DesignMeta
from gridsolve.stages.engine.contract import KindContract, PartContract, add

CONTRACT = add(
    KindContract(
        kind="design",
        tiled=False,
        parts={
            "whole": PartContract(
                arrays={"A": ArraySpec(("obs", "coef"), "f", "design matrix, float64")},
                meta=DesignMeta,
            )
        },
        summary="the design matrix A (obs × coef)",
    )
)
