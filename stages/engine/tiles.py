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


def plan_tiles(ny: int, nx: int, max_pixels: int, align_y: int, align_x: int) -> list[Tile]:
    """Tiles covering ``ny × nx`` with at most ``max_pixels`` each where alignment allows."""
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


def bytes_per_pixel(load_meta: Mapping[str, Any], coef: int, model_meta: Mapping[str, Any]) -> int:
    """Memory one pixel of a tile holds at the heaviest stage (inputs plus outputs)."""
    n_obs = int(load_meta["n_obs"])
    solve = n_obs * (8 + 8 + 1) + 8 * (coef + 2)
    item = np.dtype(model_meta["dtype"]).itemsize
    n_out = int(model_meta["n_out"])
    n_in = int(np.prod(model_meta["input_shape"]))
    n_par = sum(int(np.prod(s)) for s in model_meta["params"].values())
    wrt = model_meta["wrt"]
    grads = (n_par if wrt in ("params", "both") else 0) + (n_in if wrt in ("input", "both") else 0)
    model = (
        item * (n_in + n_out + grads * (1 + (n_out if model_meta["jacobian"] else 0))) + 8 * coef
    )
    return int(max(solve, model))


def tiles_for(
    load_meta: Mapping[str, Any],
    coef: int,
    model_meta: Mapping[str, Any],
    memory_budget: int,
    tile_pixels: int | None,
    align: tuple[int, int],
) -> list[Tile]:
    """The tile plan of a run: half the budget for the tile's arrays, half for working sets."""
    ny, nx = int(load_meta["ny"]), int(load_meta["nx"])
    max_px = tile_pixels or max(
        1, (memory_budget // 2) // bytes_per_pixel(load_meta, coef, model_meta)
    )
    return plan_tiles(ny, nx, max_px, *align)
