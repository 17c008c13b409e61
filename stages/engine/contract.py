"""What each stage kind must produce, written once per kind and enforced by the runner.

A :class:`KindContract` says whether the kind runs whole or tile by tile, and
for each part it runs (``whole``, ``prepare``, ``tile``) which arrays it must
return (:class:`ArraySpec`: named dims, dtype kinds; a tile's ``y``/``x``
sizes are bound to the tile) and which metadata (a pydantic model: required
keys and their types, ``schemas/metadata.py``; implementations may add more), and what its arrays
become in the output file (``variables``, see ``stages/engine/outputs.py``:
the writers know no kind). Each kind writes its
contract in ``stages/<kind>/contract.py`` and adds it here; the registry
refuses an implementation that contradicts its kind's contract (a solve that
is not tiled), and the runner checks every output against it, reporting
every violation at once. ``tests/stages/test_conformance.py`` runs every
registered implementation of every kind, built-in and plugin, through it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
from pydantic import ValidationError

from gridsolve.schemas.contracts import ArraySpec, array_violations
from gridsolve.schemas.errors import ContractError
from gridsolve.schemas.metadata import Meta

Part = Literal["whole", "prepare", "tile"]


@dataclass(frozen=True)
class PartContract:
    """What one part of a stage (whole, prepare or tile) returns."""

    arrays: Mapping[str, ArraySpec] = field(default_factory=dict)
    meta: type[Meta] = Meta


@dataclass(frozen=True)
class KindContract:
    """The contract of one stage kind."""

    kind: str
    tiled: bool
    parts: Mapping[str, PartContract]
    summary: str = ""
    #: ``(OutputContext) -> list[OutputVariable]``: the variables a run of this kind puts
    #: in the output file, with their CF attributes (``stages/engine/outputs.py``);
    #: None: its tile arrays are written as the ``tile`` part lists them
    variables: Callable[..., list[Any]] | None = None
    #: ``(own artifact, load artifact) -> Extension``: what a whole kind adds to the output
    #: (``stages/engine/outputs.py``); None: nothing
    extends: Callable[..., Any] | None = None

    def part(self, name: str) -> PartContract:
        """The contract of part ``name`` (an empty one if the kind declares none)."""
        return self.parts.get(name, PartContract())


_CONTRACTS: dict[str, KindContract] = {}


def add(contract: KindContract) -> KindContract:
    """Make ``contract`` the contract of its kind (each kind's package calls this once)."""
    _CONTRACTS[contract.kind] = contract
    return contract


def contract_of(kind: str) -> KindContract | None:
    """The contract of ``kind``, if its package declared one."""
    return _CONTRACTS.get(kind)


def contracts() -> dict[str, KindContract]:
    """Every declared kind contract, by kind."""
    return dict(_CONTRACTS)


def violations(
    contract: KindContract,
    part: str,
    arrays: Mapping[str, np.ndarray],
    meta: Mapping[str, Any],
    sizes: Mapping[str, int] | None = None,
) -> list[str]:
    """Every way an output of ``part`` breaks ``contract``: arrays and metadata together."""
    spec = contract.part(part)
    problems = array_violations(arrays, spec.arrays, sizes)
    try:
        spec.meta.model_validate(dict(meta))
    except ValidationError as err:
        for e in err.errors():
            where = ".".join(str(p) for p in e["loc"])
            problems.append(f"meta[{where!r}]: {e['msg']}")
    return problems


def check(
    stage: str,
    contract: KindContract,
    part: str,
    arrays: Mapping[str, np.ndarray],
    meta: Mapping[str, Any],
    sizes: Mapping[str, int] | None = None,
) -> None:
    """Raise one ContractError listing every violation of the kind's contract."""
    problems = violations(contract, part, arrays, meta, sizes)
    if problems:
        raise ContractError(
            f"{part} output breaks the {contract.kind} contract ({len(problems)} problem(s))",
            stage=stage,
            violations=problems,
            fix="this is a bug in the stage implementation; it must return what "
            f"stages/{contract.kind}/contract.py lists",
        )
