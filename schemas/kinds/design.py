"""Configs of the built-in ``design`` implementations (and the family plugins extend)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar, Literal

from pydantic import ConfigDict, Field

from gridsolve.schemas import catalog
from gridsolve.schemas.base import StageConfig, needs_load_field


class DesignConfig(StageConfig):
    """Family of ``design`` implementations."""

    kind: ClassVar[str] = "design"


class VariableDesign(DesignConfig):
    """The design matrix stored in the input file (named by ``load.design``)."""

    model_config = ConfigDict(title="Design from a variable")

    impl: Literal["variable"] = "variable"

    def cross_stage(self, stages: Mapping[str, StageConfig]) -> list[str]:
        """The variable's name must be given in the load section."""
        return needs_load_field(
            stages, "design", "design impl 'variable' needs the variable's name: set load.design"
        )


class PolynomialDesign(DesignConfig):
    """Polynomial in the observation coordinate: columns t^0 … t^degree."""

    model_config = ConfigDict(title="Polynomial design")

    impl: Literal["polynomial"] = "polynomial"
    degree: int = Field(2, ge=0, le=30, description="Highest power.")
    scale: bool = Field(
        True,
        description="Centre and scale the coordinate to [-1, 1] first (well conditioned); "
        "false uses raw coordinate values (datetimes: days since 1970-01-01).",
    )


class HarmonicDesign(DesignConfig):
    """Mean, optional linear trend, and cos/sin pairs of a period and its harmonics."""

    model_config = ConfigDict(title="Harmonic design")

    impl: Literal["harmonic"] = "harmonic"
    harmonics: int = Field(2, ge=1, le=100, description="Number of cos/sin pairs.")
    period: float | None = Field(
        None,
        gt=0,
        description="Base period in coordinate units (days for datetimes). "
        "Default: 365.25 days for datetimes, else the coordinate span.",
    )
    trend: bool = Field(True, description="Add a linear trend column.")


class RandomDesign(DesignConfig):
    """A seeded standard-normal matrix, like the original problem's randn(50, 100)."""

    model_config = ConfigDict(title="Random design")

    impl: Literal["random"] = "random"
    coef: int = Field(100, ge=1, le=100_000, description="Number of coefficients (columns).")
    seed: int = Field(0, ge=0, description="Random seed.")


class NoDesign(StageConfig):
    """No design: the solve fits a function of its own (``solve: {impl: curvefit}``)."""

    model_config = ConfigDict(title="No design")

    kind: ClassVar[str] = "design"
    impl: Literal["none"] = "none"

    @property
    def active(self) -> bool:
        """Never: a ``none`` design is left out of the plan, and no design matrix is written."""
        return False


for _builtin in (
    NoDesign,
    VariableDesign,
    PolynomialDesign,
    HarmonicDesign,
    RandomDesign,
):
    catalog.add(_builtin)
