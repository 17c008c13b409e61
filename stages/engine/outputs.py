"""What a tiled kind puts in the output file: its variables, each declared once by the kind.

A kind's contract (``KindContract.variables``) returns an :class:`OutputVariable`
per variable it writes: the tile array it comes from (or a function of that
tile's arrays, for derived data such as t-statistics), its dims by role, its CF
attributes. The writers (NetCDF and Zarr) iterate these and know no kind; arrays
of a kind that declares no variables reach the file from its contract
(:func:`contract_variables`). A whole (untiled) kind adds to the output what it
describes in an :class:`Extension`: coordinates, variables and attributes, and
files beside the output (the trained weights). Units arithmetic shared by kinds and writers
(a coefficient's units from the data's and its design column's) lives here too.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from gridsolve.schemas.metadata import DesignMeta, LoadMeta
from gridsolve.stages.engine.contract import contract_of
from gridsolve.stages.engine.store import Artifact, TiledArtifact

#: Dims roles the writer replaces by the input's dim names.
GRID_ROLES = ("y", "x")


@dataclass
class OutputVariable:
    """One variable of the output file, filled tile by tile.

    ``kind``/``array``: the tile array it is, or (with ``derive``) whose shape and
    dtype it has. ``derive`` ``(tile artifacts by kind) -> array`` makes derived
    data from one tile. ``dims`` are the variable's dims, ``y`` and ``x`` (last)
    standing for the input's grid dims. ``flat_from``: set by the writer for the
    flat layout (the leading dims folded into one).
    """

    name: str
    kind: str
    array: str
    dims: tuple[str, ...]
    attrs: dict[str, Any] = field(default_factory=dict)
    derive: Callable[[Mapping[str, Artifact]], np.ndarray] | None = None
    flat_from: tuple[str, ...] | None = None

    def data(self, arts: Mapping[str, Artifact]) -> np.ndarray:
        """The variable's data in one tile (``arts``: that tile of each tiled kind)."""
        if self.derive is not None:
            return self.derive(arts)
        data: np.ndarray = arts[self.kind].array(self.array)
        return data

    def made(self, tiled: Mapping[str, TiledArtifact]) -> bool:
        """Whether the run made the array it comes from (optional outputs may be absent)."""
        art = tiled.get(self.kind)
        return art is not None and bool(art.tiles) and self.array in art.tiles[0][1]


def flag_attrs(long_name: str, flags: Mapping[int, str], masks: bool = False) -> dict[str, Any]:
    """CF attributes of a flag variable: its values (or bit ``masks``) and their meanings."""
    codes = sorted(flags)
    return {
        "long_name": long_name,
        "flag_masks" if masks else "flag_values": np.array(codes, dtype=np.int8),
        "flag_meanings": " ".join(flags[k] for k in codes),
    }


@dataclass(frozen=True)
class OutputContext:
    """What a kind describes its variables from: its artifact and the grid's.

    ``load`` describes the cube (its dims, the data's units), ``design`` the
    design's columns (None: the run has no design, ``solve: curvefit``); ``own`` is
    the describing kind's tiled artifact.
    """

    load: Artifact
    design: Artifact | None
    own: TiledArtifact

    @property
    def load_meta(self) -> LoadMeta:
        """The load's metadata, typed."""
        return LoadMeta.of(self.load)

    @property
    def design_meta(self) -> DesignMeta:
        """The design's metadata, typed (a run without a design has none to read)."""
        if self.design is None:
            raise KeyError("the run has no design")
        return DesignMeta.of(self.design)

    @property
    def data_units(self) -> str | None:
        """The input data's units (None: not given)."""
        units = self.load_meta.attrs.get("units")
        return None if units is None else str(units)

    def coefficient_units(self) -> list[str | None]:
        """Units of each coefficient (see :func:`coefficient_units`)."""
        return coefficient_units(self.load, self.design)


@dataclass(frozen=True)
class Extension:
    """What a whole (untiled) kind adds to the output, whatever its format.

    ``add`` adds its coordinates, variables and global attributes to the output's
    skeleton (an ``xarray.Dataset``). ``side_files``: suffix → a function writing
    that file, atomically and marked as gridsolve's, at the path it is given
    (``<write.path><suffix>``, see ``stages/engine/paths.py``).
    """

    add: Callable[[Any], None]
    side_files: Mapping[str, Callable[[Path], None]] = field(default_factory=dict)


def contract_variables(
    tiled: Mapping[str, TiledArtifact], described: list[OutputVariable]
) -> list[OutputVariable]:
    """Variables for the tile arrays a kind's contract declares and no variable describes.

    A kind that declares no variables still reaches the file: each array named
    after itself, with the contract's dims and its description as long_name.
    """
    have = {(v.kind, v.array) for v in described if v.derive is None}
    out = []
    for kind, art in tiled.items():
        contract = contract_of(kind)
        if contract is None or not art.tiles:
            continue
        for name, spec in contract.part("tile").arrays.items():
            if (kind, name) in have or name not in art.tiles[0][1]:
                continue
            attrs = {"long_name": spec.description} if spec.description else {}
            out.append(OutputVariable(name, kind, name, tuple(spec.dims), attrs))
    return out


_PLAIN_UNIT = re.compile(r"[A-Za-z0-9 .^-]+")
_SYMBOL_POWER = re.compile(r"([A-Za-z]+)(-?\d*)")


def per_unit(units: str | None, per: str | None) -> str | None:
    """``units`` divided by ``per`` in UDUNITS syntax (``K``, ``day`` → ``K day-1``).

    None when either is unknown, or ``units`` is a time reference (``… since …``).
    """
    if units is None or per is None or "since" in units or "since" in per:
        return None
    if per == "1":
        return units
    m = _SYMBOL_POWER.fullmatch(per)
    inverse = f"{m[1]}{-int(m[2] or 1)}" if m else f"({per})-1"
    if units == "1":
        return inverse
    return f"{units} {inverse}" if _PLAIN_UNIT.fullmatch(units) else f"({units}) {inverse}"


def squared_unit(units: str) -> str | None:
    """``units`` squared in UDUNITS syntax (None where it is not a plain unit string)."""
    if not _PLAIN_UNIT.fullmatch(units):
        return None
    return f"({units})2" if " " in units else f"{units}2"


def coefficient_units(load: Artifact, design: Artifact | None) -> list[str | None]:
    """Units of each coefficient: the data's units over its design column's (None: unknown).

    No design (``solve: curvefit``): no coefficients, an empty list.
    """
    if design is None:
        return []
    units = LoadMeta.of(load).attrs.get("units")
    typed = DesignMeta.of(design)
    cols = typed.column_units or [None] * len(typed.columns)
    return [per_unit(units, c) for c in cols]


def uniform_unit(units: list[str | None]) -> str | None:
    """The one unit every coefficient has (None: they differ, or it is unknown)."""
    return units[0] if len(set(units)) == 1 else None
