"""One registry per stage kind: implementation name → declaration.

A declaration ties a pure function to its kind, implementation name, version
(an override: keys already cover the code's source, see ``stages/engine/versions.py``),
config model and output contract. Built-in
implementations register at import of their module; third-party packages
register with :func:`register` or through the ``gridsolve.stages`` entry-point
group, loaded on first use.
"""

from __future__ import annotations

import importlib.metadata
import logging
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from gridsolve.schemas.config import STAGE_KINDS, StageConfig, suggest
from gridsolve.schemas.contracts import ArraySpec
from gridsolve.schemas.errors import ConfigError

log = logging.getLogger("gridsolve.registry")

ENTRY_POINT_GROUP = "gridsolve.stages"

#: Key, in a ref's metadata and in an input opened by the runner, of the per-run
#: facts about the outside files a stage read this run (see ``StageDecl.locate``).
SOURCE = "source"


@dataclass(frozen=True)
class StageDecl:
    """Everything the runner needs to know about one stage implementation.

    ``run`` is ``(config, inputs, ctx) -> StageOutput`` for a whole stage, or
    ``(config, inputs, prepared, tile, ctx) -> StageOutput`` for a tiled one.
    ``prepare`` (tiled stages) runs once per stage before the tiles, with the
    whole-stage signature. ``fingerprint`` returns digests of outside content
    (files, code) that the key must cover besides config and inputs.
    ``inputs`` names the upstream stage kinds it reads. ``outputs`` is the
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
    """

    kind: str
    impl: str
    version: str
    config: type[StageConfig]
    run: Callable[..., Any]
    inputs: tuple[str, ...] = ()
    tiled: bool = False
    prepare: Callable[..., Any] | None = None
    fingerprint: Callable[..., Mapping[str, str]] | None = None
    outputs: Mapping[str, ArraySpec] = field(default_factory=dict)
    verify: Callable[[Mapping[str, Any]], bool] | None = None
    summary: str = ""
    locate: Callable[..., Mapping[str, Any]] | None = None
    records_sources: bool = False


_REGISTRY: dict[str, dict[str, StageDecl]] = {k: {} for k in STAGE_KINDS}
_LOCK = threading.RLock()
_entry_points_loaded = False


def register(decl: StageDecl, *, replace: bool = False) -> StageDecl:
    """Add an implementation; its config's ``impl`` default must equal ``decl.impl``."""
    if decl.kind not in _REGISTRY:
        raise ConfigError(
            f"cannot register {decl.impl!r}: unknown stage kind {decl.kind!r}",
            expected=f"one of {', '.join(STAGE_KINDS)}",
            fix="set StageDecl.kind to one of the kinds",
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
    return decl


def unregister(kind: str, impl: str) -> None:
    """Remove an implementation (tests and plugin reloads)."""
    with _LOCK:
        _REGISTRY[kind].pop(impl, None)


def _load_entry_points() -> None:
    global _entry_points_loaded
    with _LOCK:
        if _entry_points_loaded:
            return
        _entry_points_loaded = True
        import gridsolve.stages  # noqa: F401  (built-in implementations register on import)

        for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
            try:
                obj = ep.load()
            except Exception as exc:
                raise ConfigError(
                    f"stage plugin {ep.name!r} ({ep.value}) failed to import: {exc}",
                    fix="fix or uninstall the package that declares it",
                ) from exc
            if callable(obj) and not isinstance(obj, type):
                obj()


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
