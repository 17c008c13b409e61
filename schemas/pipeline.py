"""The whole run's config: one section per stage kind, plus cache and execution settings.

Each stage kind accepts any registered implementation; the ``impl`` field
selects it and validation then uses that implementation's model (built-in ones
in ``gridsolve.schemas.kinds``, plugins' through ``gridsolve.schemas.catalog``),
so a typo in a field or an unknown ``impl`` is reported before anything runs.
Rules that involve two sections live with the config they belong to
(:meth:`StageConfig.cross_stage`).
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping
from typing import Annotated, Any, NamedTuple, TypeAlias

from pydantic import BaseModel, ConfigDict, ValidationError, model_validator
from pydantic_core import PydanticCustomError, core_schema

from gridsolve.schemas import catalog
from gridsolve.schemas.base import StageConfig
from gridsolve.schemas.errors import ConfigError
from gridsolve.schemas.execution import CacheConfig, ExecutionConfig
from gridsolve.schemas.kinds.design import RandomDesign
from gridsolve.schemas.kinds.load import DemoLoad
from gridsolve.schemas.kinds.model import MultidimLinearModel, NoModel
from gridsolve.schemas.kinds.normal_equations import SVDNormalEquations
from gridsolve.schemas.kinds.solve import LstsqSolve
from gridsolve.schemas.kinds.train import NoTrain
from gridsolve.schemas.kinds.write import NetCDFWrite


def _config_classes(kind: str) -> Mapping[str, type[StageConfig]]:
    return catalog.classes(kind)


def suggest(name: str, known: Iterable[str]) -> str:
    """' Did you mean …?' for a misspelt name, or ''."""
    close = difflib.get_close_matches(name, list(known), n=1, cutoff=0.5)
    return f" Did you mean {close[0]!r}?" if close else ""


def _inline_refs(schema: Any, defs: Mapping[str, Any]) -> Any:
    if isinstance(schema, dict):
        ref = schema.get("$ref")
        if isinstance(ref, str) and ref.startswith("#/$defs/"):
            return _inline_refs(defs[ref.split("/")[-1]], defs)
        return {k: _inline_refs(v, defs) for k, v in schema.items() if k != "$defs"}
    if isinstance(schema, list):
        return [_inline_refs(v, defs) for v in schema]
    return schema


class StageKind:
    """A stage kind's parameter: any registered implementation's config, chosen by ``impl``.

    Used as ``Annotated[StageConfig, StageKind("solve", default_impl="lstsq")]``;
    the kinds of the pipeline and their default implementations are read from
    these annotations on :class:`PipelineConfig`, so they are written once.
    """

    def __init__(self, kind: str, default_impl: str | None) -> None:
        self.kind = kind
        self.default_impl = default_impl

    def validate(self, value: Any) -> StageConfig:
        """``value`` as the config of the implementation its ``impl`` names (or the default)."""
        classes = _config_classes(self.kind)
        if isinstance(value, StageConfig):
            if type(value) in classes.values():
                return value
            value = value.model_dump()
        if not isinstance(value, Mapping):
            raise PydanticCustomError(
                "stage_config",
                "expected a mapping with an 'impl' key, got {t}",
                {"t": type(value).__name__},
            )
        impl = value.get("impl", self.default_impl)
        if impl is None:
            raise PydanticCustomError(
                "missing_impl",
                "choose an implementation with impl: one of {known}",
                {"known": ", ".join(sorted(classes))},
            )
        if impl not in classes:
            raise PydanticCustomError(
                "unknown_impl",
                "unknown {kind} implementation '{impl}'; known: {known}.{hint}",
                {
                    "kind": self.kind,
                    "impl": impl,
                    "known": ", ".join(sorted(classes)),
                    "hint": suggest(str(impl), classes),
                },
            )
        return classes[impl].model_validate(dict(value))

    def __get_pydantic_core_schema__(self, source: Any, handler: Any) -> core_schema.CoreSchema:
        return core_schema.no_info_plain_validator_function(
            self.validate,
            serialization=core_schema.plain_serializer_function_ser_schema(
                lambda v: v.model_dump(mode="json")
            ),
        )

    def __get_pydantic_json_schema__(self, cs: Any, handler: Any) -> dict[str, Any]:
        variants = []
        for cls in _config_classes(self.kind).values():
            js = cls.model_json_schema()
            variant = _inline_refs(js, js.get("$defs", {}))
            props = variant.get("properties", {})
            if "impl" in props and "const" in props["impl"]:
                # a one-value enum, described: Prefect's form shows a bare const as
                # "Impl is a const"; the variant itself is picked by the selector above it
                impl = props["impl"]["const"]
                props["impl"] = {
                    "title": "Implementation",
                    "description": f"The {self.kind} implementation of this section: "
                    f"{impl}. Choose another with the selector above.",
                    "enum": [impl],
                    "default": impl,
                    "type": "string",
                }
            variants.append(variant)
        if len(variants) == 1:
            only: dict[str, Any] = variants[0]
            return only
        return {"anyOf": variants}


# The type of each stage's parameter: any registered implementation's config.
LoadField: TypeAlias = Annotated[StageConfig, StageKind("load", default_impl="netcdf")]
DesignField: TypeAlias = Annotated[StageConfig, StageKind("design", default_impl=None)]
NormalEquationsField: TypeAlias = Annotated[
    StageConfig, StageKind("normal_equations", default_impl="svd")
]
SolveField: TypeAlias = Annotated[StageConfig, StageKind("solve", default_impl="lstsq")]
ModelField: TypeAlias = Annotated[StageConfig, StageKind("model", default_impl="multidim_linear")]
TrainField: TypeAlias = Annotated[StageConfig, StageKind("train", default_impl="none")]
WriteField: TypeAlias = Annotated[StageConfig, StageKind("write", default_impl="netcdf")]


class PipelineConfig(BaseModel):
    """Everything one run needs: one config per stage, plus cache and execution settings."""

    model_config = ConfigDict(frozen=True, extra="forbid", title="gridsolve pipeline")

    load: LoadField
    design: DesignField
    normal_equations: NormalEquationsField = SVDNormalEquations()
    solve: SolveField = LstsqSolve()
    train: TrainField = NoTrain()
    #: no section: no model (a section without ``impl`` is the multidim linear model)
    model: ModelField = NoModel()
    write: WriteField = NetCDFWrite()
    cache: CacheConfig = CacheConfig()
    execution: ExecutionConfig = ExecutionConfig()

    @model_validator(mode="before")
    @classmethod
    def _implied_sections(cls, data: Any) -> Any:
        """Sections a given stage implies when left out (``solve: curvefit``: no design).

        Each config class says which (``StageConfig.implies``); a section given
        explicitly is kept, and its cross-stage rules judge it.
        """
        if not isinstance(data, Mapping):
            return data
        out = dict(data)
        for kind, mark in _stage_kinds().items():
            value = data.get(kind)
            impl = (
                value.impl
                if isinstance(value, StageConfig)
                else value.get("impl", mark.default_impl)
                if isinstance(value, Mapping)
                else mark.default_impl
            )
            conf_cls = _config_classes(kind).get(str(impl))
            for other, other_impl in (conf_cls.implies if conf_cls is not None else {}).items():
                out.setdefault(other, {"impl": other_impl})
        return out

    @model_validator(mode="after")
    def _cross_stage(self) -> PipelineConfig:
        problems = cross_stage_problems(self.stage_configs())
        if problems:
            raise ValueError("; ".join(problems))
        return self

    def stage_configs(self) -> dict[str, StageConfig]:
        """The stage configs by kind, in the order of the fields."""
        return {k: getattr(self, k) for k in STAGE_KINDS}

    def to_yaml(self) -> str:
        """The config as the YAML file ``gridsolve run`` reads, every field explicit."""
        import yaml

        return str(yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False))


def _stage_kinds() -> dict[str, StageKind]:
    out = {}
    for name, info in PipelineConfig.model_fields.items():
        marks = [m for m in info.metadata if isinstance(m, StageKind)]
        if marks:
            out[name] = marks[0]
    return out


#: The stage kinds (the fields of PipelineConfig that take a stage config).
STAGE_KINDS: tuple[str, ...] = tuple(_stage_kinds())
#: Each kind's implementation when a section names none (None: ``impl`` is required).
DEFAULT_IMPL: dict[str, str | None] = {k: m.default_impl for k, m in _stage_kinds().items()}


def cross_stage_problems(stages: Mapping[str, StageConfig]) -> list[str]:
    """Violations that involve two stages' configs (each a sentence with its fix)."""
    return [p for conf in stages.values() for p in conf.cross_stage(stages)]


def config_error_from_validation(err: ValidationError, source: str = "config") -> ConfigError:
    """One ConfigError listing every pydantic violation with its dotted location."""
    violations = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"]) or "(top level)"
        msg = e["msg"]
        if e["type"] == "extra_forbidden":
            msg = "unknown key (remove it or check the spelling)"
        elif e["type"] == "missing" and loc == "design":
            msg = (
                "required: the linear model fitted at every pixel has no default for your "
                "data — e.g. {impl: polynomial, degree: 1} (a trend) or {impl: harmonic, "
                "harmonics: 1} (a trend and the annual cycle); only a demo load implies the "
                "demo's design"
            )
        elif e["type"] == "missing":
            msg = "required field is missing"
        elif (
            "input" in e
            and e["loc"]  # a cross-stage rule's input is the whole config: not echoed
            and e["type"] not in ("unknown_impl", "missing_impl")
            and "storage_options" not in loc  # may hold a secret: never echoed
        ):
            msg = f"{msg} (found {e['input']!r})"
        violations.append(f"{loc}: {msg}")
    return ConfigError(
        f"invalid {source} ({len(violations)} problem{'s' if len(violations) != 1 else ''})",
        violations=violations,
        fix="correct the fields listed; `gridsolve schema` prints every field with its meaning",
    )


def build_config(raw: Mapping[str, Any], source: str = "config") -> PipelineConfig:
    """Validate a raw mapping into a PipelineConfig, or raise one ConfigError with every problem."""
    raw = dict(raw)
    load = raw.get("load")
    if isinstance(load, Mapping) and load.get("impl") == "demo":
        # the demo cube was made for the demo's design and model: as the deployments' defaults
        for kind in ("design", "model"):
            raw.setdefault(kind, DEMO_DEFAULTS[kind])
    try:
        return PipelineConfig.model_validate(raw)
    except ValidationError as err:
        raise config_error_from_validation(err, source) from None


def section(conf: StageConfig) -> dict[str, Any]:
    """A stage config as a YAML section: ``impl`` and the fields it was built with."""
    return {"impl": conf.impl, **conf.model_dump(mode="json", exclude_unset=True)}


class DemoSections(NamedTuple):
    """The sections of the embedded default run that differ from PipelineConfig's defaults."""

    load: StageConfig
    design: StageConfig
    model: StageConfig


#: The embedded default run (the original problem): a seeded 50-observation cube,
#: a 50×100 random design, the 10×10→4 multidim linear model. The flow's
#: parameter defaults, ``gridsolve demo`` and the benchmarks start from it.
DEMO = DemoSections(
    load=DemoLoad(size="small"),
    design=RandomDesign(coef=100, seed=0),
    model=MultidimLinearModel(input_dim=10, hidden_dim=10, output_dim=4),
)
#: :data:`DEMO` as a raw mapping of sections.
DEMO_DEFAULTS: dict[str, Any] = {k: section(v) for k, v in DEMO._asdict().items()}
