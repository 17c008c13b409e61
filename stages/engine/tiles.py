"""Cutting the grid into tiles that fit a memory budget.

Tiles are blocks of whole output chunks (so every NetCDF chunk is written
once), full-width row bands when one band of chunk rows fits the budget,
else narrower blocks. The tile size never changes results, only which
per-tile cache entries exist.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from gridsolve.schemas.artifacts import Tile
from gridsolve.schemas.errors import StageError


def plan_tiles(
    ny: int, nx: int, max_pixels: int, align_y: int, align_x: int, plane_rows: int | None = None
) -> list[Tile]:
    """Tiles covering ``ny × nx`` with at most ``max_pixels`` each where alignment allows.

    With ``plane_rows``, the rows are planes of that many rows stacked (a cube's
    batch dims folded into y), and no tile spans two planes.
    """
    if plane_rows is not None and plane_rows < ny:
        stacked: list[Tile] = []
        for p0 in range(0, ny, plane_rows):
            for t in plan_tiles(min(plane_rows, ny - p0), nx, max_pixels, align_y, align_x):
                stacked.append(
                    Tile(index=len(stacked), y0=p0 + t.y0, y1=p0 + t.y1, x0=t.x0, x1=t.x1)
                )
        return stacked
    align_y = max(1, min(align_y, ny))
    align_x = max(1, min(align_x, nx))
    max_pixels = max(1, max_pixels)
    if ny * nx <= max_pixels:
        rows, cols = ny, nx
    elif align_y * nx <= max_pixels:
        rows, cols = (max_pixels // nx) // align_y * align_y, nx
    elif align_y * align_x <= max_pixels:
        rows, cols = align_y, (max_pixels // align_y) // align_x * align_x
    else:
        # One output chunk is over the budget: stay within the budget and let
        # HDF5 assemble chunks from several tiles (slower writes, same file).
        cols = min(nx, align_x, max_pixels)
        rows = max(1, min(align_y, max_pixels // cols))
    tiles: list[Tile] = []
    for y0 in range(0, ny, rows):
        for x0 in range(0, nx, cols):
            tiles.append(
                Tile(index=len(tiles), y0=y0, y1=min(ny, y0 + rows), x0=x0, x1=min(nx, x0 + cols))
            )
    return tiles


def plane_window(meta: Mapping[str, Any], tile: Tile) -> dict[str, Any]:
    """The ``.isel`` window of ``tile`` in the cube's own dims.

    The grid's rows are the cube's batch dims (member, level, …) and y folded
    together, in C order: row ``r`` is y ``r % ny`` of plane ``r // ny``. A tile
    never spans two planes (the load implementation's ``grid``), so its window is one hyperslab.
    """
    ny = int(meta["ny"])
    plane, r0 = divmod(tile.y0, ny)
    if r0 + (tile.y1 - tile.y0) > ny:
        raise StageError(
            f"tile rows {tile.y0}:{tile.y1} span two planes of {ny} rows",
            stage="load",
            fix="plan tiles with the load stage's grid (its plane rows)",
        )
    lead = list(meta.get("lead_dims") or [])
    index = np.unravel_index(plane, tuple(meta.get("lead_shape") or ())) if lead else ()
    window: dict[str, Any] = {d: int(i) for d, i in zip(lead, index, strict=True)}
    window[meta["y_dim"]] = slice(r0, r0 + tile.y1 - tile.y0)
    window[meta["x_dim"]] = slice(tile.x0, tile.x1)
    return window
