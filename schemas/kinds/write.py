"""Configs of the built-in ``write`` implementations (and the family plugins extend)."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import ConfigDict, Field, field_validator, model_validator

from gridsolve.schemas import catalog
from gridsolve.schemas.base import (
    StageConfig,
    StorageOptions,
    check_url,
    housekeeping_field,
    path_field,
    storage_options_field,
)
from gridsolve.schemas.templating import check_template


class WriteConfig(StageConfig):
    """Family of ``write`` implementations."""

    kind: ClassVar[str] = "write"


class GridWrite(WriteConfig):
    """What the built-in writers share: chunks, layout, replacing an existing output."""

    path: str
    chunks: dict[str, int] | None = Field(
        None,
        description="Chunk size per dim name, e.g. {y: 256, x: 256}; "
        "default: 1 along leading dims, 256×256 spatially.",
    )
    overwrite: bool = Field(True, description="Replace an existing output (as a whole).")
    storage_options: StorageOptions = storage_options_field()
    layout: Literal["nested", "flat"] = Field(
        "nested",
        description="nested: every parameter dim of a gradient or Jacobian is its own dim. "
        "flat: a variable's dims before (y, x) become one labelled dim <name>_index, "
        "so tools that read at most one extra dim (CDO, Panoply) read every variable.",
    )
    keep_last: int | None = housekeeping_field(
        None,
        "When write.path has placeholders ({flow_run_name}, {scheduled_date}, …): after a "
        "successful run keep only the newest N outputs matching it (with their pictures and "
        "weights) and delete older ones; local paths only. Omitted: keep every output.",
        ge=1,
    )

    @field_validator("path", check_fields=False)
    @classmethod
    def _known_placeholders(cls, v: str) -> str:
        return check_url(check_template(v))

    @model_validator(mode="after")
    def _positive_chunks(self) -> GridWrite:
        if self.chunks is not None and any(v < 1 for v in self.chunks.values()):
            raise ValueError("write.chunks sizes must be >= 1")
        return self


class NetCDFWrite(GridWrite):
    """One NetCDF file with the output contract, written atomically."""

    model_config = ConfigDict(title="Write NetCDF")

    impl: Literal["netcdf"] = "netcdf"
    path: str = path_field(
        "gridsolve-output.nc",
        "Output file. May contain {date}, {scheduled_date}, {flow_run_name}, {flow_run_id}.",
        min_length=1,
    )
    zlib: bool = Field(True, description="zlib-compress the variables.")
    complevel: int = Field(
        1,
        ge=0,
        le=9,
        description="Deflate level: 1-3 fast (ISA-L, about 10x zlib's speed, files a few "
        "percent larger than zlib's level 1), 4-9 zlib's (smaller and slower). Every "
        "NetCDF reader inflates both.",
    )
    shuffle: bool = Field(True, description="HDF5 byte shuffle before compression.")


class ZarrWrite(GridWrite):
    """A Zarr store with the output contract, replaced as a whole when complete."""

    model_config = ConfigDict(title="Write a Zarr store")

    impl: Literal["zarr"] = "zarr"
    path: str = path_field(
        "gridsolve-output.zarr",
        "Output Zarr store (a folder). May contain {date}, {scheduled_date}, {flow_run_name}, "
        "{flow_run_id}.",
        min_length=1,
    )


for _builtin in (NetCDFWrite, ZarrWrite):
    catalog.add(_builtin)
