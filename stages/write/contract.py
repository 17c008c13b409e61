"""The ``write`` contract: the output written somewhere a reader finds it, and where."""

from __future__ import annotations

from gridsolve.stages.engine.contract import KindContract, Meta, PartContract, add


class WriteMeta(Meta):
    """Where the output is (the run summary names it)."""

    path: str


CONTRACT = add(
    KindContract(
        kind="write",
        tiled=False,
        parts={"whole": PartContract(meta=WriteMeta)},
        summary="the output contract, written atomically",
    )
)
