"""The ``load`` contract: a checked description of the cube, its coordinates, its content hash."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
from pydantic import Field

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
    #: batch dims besides y and x (member, level, …) and their sizes, folded into the
    #: grid's rows ahead of y (see :func:`grid_shape`)
    lead_dims: list[str] = Field(default_factory=list)
    lead_shape: list[int] = Field(default_factory=list)
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


def grid_shape(meta: Mapping[str, Any]) -> tuple[int, int]:
    """(rows, columns) of the grid tiled stages see: the batch dims and y folded into rows."""
    planes = int(np.prod(meta.get("lead_shape") or [], dtype=np.int64))
    return planes * int(meta["ny"]), int(meta["nx"])


def pixel_name(meta: Mapping[str, Any], row: int, col: int) -> str:
    """The cube's own coordinates of grid position (row, col), e.g. ``member=1, lat=3, lon=4``."""
    plane, y = divmod(row, int(meta["ny"]))
    lead = list(meta.get("lead_dims") or [])
    index = np.unravel_index(plane, tuple(meta.get("lead_shape") or ())) if lead else ()
    parts = [f"{d}={int(i)}" for d, i in zip(lead, index, strict=True)]
    return ", ".join([*parts, f"{meta['y_dim']}={y}", f"{meta['x_dim']}={col}"])
