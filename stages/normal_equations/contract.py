"""The ``normal_equations`` contract: the float64 SVD of the (weighted) shared design."""

from __future__ import annotations

from gridsolve.schemas.contracts import ArraySpec
from gridsolve.schemas.metadata import NormalEquationsMeta
from gridsolve.stages.engine.contract import KindContract, PartContract, add

CONTRACT = add(
    KindContract(
        kind="normal_equations",
        tiled=False,
        parts={
            "whole": PartContract(
                arrays={
                    "U": ArraySpec(("obs", "k"), "f", "left singular vectors"),
                    "s": ArraySpec(("k",), "f", "singular values"),
                    "Vt": ArraySpec(("k", "coef"), "f", "right singular vectors"),
                    "sqrtw": ArraySpec(("obs",), "f", "square roots of the shared weights"),
                },
                meta=NormalEquationsMeta,
            )
        },
        summary="float64 factorisation of the shared design",
    )
)
