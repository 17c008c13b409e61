"""One registry per stage kind: implementation name → declaration.

A declaration ties a pure function to its kind, implementation name, version
(an override: keys already cover the code's source, see ``stages/engine/versions.py``),
config model and output contract. Built-in
implementations register at import of their module (:data:`BUILTIN_MODULES`), which
happens on the registry's first use, not at ``import gridsolve.stages``: several
import torch, and commands that only read configs (``gridsolve schema``,
``validate``) must not pay for it. Third-party packages register with
:func:`register` or through the ``gridsolve.stages`` entry-point group, also
loaded on first use.
"""

from __future__ import annotations

import importlib
import logging
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from gridsolve.schemas import catalog
from gridsolve.schemas.base import StageConfig
from gridsolve.schemas.contracts import ArraySpec
from gridsolve.schemas.errors import ConfigError, ContractError
from gridsolve.schemas.pipeline import STAGE_KINDS, suggest
from gridsolve.stages.engine.contract import contract_of

log = logging.getLogger("gridsolve.registry")

ENTRY_POINT_GROUP = catalog.ENTRY_POINT_GROUP

#: Key, in a ref's metadata and in an input opened by the runner, of the per-run
#: facts about the outside files a stage read this run (see ``StageDecl.locate``).
SOURCE = "source"


class Lazy:
    """A stage function named ``"package.module:function"``, imported on its first call.

    Declarations of implementations whose code imports torch use these, so that
    registering them (and a run whose every stage is a cache hit) imports no
    torch. Its ``__module__`` is the function's module: the stage's code version
    (``stages/engine/runner.py`` ``code_version``) covers that module's source.
    """

    def __init__(self, target: str) -> None:
        module, _, name = target.partition(":")
        if not module or not name:
            raise ValueError(f"Lazy target must be 'module:function', got {target!r}")
        self.target = target
        self.__module__ = module
        self.__qualname__ = self.__name__ = name
        self._fn: Callable[..., Any] | None = None

    def resolve(self) -> Callable[..., Any]:
        """The function itself (its module imported)."""
        if self._fn is None:
            fn: Callable[..., Any] = getattr(
                importlib.import_module(self.__module__), self.__name__
            )
            self._fn = fn
            return fn
        return self._fn

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Call the function (importing its module the first time)."""
        return self.resolve()(*args, **kwargs)

    def __repr__(self) -> str:
        return f"Lazy({self.target!r})"


@dataclass(frozen=True)
class StageDecl:
    """Everything the runner needs to know about one stage implementation.

    ``run`` is ``(config, inputs, ctx) -> StageOutput`` for a whole stage, or
    ``(config, inputs, prepared, tile, ctx) -> StageOutput`` for a tiled one.
    ``prepare`` (tiled stages) runs once per stage before the tiles, with the
    whole-stage signature. ``fingerprint`` returns digests of outside content
    (files, code) that the key must cover besides config and inputs.
    ``inputs`` names the upstream stage kinds it reads; ``optional_inputs``
    those it reads when the run has them (a run without them is keyed as if
    they did not exist); ``peers`` the kinds whose *configs* (not outputs) it
    reads, through ``ctx.peers``: their ``peer_payload`` and fingerprint are
    part of its key. ``outputs`` is the
    contract of the arrays it returns (per tile for tiled stages). ``verify``
    checks, on a cache hit, that what the stage made outside the store (the
    output file) is still intact.

    ``locate`` ``(config, ctx) -> dict`` returns per-run facts about the outside
    files the stage reads (where they are this run, their identity): they are
    attached to the stage's ref under :data:`SOURCE`, in neither the key nor the
    stored artifact, so a file copied elsewhere is still a cache hit. The runner
    adds ``paths`` (the config's input files, see ``StageConfig.input_files``).
    ``records_sources`` stages write those paths into their outputs, so the
    paths of their inputs' sources are part of their key.

    What the plan (``stages/engine/plan.py``) reads: ``grid`` ``(meta) ->
    (ny, nx)`` on the stage whose artifact describes the grid (load);
    ``pixel_bytes`` ``(prepared meta) -> bytes`` on a tiled stage, the memory
    one pixel of a tile holds in it (inputs plus outputs), which sizes tiles;
    ``alignment`` ``(config, grid meta) -> (rows, cols)`` on the writer, the
    output chunk that tiles align to; ``counts`` the name of a per-tile meta
    entry of counts (e.g. pixel statuses) that the run summary adds up;
    ``describe`` ``(meta) -> str`` a line the run log shows for the stage.
    ``read_block`` ``(meta, role, tile) -> array`` on the stage that describes
    the cube (load): how tiled stages read a block of it (see
    ``stages/engine/blocks.py``).
    ``variables`` ``(OutputContext) -> list[OutputVariable]`` on a tiled stage: the
    output variables of the arrays this implementation makes beyond its kind's
    (the kind's own are described by its contract, ``KindContract.variables``);
    the writers write them with no edit of theirs. ``writes_outputs``: the stage
    writes the output file from what its inputs' kinds describe (the writers): its
    key covers the code of those descriptions.
    """

    kind: str
    impl: str
    version: str
    config: type[StageConfig]
    run: Callable[..., Any]
    inputs: tuple[str, ...] = ()
    optional_inputs: tuple[str, ...] = ()
    peers: tuple[str, ...] = ()
    tiled: bool = False
    prepare: Callable[..., Any] | None = None
    fingerprint: Callable[..., Mapping[str, str]] | None = None
    outputs: Mapping[str, ArraySpec] = field(default_factory=dict)
    verify: Callable[[Mapping[str, Any]], bool] | None = None
    summary: str = ""
    locate: Callable[..., Mapping[str, Any]] | None = None
    records_sources: bool = False
    #: (rows, columns) of the grid tiles cover, or (rows, columns, rows per plane) when
    #: batch dims are folded into the rows (no tile then spans two planes)
    grid: Callable[[Mapping[str, Any]], tuple[int, int] | tuple[int, int, int]] | None = None
    pixel_bytes: Callable[[Mapping[str, Any]], int] | None = None
    alignment: Callable[[Any, Mapping[str, Any]], tuple[int, int]] | None = None
    counts: str | None = None
    describe: Callable[[Mapping[str, Any]], str] | None = None
    read_block: Callable[[Mapping[str, Any], str, Any], Any] | None = None
    variables: Callable[..., list[Any]] | None = None
    writes_outputs: bool = False


_REGISTRY: dict[str, dict[str, StageDecl]] = {k: {} for k in STAGE_KINDS}
_LOCK = threading.RLock()


def register(decl: StageDecl, *, replace: bool = False) -> StageDecl:
    """Add an implementation; its config's ``impl`` default must equal ``decl.impl``."""
    load_builtins()
    if decl.kind not in _REGISTRY:
        raise ConfigError(
            f"cannot register {decl.impl!r}: unknown stage kind {decl.kind!r}",
            expected=f"one of {', '.join(STAGE_KINDS)}",
            fix="set StageDecl.kind to one of the kinds",
        )
    contract = contract_of(decl.kind)
    if contract is not None and contract.tiled != decl.tiled:
        how = "tile by tile (tiled=True, with a prepare step)" if contract.tiled else "whole"
        raise ConfigError(
            f"cannot register {decl.kind}/{decl.impl}: the {decl.kind} contract runs {how}",
            fix=f"set StageDecl.tiled={contract.tiled} (see stages/{decl.kind}/contract.py)",
        )
    if decl.tiled and decl.prepare is None:
        raise ConfigError(
            f"cannot register {decl.kind}/{decl.impl}: a tiled stage needs a prepare step",
            fix="give StageDecl.prepare (it may return an empty StageOutput)",
        )
    impl_default = decl.config.model_fields["impl"].default
    if impl_default != decl.impl:
        raise ConfigError(
            f"cannot register {decl.kind}/{decl.impl}: "
            f"its config's impl default is {impl_default!r}",
            fix=f'declare `impl: Literal["{decl.impl}"] = "{decl.impl}"` in the config class',
        )
    with _LOCK:
        if decl.impl in _REGISTRY[decl.kind] and not replace:
            existing = _REGISTRY[decl.kind][decl.impl]
            if existing is decl:
                return decl
            raise ConfigError(
                f"{decl.kind} implementation {decl.impl!r} is already registered",
                fix="choose another impl name, or pass replace=True",
            )
        _REGISTRY[decl.kind][decl.impl] = decl
        catalog.add(decl.config)
    return decl


def register_none(kind: str, config: type[StageConfig], version: str, summary: str) -> StageDecl:
    """Register ``kind``'s ``none`` implementation: a config never ``active``, left out of plans.

    Its functions are never called (the plan leaves the stage out); they refuse if
    they are. Tiled or whole as the kind's contract says.
    """
    stage = f"{kind}/none"

    def never(*_: Any) -> Any:
        raise ContractError(
            f"{kind} impl 'none' does not run", stage=stage, fix="leave it to the plan"
        )

    contract = contract_of(kind)
    tiled = contract is not None and contract.tiled
    return register(
        StageDecl(
            kind=kind,
            impl="none",
            version=version,
            config=config,
            run=never,
            prepare=never if tiled else None,
            tiled=tiled,
            summary=summary,
        )
    )


def unregister(kind: str, impl: str) -> None:
    """Remove an implementation (tests and plugin reloads)."""
    with _LOCK:
        _REGISTRY[kind].pop(impl, None)
        catalog.remove(kind, impl)


#: The modules whose import registers the built-in implementations, in run order.
BUILTIN_MODULES = (
    "gridsolve.stages.load.netcdf",
    "gridsolve.stages.design.builtin",
    "gridsolve.stages.normal_equations.svd",
    "gridsolve.stages.solve.declare",
    "gridsolve.stages.train.declare",
    "gridsolve.stages.model.declare",
    "gridsolve.stages.write.netcdf",
    "gridsolve.stages.write.zarr",
)
_builtins_loaded = False
_builtins_loading = False


def load_builtins() -> None:
    """Import the built-in implementations once (they register themselves).

    Before any other registration (:func:`register` calls this first), so that a
    plugin registering over a built-in with ``replace=True`` always comes second.
    A failed import leaves them unloaded: the next use tries again and fails the
    same way, rather than running with part of the registry.
    """
    global _builtins_loaded, _builtins_loading
    with _LOCK:
        if _builtins_loaded or _builtins_loading:
            return  # loaded, or a built-in module registering while being imported
        _builtins_loading = True
        try:
            for name in BUILTIN_MODULES:
                importlib.import_module(name)
            _builtins_loaded = True
        finally:
            _builtins_loading = False


def _load_entry_points() -> None:
    load_builtins()
    catalog.load_plugins()


def implementations(kind: str) -> dict[str, StageDecl]:
    """Registered implementations of ``kind`` (entry points loaded)."""
    _load_entry_points()
    return dict(_REGISTRY[kind])


def config_classes(kind: str) -> dict[str, type[StageConfig]]:
    """Config model per implementation name of ``kind``."""
    return {name: d.config for name, d in implementations(kind).items()}


def get(kind: str, impl: str) -> StageDecl:
    """The declaration of ``kind``/``impl``; ConfigError listing the known ones otherwise."""
    known = implementations(kind)
    if impl not in known:
        raise ConfigError(
            f"unknown {kind} implementation {impl!r}.{suggest(impl, known)}",
            expected=f"one of {', '.join(sorted(known))}",
            fix=f"set {kind}.impl to a known implementation, or register yours",
        )
    return known[impl]


def decl_for(config: StageConfig) -> StageDecl:
    """The declaration that a validated config selects."""
    return get(config.kind, config.impl)
