"""What a stage function may know about the run besides its config and inputs.

Nothing here affects results: the memory budget only changes speed and tile
sizes; the logger only reports.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from gridsolve.schemas.errors import ConfigError
from gridsolve.stages.engine.store import Staging, Store

if TYPE_CHECKING:
    import torch


@dataclass
class StageContext:
    """Run-wide facilities handed to every stage function."""

    store: Store
    memory_budget: int = 2**30
    logger: logging.Logger = field(default_factory=lambda: logging.getLogger("gridsolve"))
    #: key of the stage (or tile) being run; set by the runner
    key: str = ""
    #: the configs of other kinds the stage reads (``StageDecl.peers``), by kind
    peers: Mapping[str, Any] = field(default_factory=dict)
    #: ``progress(fraction, description)`` for long stages (the flow shows it in Prefect)
    progress: Callable[[float, str], None] | None = None
    #: where the part being run may fill its outputs in place; set by the runner
    staging: Staging | None = None

    def empty(self, shape: tuple[int, ...], dtype: Any, populate: bool = True) -> np.ndarray:
        """An uninitialised array for one of the part's outputs, returned as it is.

        Filled in place in the file the store keeps when the runner stages the
        part's outputs (no second write of its bytes), else in memory. Only for
        arrays returned whole, in this shape: any other is stored the usual way.
        ``populate=False`` for an array filled with :meth:`write` in large blocks.
        """
        if self.staging is None:
            return np.empty(shape, dtype)
        return self.staging.empty(shape, dtype, populate)

    def write(self, arr: np.ndarray, index: tuple[int, ...], data: np.ndarray) -> None:
        """``arr[index] = data`` (``arr[index]`` C-contiguous), by a file write where staged.

        For an array from :meth:`empty` filled in blocks of whole rows: the
        fastest way to fill a staged file (``Staging.write``).
        """
        if self.staging is None:
            arr[index] = data
        else:
            self.staging.write(arr, index, data)

    def with_peers(self, peers: Mapping[str, Any]) -> StageContext:
        """The same context, for a stage that reads ``peers``."""
        return dataclasses.replace(self, peers=dict(peers))


def tile_share(memory_budget: int) -> int:
    """The part of the memory budget one tile's arrays (every tiled stage's) may hold."""
    return memory_budget // 2


def work_share(memory_budget: int) -> int:
    """The part a stage's working chunks inside a tile may use (the tile holds the rest)."""
    return memory_budget // 4


def resolve_device(name: str) -> torch.device:
    """The torch device for ``auto``, ``cpu``, ``cuda`` or ``cuda:N``."""
    import torch  # here, not at the top: stages that never touch torch must not import it

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ConfigError(
                f"device {name!r} requested but this machine has no CUDA device",
                fix="set device: auto (uses CUDA when present) or device: cpu",
            )
        dev = torch.device(name)
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ConfigError(
                f"device {name!r} does not exist (this machine has "
                f"{torch.cuda.device_count()} CUDA device(s))",
                fix="use cuda:0 … or device: auto",
            )
        return dev
    return torch.device("cpu")


def chunk_size(budget_bytes: int, bytes_per_item: int, minimum: int = 1) -> int:
    """How many items fit in ``budget_bytes`` at ``bytes_per_item`` each (at least ``minimum``)."""
    return max(minimum, int(budget_bytes // max(1, bytes_per_item)))
