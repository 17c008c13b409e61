"""Configs of the built-in ``normal_equations`` implementations (and their family)."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import ConfigDict

from gridsolve.schemas import catalog
from gridsolve.schemas.base import StageConfig


class NormalEquationsConfig(StageConfig):
    """Family of ``normal_equations`` implementations."""

    kind: ClassVar[str] = "normal_equations"


class SVDNormalEquations(NormalEquationsConfig):
    """Float64 Gram matrix AᵀWA and the SVD of W^½A of the shared design."""

    model_config = ConfigDict(title="Shared normal equations (float64 SVD)")

    impl: Literal["svd"] = "svd"


class NoNormalEquations(StageConfig):
    """No normal equations: the solve needs none (``solve: {impl: curvefit}``)."""

    model_config = ConfigDict(title="No normal equations")

    kind: ClassVar[str] = "normal_equations"
    impl: Literal["none"] = "none"

    @property
    def active(self) -> bool:
        """Never: left out of the plan."""
        return False


for _builtin in (SVDNormalEquations, NoNormalEquations):
    catalog.add(_builtin)
