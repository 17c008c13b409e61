"""What ``load.path`` names, told without opening anything: one file, a glob, a Zarr store.

Kept apart from the modules that read the cube (they import xarray): a rerun
whose every stage is a cache hit finds its load key from here and
:mod:`.scanmemo` alone.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

from gridsolve.schemas.errors import InputError
from gridsolve.schemas.kinds.load import DemoLoad, NetCDFLoad
from gridsolve.stages.engine import storage
from gridsolve.stages.engine.context import StageContext
from gridsolve.stages.engine.provenance import ZARR_MARKERS
from gridsolve.stages.load.demo import demo_file

STAGE = "load"
_MAGIC = set("*?[")


def is_glob(path: str) -> bool:
    """Whether ``path`` holds glob characters."""
    return any(c in _MAGIC for c in path)


def is_zarr(path: str, options: Mapping[str, Any] | None = None) -> bool:
    """Whether ``path`` is a Zarr store (a folder, or a URL prefix, with Zarr metadata)."""
    return storage.at(path, options).holds_any(ZARR_MARKERS, ("input", InputError, STAGE))


def relative_paths() -> str:
    """Where relative paths were resolved, for messages (CLI configs and deployments differ)."""
    from gridsolve.schemas.reading import HOME_ENV, deployment_home

    return (
        "relative paths in a config file are resolved against its folder; in a deployment's "
        f"parameters against {HOME_ENV}, here {deployment_home()}"
    )


def expand(path: str | Sequence[str], options: Mapping[str, Any] | None = None) -> list[str]:
    """The absolute paths (or URLs) ``load.path`` names, globs expanded (sorted), no repeats.

    InputError if a glob matches nothing or the list is empty.
    """
    items = [path] if isinstance(path, str) else list(path)
    if not items:
        raise InputError("load.path is an empty list", stage=STAGE, fix="list at least one file")
    out: list[str] = []
    for item in items:
        where = storage.at(storage.at(item).absolute(), options)
        item = where.text
        if where.is_pattern():  # a folder may be "exp[2]"
            matches = where.glob(("input", InputError, STAGE))
            if not matches:
                raise InputError(
                    f"load.path {item!r} matches no {where.noun}",
                    stage=STAGE,
                    fix=where.glob_fix(relative_paths()),
                )
            out += matches
        else:
            out.append(item)
    return list(dict.fromkeys(out))


def single_file(config: NetCDFLoad) -> str | None:
    """The one NetCDF file ``load.path`` names, or None for a file set or a Zarr store."""
    if isinstance(config.path, str) and not is_glob(config.path):
        if storage.at(config.path).local is None:
            return None  # objects are keyed by their ETags, as a set of one
        path = os.path.abspath(os.path.expanduser(config.path))
        return None if is_zarr(path) else path
    return None


def netcdf_config(
    config: NetCDFLoad | DemoLoad, ctx: StageContext
) -> tuple[str | None, NetCDFLoad]:
    """The one file to read (None: a file set or store) and the config to read it with."""
    if isinstance(config, DemoLoad):
        path = demo_file(ctx.store.root, config.size, config.seed, config.nan_fraction)
        return os.path.abspath(path), NetCDFLoad(path=str(path), variable="signal")
    return single_file(config), config
