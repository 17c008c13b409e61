"""References to stored artifacts: the only things that cross task boundaries.

A stage's output lives in the content-addressed store under its key; tasks
(threads, Dask workers, Prefect's result records) pass these small references,
never the arrays.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class Tile(BaseModel):
    """A rectangular block of the grid: rows ``y0:y1``, columns ``x0:x1``."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    index: int = Field(ge=0)
    y0: int = Field(ge=0)
    y1: int = Field(ge=1)
    x0: int = Field(ge=0)
    x1: int = Field(ge=1)

    @property
    def shape(self) -> tuple[int, int]:
        """(rows, columns) of the tile."""
        return (self.y1 - self.y0, self.x1 - self.x0)

    @property
    def pixels(self) -> int:
        """Number of pixels in the tile."""
        return (self.y1 - self.y0) * (self.x1 - self.x0)

    def bounds(self) -> tuple[int, int, int, int]:
        """(y0, y1, x0, x1): what identifies the tile in cache keys."""
        return (self.y0, self.y1, self.x0, self.x1)


class ArtifactRef(BaseModel):
    """Where one stored artifact is: its store, its key, and a copy of its small metadata."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: str
    impl: str
    key: str = Field(pattern=r"^[0-9a-f]{32}$")
    root: str
    tile: Tile | None = None
    meta: dict[str, Any] = Field(default_factory=dict)


class StageRun(BaseModel):
    """What running (or reusing) one stage or tile produced."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    ref: ArtifactRef
    hit: bool
    seconds: float
    pixels: int = 0
    #: seconds per phase of the runner (``stages/engine/timing.py``): key, setup, read, …
    phases: dict[str, float] = Field(default_factory=dict)


class TiledRef(BaseModel):
    """A tiled stage's output: the stage key, its once-per-stage part, and one ref per tile."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: str
    impl: str
    key: str
    prepared: ArtifactRef
    tiles: tuple[ArtifactRef, ...]
