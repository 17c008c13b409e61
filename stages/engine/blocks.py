"""Reading one tile of an input through the interface of the stage that describes it.

Tiled stages never open files themselves: they ask the artifact of their
input (the load stage's) for a block, and the implementation that made that
artifact reads it, from NetCDF, Zarr or wherever it keeps the data
(``StageDecl.read_block``). A new load implementation therefore serves every
solve and model implementation unchanged.
"""

from __future__ import annotations

import numpy as np

from gridsolve.schemas.artifacts import Tile
from gridsolve.schemas.errors import StageError
from gridsolve.stages.engine.registry import get
from gridsolve.stages.engine.store import Artifact, native_order
from gridsolve.stages.engine.timing import part


def read_block(source: Artifact, role: str, tile: Tile) -> np.ndarray:
    """``role`` ("cube", "weights", "target") of one tile, as (leading, rows, cols) floats."""
    kind, impl = str(source.info.get("kind", "")), str(source.info.get("impl", ""))
    decl = get(kind, impl)
    if decl.read_block is None:
        raise StageError(
            f"{kind}/{impl} provides no block reads, so tiled stages cannot read {role!r}",
            stage=f"{kind}/{impl}",
            fix="declare StageDecl.read_block on the implementation that describes the cube",
        )
    with part("read"):
        block: np.ndarray = native_order(decl.read_block(source.meta, role, tile))
    return block
