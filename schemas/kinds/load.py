"""Configs of the built-in ``load`` implementations (and the family plugins extend)."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import ConfigDict, Field, field_validator

from gridsolve.schemas import catalog
from gridsolve.schemas.base import StageConfig, input_file_field
from gridsolve.schemas.templating import check_template


class LoadConfig(StageConfig):
    """Family of ``load`` implementations."""

    kind: ClassVar[str] = "load"


class NetCDFLoad(LoadConfig):
    """Read a cube ``(obs, y, x)`` and optional helper variables from a NetCDF file."""

    model_config = ConfigDict(title="Load a NetCDF file")

    impl: Literal["netcdf"] = "netcdf"
    path: str = input_file_field(
        ...,
        "NetCDF file to read. May contain {date}, {scheduled_date}, {flow_run_name} placeholders.",
        min_length=1,
    )
    variable: str | None = Field(
        None, description="Data variable holding the cube; inferred when the file has exactly one."
    )
    obs_dim: str | None = Field(
        None, description="Observation dimension (time, band); inferred when omitted."
    )
    y_dim: str | None = Field(None, description="Row dimension; inferred (y, lat, latitude, row).")
    x_dim: str | None = Field(
        None, description="Column dimension; inferred (x, lon, longitude, col)."
    )
    design: str | None = Field(
        None, description="Variable with dims (obs, coef) to use as the design matrix."
    )
    weights: str | None = Field(
        None,
        description="Variable of per-observation weights, dims (obs,) or (obs, y, x); "
        "e.g. inverse variances. Zero excludes an observation.",
    )
    target: str | None = Field(
        None, description="Variable with dims (output, y, x) or (y, x): the model's MSE target."
    )

    @field_validator("path")
    @classmethod
    def _known_placeholders(cls, v: str) -> str:
        return check_template(v)


class DemoLoad(LoadConfig):
    """A seeded synthetic cube, written once as NetCDF under the cache root, then read."""

    model_config = ConfigDict(title="Demo cube")

    impl: Literal["demo"] = "demo"
    size: Literal["small", "seed"] = Field(
        "small", description="small: 50×64×64; seed: 50×500×500, the original problem's size."
    )
    seed: int = Field(0, ge=0, description="Random seed of the synthetic data.")
    nan_fraction: float = Field(
        0.0, ge=0.0, lt=1.0, description="Fraction of observations set to NaN (gaps)."
    )


for _builtin in (
    NetCDFLoad,
    DemoLoad,
):
    catalog.add(_builtin)
