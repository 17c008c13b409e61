"""Configs of the built-in ``load`` implementations (and the family plugins extend)."""

from __future__ import annotations

import datetime as dt
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator

from gridsolve.schemas import catalog
from gridsolve.schemas.base import (
    NoBoolNumbers,
    StageConfig,
    StorageOptions,
    check_url,
    input_file_field,
    storage_options_field,
)
from gridsolve.schemas.templating import check_template


def _date_as_text(value: Any) -> Any:
    # A date from Python (or a YAML loader that makes dates) is matched as its ISO text.
    return value.isoformat() if isinstance(value, dt.date) else value


#: A coordinate label: a number, or text (dates as ``2020-01-03``).
Label = Annotated[int | float | str, BeforeValidator(_date_as_text)]


class LabelRange(BaseModel):
    """An inclusive range of coordinate labels (like ``slice(start, stop)`` in ``.sel``)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    start: Label | None = Field(None, description="First label kept; open when omitted.")
    stop: Label | None = Field(None, description="Last label kept (inclusive); open when omitted.")


class IndexRange(NoBoolNumbers):
    """Positions ``start:stop:step`` (stop excluded, like ``slice`` in ``.isel``)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    start: int | None = Field(None, description="First position kept; 0 when omitted.")
    stop: int | None = Field(
        None, description="Position after the last one kept; the end when omitted."
    )
    step: int | None = Field(None, ge=1, description="Keep every step-th position.")


class LoadConfig(StageConfig):
    """Family of ``load`` implementations."""

    kind: ClassVar[str] = "load"


class NetCDFLoad(LoadConfig):
    """Read a cube ``(obs, …, y, x)`` and optional helper variables from a NetCDF file.

    Every dim other than obs, y and x (member, level, …) is a batch dim: each
    of its series is fitted like a pixel's, and the outputs keep the dim.
    """

    model_config = ConfigDict(title="Load a NetCDF file")

    impl: Literal["netcdf"] = "netcdf"
    path: str | list[str] = input_file_field(
        ...,
        "NetCDF file to read; or a glob (data/sst-*.nc) or list of files, combined along the "
        "obs dim by its coordinate; or a Zarr store (a folder). May contain {date}, "
        "{scheduled_date}, {flow_run_name} placeholders.",
        min_length=1,
    )
    variable: str | None = Field(
        None, description="Data variable holding the cube; inferred when the file has exactly one."
    )
    obs_dim: str | None = Field(
        None,
        description="Observation dimension (time, band); when omitted, told from the CF "
        "attributes of its coordinate variable (axis T, standard_name time, time units) or its "
        "name, never from its position: a cube whose dims say nothing is refused.",
    )
    y_dim: str | None = Field(
        None,
        description="Row dimension of the map; when omitted, told from CF attributes (axis Y, "
        "degrees_north) or names (y, lat, latitude, row), or, with obs known, the first of the "
        "two dims left.",
    )
    x_dim: str | None = Field(
        None,
        description="Column dimension of the map; when omitted, told from CF attributes (axis X, "
        "degrees_east) or names (x, lon, longitude, col), or, with obs known, the second of the "
        "two dims left.",
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
        None,
        description="Variable with dims (output, y, x) or (y, x), plus any of the cube's other "
        "dims: the model's MSE target.",
    )
    storage_options: StorageOptions = storage_options_field()
    isel: dict[str, int | list[int] | IndexRange] = Field(
        default_factory=dict,
        description="Positional sub-cube, like xarray's .isel: {dim: position | [positions] | "
        "{start, stop, step}}, applied before select and before anything is hashed. "
        "One position drops the dim; a one-element list keeps it.",
    )
    select: dict[str, Label | list[Label] | LabelRange] = Field(
        default_factory=dict,
        description="Label-based sub-cube, like xarray's .sel: {dim: label | [labels] | "
        "{start, stop}} (stop inclusive; dates as text, e.g. '2020-01-01'), applied after "
        "isel and before anything is hashed. One label drops the dim; a one-element list "
        "keeps it.",
    )

    @field_validator("path")
    @classmethod
    def _known_placeholders(cls, v: str | list[str]) -> str | list[str]:
        if isinstance(v, list):
            if any(not p for p in v):
                raise ValueError("an empty path in the list")
            return [check_url(check_template(p)) for p in v]
        return check_url(check_template(v))


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
