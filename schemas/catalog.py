"""Which config model each implementation of each stage kind has, without importing stages.

Validating a config needs the config models of every implementation, built-in
or plugged in, but not the implementations themselves (nor torch). The
built-in models add themselves here when their module under
``gridsolve.schemas.kinds`` is imported; a plugin's model is added when its stage is registered
(``gridsolve.stages.engine.registry.register``), and plugins declared as
entry points of the ``gridsolve.stages`` group are imported on first use.
Imports go one way: ``stages`` imports ``schemas``, never the reverse.
"""

from __future__ import annotations

import importlib.metadata
import threading
from typing import Any

from gridsolve.schemas.errors import ConfigError

ENTRY_POINT_GROUP = "gridsolve.stages"

_CONFIGS: dict[str, dict[str, Any]] = {}
_LOCK = threading.RLock()
_plugins_loaded = False


def impl_of(cls: Any) -> str:
    """The implementation name a config model selects (its ``impl`` default)."""
    return str(cls.model_fields["impl"].default)


def add(cls: Any) -> None:
    """Record ``cls`` as the config model of its kind's implementation ``impl``."""
    with _LOCK:
        _CONFIGS.setdefault(cls.kind, {})[impl_of(cls)] = cls


def remove(kind: str, impl: str) -> None:
    """Forget an implementation's config model (tests and plugin reloads)."""
    with _LOCK:
        _CONFIGS.get(kind, {}).pop(impl, None)


def load_plugins() -> None:
    """Import the ``gridsolve.stages`` entry points once (they register their stages)."""
    global _plugins_loaded
    with _LOCK:
        if _plugins_loaded:
            return
        _plugins_loaded = True
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


def classes(kind: str) -> dict[str, Any]:
    """Config model per implementation name of ``kind`` (plugins loaded)."""
    load_plugins()
    with _LOCK:
        return dict(_CONFIGS.get(kind, {}))
