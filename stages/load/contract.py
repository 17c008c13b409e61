"""The ``load`` contract: a checked description of the cube, its coordinates, its content hash."""

from __future__ import annotations

from typing import Any

from gridsolve.schemas.contracts import ArraySpec
from gridsolve.stages.engine.contract import KindContract, Meta, PartContract, add


class LoadMeta(Meta):
    """What every later stage may read from the load stage's metadata."""

    variable: str
    dims: list[str]
    obs_dim: str
    y_dim: str
    x_dim: str
    n_obs: int
    ny: int
    nx: int
    dtype: str
    aux: dict[str, Any]
    content_hash: str


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
