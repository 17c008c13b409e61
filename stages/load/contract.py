"""The ``load`` contract: a checked description of the cube, its coordinates, its content hash."""

from __future__ import annotations

from gridsolve.schemas.contracts import ArraySpec
from gridsolve.schemas.metadata import LoadMeta
from gridsolve.stages.engine.contract import KindContract, PartContract, add

CONTRACT = add(
    KindContract(
        kind="load",
        tiled=False,
        parts={
            "whole": PartContract(
                arrays={
                    "obs": ArraySpec(("obs",), "fiuMmUSO", "obs coordinate values"),
                    "y": ArraySpec(("y",), "fiuMmUSO", "y coordinate values"),
                    "x": ArraySpec(("x",), "fiuMmUSO", "x coordinate values"),
                },
                meta=LoadMeta,
            )
        },
        summary="the cube's description, coordinates and content hash",
    )
)
