"""A stage implementation defined outside gridsolve: a design of Legendre polynomials."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import numpy as np
from pydantic import Field

from gridsolve.schemas.kinds.design import DesignConfig
from gridsolve.schemas.metadata import LoadMeta
from gridsolve.stages.engine.registry import StageDecl, register, unregister
from gridsolve.stages.engine.store import StageOutput


class LegendreDesign(DesignConfig):
    """Legendre polynomials P0…Pdegree of the observation index scaled to [-1, 1]."""

    impl: Literal["legendre"] = "legendre"
    degree: int = Field(3, ge=0, le=20)


def run(config: LegendreDesign, inputs: Mapping[str, Any], ctx: Any) -> StageOutput:
    n = LoadMeta.of(inputs["load"]).n_obs  # another kind's metadata: read through its model
    t = np.linspace(-1.0, 1.0, n)
    A = np.polynomial.legendre.legvander(t, config.degree)
    s = np.linalg.svd(A, compute_uv=False)
    return StageOutput(
        arrays={"A": A},
        meta={
            "columns": [f"P{k}" for k in range(config.degree + 1)],
            "coef": config.degree + 1,
            "obs": n,
            "cond": float(s[0] / s[-1]),
            "rank": int(np.linalg.matrix_rank(A)),
            "basis": "legendre",
        },
    )


DECL = StageDecl(
    kind="design", impl="legendre", version="1", config=LegendreDesign, run=run, inputs=("load",)
)


def install() -> None:
    register(DECL)


def uninstall() -> None:
    unregister("design", "legendre")
