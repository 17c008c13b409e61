"""Configs from files and the command line: YAML, ``--set`` overrides, relative paths."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import yaml

from gridsolve.schemas import catalog
from gridsolve.schemas.errors import ConfigError
from gridsolve.schemas.pipeline import DEFAULT_IMPL, STAGE_KINDS, PipelineConfig, build_config


class _Loader(yaml.SafeLoader):
    """YAML without implicit dates: ``2020-01-03`` stays the text it is.

    Config values that are dates (``load.select.time``) are labels matched as
    text, and JSON (Prefect parameters, cache keys) has no date type.
    """


_Loader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag != "tag:yaml.org,2002:timestamp"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}


def _yaml(text: str) -> Any:
    return yaml.load(text, Loader=_Loader)  # a SafeLoader: builds plain data only


def _parse_value(text: str) -> Any:
    try:
        return _yaml(text)
    except yaml.YAMLError:
        return text


def apply_overrides(raw: dict[str, Any], overrides: Iterable[str]) -> dict[str, Any]:
    """``raw`` with ``stage.field=value`` assignments applied (values parsed as YAML)."""
    out: dict[str, Any] = json.loads(json.dumps(raw))
    for item in overrides:
        if "=" not in item:
            raise ConfigError(
                f"override {item!r} is not of the form key=value",
                fix="write e.g. --set solve.policy=ridge --set solve.ridge=0.01",
            )
        dotted, value = item.split("=", 1)
        parts = [p for p in dotted.strip().split(".") if p]
        if not parts:
            raise ConfigError(
                f"override {item!r} has an empty key", fix="write e.g. solve.ridge=0.1"
            )
        node = out
        for p in parts[:-1]:
            nxt = node.setdefault(p, {})
            if not isinstance(nxt, dict):
                raise ConfigError(
                    f"override {item!r}: {p!r} is a value, not a section",
                    fix=f"set {'.'.join(parts[:-1])} directly",
                )
            node = nxt
        node[parts[-1]] = _parse_value(value)
    return out


#: Where a deployment run's relative paths point (outputs, cache, inputs).
HOME_ENV = "GRIDSOLVE_HOME"


def deployment_home() -> Path:
    """The folder of a deployment run's relative paths: ``$GRIDSOLVE_HOME``.

    Default ``~/gridsolve``. Not the worker's working directory: that is the
    code checkout `prefect deploy` recorded, and outputs and caches do not
    belong in it.
    """
    return Path(os.environ.get(HOME_ENV) or Path.home() / "gridsolve").expanduser()


def resolved_path(v: str, base: Path) -> str:
    """``v`` made absolute against ``base`` unless it is absolute or a URL."""
    if v and "://" not in v and not Path(v).expanduser().is_absolute():
        # Not .resolve(): a glob's pattern characters must reach the glob intact.
        return os.path.normpath(base / v)
    return v


def resolve_paths(raw: dict[str, Any], base: Path) -> dict[str, Any]:
    """``raw`` with relative path fields made absolute against ``base``."""
    out: dict[str, Any] = json.loads(json.dumps(raw))
    classes_by_kind = {k: catalog.classes(k) for k in STAGE_KINDS}
    for kind, section in out.items():
        if not isinstance(section, dict):
            continue
        if kind == "cache":
            fields: frozenset[str] = frozenset({"root"})
        elif kind in classes_by_kind:
            impl = section.get("impl", DEFAULT_IMPL[kind])
            cls = classes_by_kind[kind].get(impl) if impl else None
            fields = cls.path_fields() if cls else frozenset()
        else:
            continue
        for f in fields:
            v = section.get(f)
            if isinstance(v, str):
                section[f] = resolved_path(v, base)
            elif isinstance(v, list):
                section[f] = [resolved_path(x, base) if isinstance(x, str) else x for x in v]
    return out


def read_config_file(path: str | Path) -> dict[str, Any]:
    """The raw mapping in a YAML (or JSON) config file."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(
            f"config file not found: {p}",
            fix="give the path of a YAML file; `gridsolve demo` writes an example",
        )
    try:
        raw = _yaml(p.read_text())
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        raise ConfigError(
            f"config file {p} is not valid YAML: {exc}", fix="fix the YAML syntax"
        ) from exc
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(
            f"config file {p} must hold a mapping of stage sections",
            found=type(raw).__name__,
            fix="start the file with e.g. `load:` and `design:` sections",
        )
    return raw


def load_config(path: str | Path, overrides: Iterable[str] = ()) -> PipelineConfig:
    """Read, override, resolve and validate a config file."""
    p = Path(path)
    raw = apply_overrides(read_config_file(p), overrides)
    raw = resolve_paths(raw, p.resolve().parent)
    return build_config(raw, source=f"config {p}")


def config_to_yaml(cfg: PipelineConfig) -> str:
    """The config as YAML, every field explicit."""
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
