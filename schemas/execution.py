"""Run-wide settings: where stage outputs are stored and how the pipeline runs."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import ConfigDict, Field, field_validator

from gridsolve.schemas.base import (
    NoBoolNumbers,
    StorageOptions,
    check_url,
    path_field,
    storage_options_field,
)


class CacheConfig(NoBoolNumbers):
    """Where stage outputs are stored, keyed by content hash."""

    model_config = ConfigDict(frozen=True, extra="forbid", title="Cache")

    root: str = path_field(
        ".gridsolve-cache",
        "Folder of the content-addressed store, or an object-store URL (s3://bucket/prefix) "
        "that workers sharing no disk use together.",
        min_length=1,
    )
    enabled: bool = Field(True, description="Reuse stored stage outputs; false recomputes all.")
    storage_options: StorageOptions = storage_options_field()
    max_size: str | None = Field(
        None,
        description="Cap on the local cache's size (e.g. 20GiB, 500MB): at the end of each run "
        "the least recently used artifacts that no running flow is using are removed until the "
        "cache is under it. Omitted: unbounded. Not applied to s3:// caches. Housekeeping "
        "only: not part of any cache key.",
        examples=["20GiB"],
    )

    @field_validator("root")
    @classmethod
    def _supported_url(cls, v: str) -> str:
        return check_url(v)

    @field_validator("max_size", mode="before")
    @classmethod
    def _a_size(cls, v: object) -> object:
        if isinstance(v, int) and not isinstance(v, bool) and v >= 0:
            return str(v)
        if isinstance(v, str):
            parse_size(v)  # ValueError names the examples
        return v

    @property
    def max_size_bytes(self) -> int | None:
        """The size cap in bytes (None: unbounded)."""
        return None if self.max_size is None else parse_size(self.max_size)


_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*$", re.IGNORECASE)
_UNITS = {
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_size(text: str | int) -> int:
    """Bytes in a size such as ``"2GiB"``, ``"512MB"`` or ``1048576``."""
    if isinstance(text, int):
        return text
    m = _SIZE_RE.match(text)
    if not m:
        raise ValueError(f"not a size: {text!r} (examples: 2GiB, 512MiB, 1000000)")
    return int(float(m.group(1)) * _UNITS[(m.group(2) or "B").lower()])


class ExecutionConfig(NoBoolNumbers):
    """How the pipeline runs. Nothing here changes results or cache keys."""

    model_config = ConfigDict(frozen=True, extra="forbid", title="Execution")

    memory_budget: str = Field(
        "1GiB",
        description="Memory one tile may use (per worker, per device); sets the tile size.",
        pattern=_SIZE_RE.pattern,
    )
    tile_pixels: int | None = Field(
        None, ge=1, description="Pixels per tile; default from the memory budget."
    )
    runner: Literal["threads", "dask"] = Field(
        "threads",
        description="threads: this machine; dask: a Dask cluster (LocalCluster or address).",
    )
    dask_address: str | None = Field(
        None, description="Scheduler address (tcp://host:8786); omitted: start a LocalCluster."
    )
    dask_workers: int = Field(2, ge=1, le=256, description="LocalCluster worker processes.")
    max_workers: int = Field(
        2, ge=1, le=256, description="Concurrent tile tasks with the threads runner."
    )

    @property
    def memory_budget_bytes(self) -> int:
        """The memory budget in bytes."""
        return parse_size(self.memory_budget)
