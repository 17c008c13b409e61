"""A tiled ``solve`` implementation from outside gridsolve, written from docs/extending.md alone.

``numpy_lstsq`` solves each pixel's valid rows with ``numpy.linalg.lstsq``
(slow, simple, float64): what "Adding a stage implementation — a tiled kind"
in docs/extending.md describes, following stages/solve/contract.py. It also makes an
array its kind does not have (``rank``, each pixel's numerical rank) and
describes that array's output variable itself (``StageDecl.variables``): the
writers write it, with its attributes, in NetCDF and Zarr alike.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import numpy as np

from gridsolve.schemas.kinds.solve import SolveConfig
from gridsolve.schemas.metadata import SolvePrepared
from gridsolve.stages.engine.blocks import read_block
from gridsolve.stages.engine.outputs import OutputContext, OutputVariable
from gridsolve.stages.engine.registry import StageDecl, register, unregister
from gridsolve.stages.engine.store import StageOutput

OK, ALL_MISSING = 0, 1


class NumpyLstsqSolve(SolveConfig):
    """numpy.linalg.lstsq on each pixel's valid observations."""

    impl: Literal["numpy_lstsq"] = "numpy_lstsq"


def prepare(config: NumpyLstsqSolve, inputs: Mapping[str, Any], ctx: Any) -> StageOutput:
    A = np.asarray(inputs["design"].array("A"))
    return StageOutput(meta={"coef": int(A.shape[1]), "obs": int(A.shape[0])})


def run_tile(
    config: NumpyLstsqSolve,
    inputs: Mapping[str, Any],
    prepared: Any,
    tile: Any,
    ctx: Any,
) -> StageOutput:
    A = np.asarray(inputs["design"].array("A"), dtype=np.float64)
    cube = read_block(inputs["load"], "cube", tile)  # (obs, rows, cols), through the load kind
    _, ny, nx = cube.shape
    coef = np.full((A.shape[1], ny, nx), np.nan)
    rms = np.full((ny, nx), np.nan)
    rank = np.zeros((ny, nx), dtype=np.int32)
    n_valid = np.isfinite(cube).sum(axis=0).astype(np.int32)
    status = np.where(n_valid > 0, OK, ALL_MISSING).astype(np.int8)
    for j in range(ny):
        for i in range(nx):
            ok = np.isfinite(cube[:, j, i])
            if ok.any():
                c, _, rank[j, i], _ = np.linalg.lstsq(A[ok], cube[ok, j, i], rcond=None)
                coef[:, j, i] = c
                rms[j, i] = np.sqrt(np.mean((cube[ok, j, i] - A[ok] @ c) ** 2))
    counts = {"ok": int((status == OK).sum()), "all_missing": int((status == ALL_MISSING).sum())}
    return StageOutput(
        arrays={
            "coefficients": coef,
            "residual_rms": rms,
            "n_valid": n_valid,
            "status": status,
            "rank": rank,
        },
        meta={"status_counts": {k: v for k, v in counts.items() if v}},
    )


def variables(ctx: OutputContext) -> list[OutputVariable]:
    """The output variable of the array this implementation adds to the solve kind's."""
    return [
        OutputVariable(
            "solve_rank",
            "solve",
            "rank",
            ("y", "x"),
            {"long_name": "numerical rank of the pixel's valid rows of the design", "units": "1"},
        )
    ]


def _pixel_bytes(meta: SolvePrepared) -> int:
    return 8 * (2 * meta.obs + meta.coef + 2)


DECL = StageDecl(
    kind="solve",
    impl="numpy_lstsq",
    version="1",
    config=NumpyLstsqSolve,
    run=run_tile,
    prepare=prepare,
    tiled=True,
    inputs=("load", "design"),
    pixel_bytes=lambda prepared: (
        8 * (2 * SolvePrepared.of(prepared).obs + SolvePrepared.of(prepared).coef + 2)
    ),
    counts="status_counts",
    variables=variables,
)


def install() -> None:
    register(DECL)


def uninstall() -> None:
    unregister("solve", "numpy_lstsq")
