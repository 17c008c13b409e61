"""Configs from files and the command line: YAML, ``--set`` overrides, relative paths."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel

from gridsolve.schemas import catalog
from gridsolve.schemas.confinement import HOME_ENV as HOME_ENV
from gridsolve.schemas.confinement import deployment_home as deployment_home
from gridsolve.schemas.errors import ConfigError
from gridsolve.schemas.execution import CacheConfig
from gridsolve.schemas.pipeline import DEFAULT_IMPL, STAGE_KINDS, PipelineConfig, build_config


class _Loader(yaml.SafeLoader):
    """YAML with the 1.2 core schema's plain scalars, and without implicit dates.

    PyYAML follows YAML 1.1, where ``0x10`` and ``010`` are 16 and 8, ``1:30``
    is 90, ``yes``/``no``/``on``/``off`` are bools and ``1e-3`` is text. In the
    1.2 core schema (what users expect) an int is decimal digits, a bool is
    ``true``/``false``, and ``1e-3`` a float; anything else stays the text it
    is, so ``design.degree: 0x10`` is refused as not an integer rather than
    read as 16, and a variable named ``no`` keeps its name. Dates stay text
    too: config values that are dates (``load.select.time``) are labels
    matched as text, and JSON (Prefect parameters, cache keys) has no date type.
    """


_CORE_1_2 = (
    ("tag:yaml.org,2002:bool", r"^(?:true|True|TRUE|false|False|FALSE)$", "tTfF"),
    ("tag:yaml.org,2002:int", r"^[-+]?[0-9]+$", "-+0123456789"),
    (
        "tag:yaml.org,2002:float",
        r"^(?:[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?"
        r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$",
        "-+.0123456789",
    ),
)
_REPLACED = {tag for tag, _, _ in _CORE_1_2} | {"tag:yaml.org,2002:timestamp"}
_Loader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag not in _REPLACED]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
for _tag, _rx, _first in _CORE_1_2:  # int before float: "3" is an int
    _Loader.add_implicit_resolver(_tag, re.compile(_rx), list(_first))


def _decimal_int(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> int:
    text = str(loader.construct_scalar(node))
    if re.fullmatch(r"[-+]?[0-9]+", text):
        return int(text, 10)  # "010" is ten, not YAML 1.1's octal eight
    result: int = loader.construct_yaml_int(node)  # an explicit !!int tag
    return result


_Loader.add_constructor("tag:yaml.org,2002:int", _decimal_int)


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


def resolved_path(v: str, base: Path) -> str:
    """``v`` made absolute against ``base`` unless it is absolute or a URL."""
    if v and "://" not in v and not Path(v).expanduser().is_absolute():
        # Not .resolve(): a glob's pattern characters must reach the glob intact.
        return os.path.normpath(base / v)
    return v


def resolve_paths(raw: dict[str, Any], base: Path) -> dict[str, Any]:
    """``raw`` with relative path fields made absolute against ``base``.

    Defaults count too: a config without ``cache.root`` (or ``write.path``)
    gets the default's name in its own folder, so the same config run from
    another working directory uses the same cache and output.
    """
    out: dict[str, Any] = json.loads(json.dumps(raw))
    classes_by_kind = {k: catalog.classes(k) for k in STAGE_KINDS}
    for kind in ("cache", *STAGE_KINDS):
        section = out.get(kind, {})
        if not isinstance(section, dict):
            continue
        cls: type[BaseModel] | None
        if kind == "cache":
            cls, fields = CacheConfig, frozenset({"root"})
        else:
            impl = section.get("impl", DEFAULT_IMPL[kind])
            stage_cls = classes_by_kind[kind].get(impl) if isinstance(impl, str) else None
            cls, fields = stage_cls, stage_cls.path_fields() if stage_cls else frozenset()
        for f in sorted(fields):
            default = cls.model_fields[f].default if cls is not None else None
            v = section.get(f, default)
            if isinstance(v, str):
                section[f] = resolved_path(v, base)
            elif isinstance(v, list) and f in section:
                section[f] = [resolved_path(x, base) if isinstance(x, str) else x for x in v]
            else:
                continue
            out[kind] = section
    return out


def duplicate_keys(node: yaml.Node | None, where: str = "") -> list[str]:
    """Each key written twice in one mapping of a composed YAML document, with both lines.

    YAML loaders keep the last value silently (a second ``load:`` section
    replaced the first), so gridsolve refuses them.
    """
    found: list[str] = []
    if isinstance(node, yaml.MappingNode):
        seen: dict[Any, int] = {}
        for key, value in node.value:
            name = key.value if isinstance(key, yaml.ScalarNode) else None
            dotted = f"{where}.{name}" if where else str(name)
            if name is not None and name != "<<":
                line = key.start_mark.line + 1
                if name in seen:
                    found.append(f"{dotted!r} on lines {seen[name]} and {line}")
                else:
                    seen[name] = line
            found += duplicate_keys(value, dotted)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            found += duplicate_keys(item, f"{where}[{i}]")
    return found


def read_config_file(path: str | Path) -> dict[str, Any]:
    """The raw mapping in a YAML (or JSON) config file."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(
            f"config file not found: {p}",
            fix="give the path of a YAML file; `gridsolve demo` writes an example",
        )
    try:
        text = p.read_text()
        twice = duplicate_keys(yaml.compose(text, Loader=_Loader))
        raw = _yaml(text)
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        raise ConfigError(
            f"config file {p} is not valid YAML: {exc}", fix="fix the YAML syntax"
        ) from exc
    if twice:
        raise ConfigError(
            f"config file {p} sets {'a key' if len(twice) == 1 else 'keys'} twice: "
            + "; ".join(twice),
            fix="keep one of each (merge the two sections into one); YAML would silently "
            "keep only the last",
        )
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
    return cfg.to_yaml()
