"""``gridsolve cache``: how big a local cache is, and pruning it to a size cap on demand.

``gridsolve cache size [--root R | config.yaml]`` prints the total size, the
number of artifacts and the live leases (running flows); ``gridsolve cache
prune --max-size 5GiB [--root R | config.yaml] [--dry-run]`` removes least
recently used artifacts that no running flow is using until the cache is under
the cap, and prints what it removed and freed (see
:mod:`gridsolve.stages.engine.prune`). Without ``--root`` or a config, the
cache is the default ``cache.root`` (``.gridsolve-cache``) under ``$GRIDSOLVE_HOME``
when that is set (where deployment runs keep it), else in this folder if it has
one, else under ``~/gridsolve`` (GRIDSOLVE_HOME's default).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from gridsolve.schemas.errors import ConfigError, StoreError


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``gridsolve cache size|prune`` on the CLI's subcommands."""
    c = sub.add_parser(
        "cache", help="size of a local cache, and pruning it to a size cap (LRU, never in use)"
    )
    actions = c.add_subparsers(dest="cache_command", required=True)
    size = actions.add_parser("size", help="total size, artifacts and live leases of a cache")
    prune = actions.add_parser(
        "prune",
        help="remove least recently used artifacts no running flow uses, until under --max-size",
    )
    for p in (size, prune):
        where = p.add_mutually_exclusive_group()
        where.add_argument("--root", help="the cache folder (cache.root)")
        where.add_argument(
            "config", nargs="?", help="a config file: its cache.root (and cache.max_size)"
        )
    prune.add_argument(
        "--max-size",
        help="the cap, e.g. 5GiB, 500MB, 0 (default: the config's cache.max_size)",
    )
    prune.add_argument("--dry-run", action="store_true", help="print what would go; remove nothing")


def _where(args: argparse.Namespace) -> tuple[str, str | None]:
    """The cache root named on the command line, and the config's size cap (if any)."""
    if args.config is not None:
        from gridsolve.schemas.reading import load_config

        cfg = load_config(args.config)
        return cfg.cache.root, cfg.cache.max_size
    if args.root is not None:
        return args.root, None
    from gridsolve.schemas.execution import CacheConfig
    from gridsolve.schemas.reading import HOME_ENV, deployment_home

    if os.environ.get(HOME_ENV):  # a worker's machine: the deployments' default cache
        return str(deployment_home() / CacheConfig().root), None
    here = Path(CacheConfig().root)
    if here.is_dir():  # `gridsolve run` of a config in this folder
        return str(here), None
    # else the deployments' default cache under GRIDSOLVE_HOME's default (~/gridsolve)
    return str(deployment_home() / CacheConfig().root), None


def _local_cache(root: str) -> Path:
    """``root`` as a local cache folder; StoreError for a bucket, a missing or foreign folder."""
    from gridsolve.stages.engine import storage

    if storage.at(root).shared() is not None:
        raise StoreError(
            f"the cache {root} is a bucket: not pruned, local caches only",
            fix="gridsolve cache works on local cache folders; clean a bucket with "
            "`aws s3 rm --recursive`",
        )
    folder = Path(root).expanduser().resolve()
    if not folder.exists():
        raise StoreError(
            f"no cache folder at {folder}",
            fix="pass --root with a cache.root folder, or the config file that names it",
        )
    if not (folder / "objects").is_dir():
        raise StoreError(
            f"{folder} is not a gridsolve cache folder (it has no objects/ folder)",
            fix="pass --root with a cache.root folder, or the config file that names it",
        )
    return folder


def _size(text: str) -> int:
    from gridsolve.schemas.execution import parse_size

    try:
        return parse_size(text)
    except ValueError:
        raise ConfigError(
            f"--max-size {text!r} is not a size",
            expected="a size such as 5GiB, 500MB or 1000000 (bytes)",
            found=text,
            fix="gridsolve cache prune --max-size 5GiB",
        ) from None


def cmd_cache(args: argparse.Namespace) -> int:
    """``gridsolve cache size`` or ``gridsolve cache prune``."""
    from gridsolve.stages.engine import prune as pruning

    root, config_cap = _where(args)
    if args.cache_command == "prune":
        text = args.max_size if args.max_size is not None else config_cap
        if text is None:
            raise ConfigError(
                "gridsolve cache prune needs a size cap",
                fix="pass --max-size 5GiB, or a config file that sets cache.max_size",
            )
        cap = _size(text)
        folder = _local_cache(root)
        report = pruning.prune(folder, cap, dry_run=args.dry_run)
        print(f"cache: {folder}")
        for line in report.lines():
            print(line)
        return 0
    folder = _local_cache(root)
    used = pruning.usage(folder)
    print(f"cache: {folder}")
    print(f"size: {pruning.format_size(used.total_bytes)} ({used.total_bytes} bytes)")
    print(f"artifacts: {len(used.artifacts)} ({pruning.format_size(used.artifact_bytes)})")
    if used.quarantined:
        print(
            f"quarantined: {len(used.quarantined)} "
            f"({pruning.format_size(used.quarantined_bytes)}; pruned first)"
        )
    print(f"live leases: {len(used.leases.live)}")
    for lease in used.leases.live:
        print(f"  {lease.purpose or 'run'}: pid {lease.pid} on {lease.host}, since {lease.started}")
    if used.leases.expired:
        print(f"expired leases: {len(used.leases.expired)} (swept by the next prune)")
    if config_cap is not None:
        print(f"cap (cache.max_size): {config_cap}")
    return 0
