"""The ``write`` contract: the output written somewhere a reader finds it, and where."""

from __future__ import annotations

from gridsolve.schemas.metadata import WriteMeta
from gridsolve.stages.engine.contract import KindContract, PartContract, add

CONTRACT = add(
    KindContract(
        kind="write",
        tiled=False,
        parts={"whole": PartContract(meta=WriteMeta)},
        summary="the output contract, written atomically",
    )
)
