"""Cutting the grid into tiles that fit a memory budget.

Tiles are blocks of whole output chunks (so every NetCDF chunk is written
once), full-width row bands when one band of chunk rows fits the budget,
else narrower blocks. The tile size never changes results, only which
per-tile cache entries exist.
"""

from __future__ import annotations

from gridsolve.schemas.artifacts import Tile


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
