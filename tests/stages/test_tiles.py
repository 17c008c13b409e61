"""Tile plans cover the grid exactly once, within budget, aligned to output chunks."""

from __future__ import annotations

import numpy as np
import pytest

from gridsolve.stages.engine.tiles import plan_tiles


@pytest.mark.parametrize(
    ("ny", "nx", "budget", "align"),
    [
        (9, 10, 40, (3, 5)),
        (500, 500, 131072, (128, 256)),
        (7, 3, 1, (128, 256)),
        (300, 2000, 50_000, (128, 256)),
        (1, 1, 10, (128, 256)),
        (1000, 37, 10_000, (64, 64)),
    ],
)
def test_tiles_cover_once_within_budget(
    ny: int, nx: int, budget: int, align: tuple[int, int]
) -> None:
    tiles = plan_tiles(ny, nx, budget, *align)
    seen = np.zeros((ny, nx), int)
    for i, t in enumerate(tiles):
        assert t.index == i
        seen[t.y0 : t.y1, t.x0 : t.x1] += 1
        assert t.pixels <= max(budget, 1)
    assert (seen == 1).all()


def test_tiles_align_to_chunks_when_the_budget_allows() -> None:
    tiles = plan_tiles(500, 500, 131072, 128, 256)
    assert all(t.y0 % 128 == 0 and t.x0 % 256 == 0 for t in tiles)
    assert [t.shape for t in tiles] == [(256, 500), (244, 500)]
