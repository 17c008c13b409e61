"""User configuration: one frozen pydantic model per stage implementation.

Each stage kind (``load``, ``design``, ``normal_equations``, ``solve``,
``model``, ``write``) accepts any registered implementation; the ``impl`` field
selects it and validation then uses that implementation's model, so a typo in a
field or an unknown ``impl`` is reported before anything runs. The models of
the built-in implementations live here; plugins bring their own (see
``gridsolve.stages.engine.registry.register`` and ``gridsolve.schemas.catalog``).

Fields built with :func:`speed_field` change only how fast or where a stage
runs (device, chunk sizes); they are left out of cache keys. Fields built with
:func:`path_field` are file paths, resolved against the config file's folder.
"""

from __future__ import annotations

import difflib
import json
import os
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal, TypeAlias

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError, core_schema

from gridsolve.schemas import catalog
from gridsolve.schemas.errors import ConfigError

STAGE_KINDS: tuple[str, ...] = (
    "load",
    "design",
    "normal_equations",
    "solve",
    "model",
    "write",
)

#: Placeholders allowed in templated paths (``load.path``, ``write.path``).
TEMPLATE_FIELDS = frozenset(
    {"date", "scheduled_date", "scheduled_time", "flow_run_name", "flow_run_id", "deployment"}
)

_SPEED = "speed_only"
_PATH = "is_path"
_CONTENT = "keyed_by_content"


def speed_field(default: Any, description: str, **kwargs: Any) -> Any:
    """A field that changes only speed or placement, never results (not in cache keys)."""
    return Field(
        default,
        description=f"{description} Speed only: not part of the cache key.",
        json_schema_extra={_SPEED: True},
        **kwargs,
    )


def path_field(default: Any, description: str, **kwargs: Any) -> Any:
    """A file path, resolved against the config file's folder when relative."""
    return Field(default, description=description, json_schema_extra={_PATH: True}, **kwargs)


def input_file_field(default: Any, description: str, **kwargs: Any) -> Any:
    """An input file path: the stage's key covers the file's content, never its name.

    The stage's fingerprint hashes the content; the path itself is left out of
    the key so that a touched, copied or renamed file with the same bytes is a
    cache hit. The path used is still recorded per run (and in the output).
    """
    return Field(
        default,
        description=f"{description} Cached by the file's content, not its path or mtime.",
        json_schema_extra={_PATH: True, _CONTENT: True},
        **kwargs,
    )


def check_template(text: str) -> str:
    """``text`` unchanged if its ``{placeholders}`` are all known, else ValueError."""
    unknown = set(re.findall(r"{(\w*)}", text)) - TEMPLATE_FIELDS
    if unknown:
        raise ValueError(
            f"unknown placeholder(s) {sorted(unknown)}; allowed: {sorted(TEMPLATE_FIELDS)}"
        )
    return text


def _field_flag(model: type[BaseModel], name: str, flag: str) -> bool:
    extra = model.model_fields[name].json_schema_extra
    return isinstance(extra, dict) and bool(extra.get(flag))


class StageConfig(BaseModel):
    """Base of every stage implementation's config: frozen, no unknown keys."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    impl: str

    #: the stage kind this config belongs to; set by each concrete family.
    kind: ClassVar[str] = ""

    @classmethod
    def speed_fields(cls) -> frozenset[str]:
        """Names of fields that do not affect results."""
        return frozenset(n for n in cls.model_fields if _field_flag(cls, n, _SPEED))

    @classmethod
    def path_fields(cls) -> frozenset[str]:
        """Names of fields holding file paths."""
        return frozenset(n for n in cls.model_fields if _field_flag(cls, n, _PATH))

    @classmethod
    def content_keyed_fields(cls) -> frozenset[str]:
        """Names of input file fields whose content (not path) the stage's key covers."""
        return frozenset(n for n in cls.model_fields if _field_flag(cls, n, _CONTENT))

    def key_payload(self) -> dict[str, Any]:
        """The JSON form of every result-affecting field (what cache keys hash).

        Leaves out speed-only fields, and input file paths, whose content the
        stage's fingerprint covers instead.
        """
        exclude = set(self.speed_fields()) | set(self.content_keyed_fields())
        return self.model_dump(mode="json", exclude=exclude)

    def cross_stage(self, stages: Mapping[str, StageConfig]) -> list[str]:
        """What this config needs from the other stages' configs and lacks (sentences with fixes).

        ``stages`` holds every stage's config by kind. Implementations override
        it; a rule lives with the config it belongs to, never in a list that
        names implementations.
        """
        return []

    def input_files(self) -> dict[str, str]:
        """Absolute path of each input file this config names (the paths used by a run)."""
        out = {}
        for name in sorted(self.content_keyed_fields()):
            value = getattr(self, name)
            if isinstance(value, str):
                out[name] = os.path.abspath(os.path.expanduser(value))
        return out


# ---------------------------------------------------------------- load
class LoadConfig(StageConfig):
    """Family of ``load`` implementations."""

    kind: ClassVar[str] = "load"


class NetCDFLoad(LoadConfig):
    """Read a cube ``(obs, y, x)`` and optional helper variables from a NetCDF file."""

    model_config = ConfigDict(title="Load a NetCDF file")

    impl: Literal["netcdf"] = "netcdf"
    path: str = input_file_field(
        ...,
        "NetCDF file to read. May contain {date}, {scheduled_date}, {flow_run_name} placeholders.",
        min_length=1,
    )
    variable: str | None = Field(
        None, description="Data variable holding the cube; inferred when the file has exactly one."
    )
    obs_dim: str | None = Field(
        None, description="Observation dimension (time, band); inferred when omitted."
    )
    y_dim: str | None = Field(None, description="Row dimension; inferred (y, lat, latitude, row).")
    x_dim: str | None = Field(
        None, description="Column dimension; inferred (x, lon, longitude, col)."
    )
    design: str | None = Field(
        None, description="Variable with dims (obs, coef) to use as the design matrix."
    )
    weights: str | None = Field(
        None,
        description="Variable of per-observation weights, dims (obs,) or (obs, y, x); "
        "e.g. inverse variances. Zero excludes an observation.",
    )
    target: str | None = Field(
        None, description="Variable with dims (output, y, x) or (y, x): the model's MSE target."
    )

    @field_validator("path")
    @classmethod
    def _known_placeholders(cls, v: str) -> str:
        return check_template(v)


class DemoLoad(LoadConfig):
    """A seeded synthetic cube, written once as NetCDF under the cache root, then read."""

    model_config = ConfigDict(title="Demo cube")

    impl: Literal["demo"] = "demo"
    size: Literal["small", "seed"] = Field(
        "small", description="small: 50×64×64; seed: 50×500×500, the original problem's size."
    )
    seed: int = Field(0, ge=0, description="Random seed of the synthetic data.")
    nan_fraction: float = Field(
        0.0, ge=0.0, lt=1.0, description="Fraction of observations set to NaN (gaps)."
    )


# ---------------------------------------------------------------- design
class DesignConfig(StageConfig):
    """Family of ``design`` implementations."""

    kind: ClassVar[str] = "design"


class VariableDesign(DesignConfig):
    """The design matrix stored in the input file (named by ``load.design``)."""

    model_config = ConfigDict(title="Design from a variable")

    impl: Literal["variable"] = "variable"

    def cross_stage(self, stages: Mapping[str, StageConfig]) -> list[str]:
        """The variable's name must be given in the load section."""
        if getattr(stages.get("load"), "design", None) is None:
            return ["design impl 'variable' needs the variable's name: set load.design"]
        return []


class PolynomialDesign(DesignConfig):
    """Polynomial in the observation coordinate: columns t^0 … t^degree."""

    model_config = ConfigDict(title="Polynomial design")

    impl: Literal["polynomial"] = "polynomial"
    degree: int = Field(2, ge=0, le=30, description="Highest power.")
    scale: bool = Field(
        True,
        description="Centre and scale the coordinate to [-1, 1] first (well conditioned); "
        "false uses raw coordinate values (datetimes: days since 1970-01-01).",
    )


class HarmonicDesign(DesignConfig):
    """Mean, optional linear trend, and cos/sin pairs of a period and its harmonics."""

    model_config = ConfigDict(title="Harmonic design")

    impl: Literal["harmonic"] = "harmonic"
    harmonics: int = Field(2, ge=1, le=100, description="Number of cos/sin pairs.")
    period: float | None = Field(
        None,
        gt=0,
        description="Base period in coordinate units (days for datetimes). "
        "Default: 365.25 days for datetimes, else the coordinate span.",
    )
    trend: bool = Field(True, description="Add a linear trend column.")


class RandomDesign(DesignConfig):
    """A seeded standard-normal matrix, like the original problem's randn(50, 100)."""

    model_config = ConfigDict(title="Random design")

    impl: Literal["random"] = "random"
    coef: int = Field(100, ge=1, le=100_000, description="Number of coefficients (columns).")
    seed: int = Field(0, ge=0, description="Random seed.")


# ---------------------------------------------------------------- normal equations
class NormalEquationsConfig(StageConfig):
    """Family of ``normal_equations`` implementations."""

    kind: ClassVar[str] = "normal_equations"


class SVDNormalEquations(NormalEquationsConfig):
    """Float64 Gram matrix AᵀWA and the SVD of W^½A of the shared design."""

    model_config = ConfigDict(title="Shared normal equations (float64 SVD)")

    impl: Literal["svd"] = "svd"


# ---------------------------------------------------------------- solve
class SolveConfig(StageConfig):
    """Family of ``solve`` implementations."""

    kind: ClassVar[str] = "solve"


Policy = Literal["minnorm", "cholesky", "ridge"]


class LstsqSolve(SolveConfig):
    """Least squares at every pixel, shared factorisation or per-pixel when data are missing."""

    model_config = ConfigDict(title="Least-squares solve")

    impl: Literal["lstsq"] = "lstsq"
    policy: Policy = Field(
        "minnorm",
        description="minnorm: minimum-norm solution by SVD with a cutoff (right when coef > obs); "
        "cholesky: error if the system is singular; ridge: add ridge·I.",
    )
    ridge: float = Field(
        0.0, ge=0.0, description="Ridge λ ≥ 0 (used by policy=ridge and fallback=ridge)."
    )
    rcond: float | None = Field(
        None,
        ge=0.0,
        lt=1.0,
        description="Relative singular-value cutoff for minnorm; default eps·max(obs, coef).",
    )
    min_valid: int | None = Field(
        None,
        ge=1,
        description="Fewest valid observations for a pixel to be solved; "
        "default coef for cholesky, 1 for minnorm and ridge.",
    )
    fallback: Literal["minnorm", "ridge", "none"] = Field(
        "minnorm",
        description="For a pixel whose own factorisation fails: solve it this way (flagged), "
        "or none (NaN, flagged singular).",
    )
    dtype: Literal["float32", "float64"] = Field(
        "float32",
        description="dtype of the data product and of the coefficients written; "
        "factorisations are always float64.",
    )
    uncertainty: Literal["none", "stderr", "cov"] = Field(
        "none",
        description="Per-pixel uncertainty of the coefficients: none; stderr (standard errors, "
        "t-statistics, two-sided p-values, degrees of freedom, R²); or cov (also the full "
        "coefficient covariance). Not identifiable coefficients (minimum norm on a "
        "rank-deficient design) get NaN.",
    )
    cov_scale: Literal["residual", "unscaled"] = Field(
        "residual",
        description="residual: scale the covariance by the residual variance Σw·r²/dof "
        "(statsmodels OLS/WLS, numpy.polyfit cov=True); unscaled: weights are 1/σ² of known "
        "errors, no scaling (numpy's cov='unscaled'), p-values from the normal distribution.",
    )
    device: str = speed_field(
        "auto", "auto, cpu, cuda or cuda:N.", pattern=r"^(auto|cpu|cuda(:\d+)?)$"
    )
    chunk_pixels: int | None = speed_field(
        None, "Pixels per batched chunk; default from the memory budget.", ge=1
    )

    @model_validator(mode="after")
    def _ridge_needs_lambda(self) -> LstsqSolve:
        if self.policy == "ridge" and self.ridge <= 0:
            raise ValueError("policy=ridge needs ridge > 0 (e.g. ridge: 1e-3)")
        if self.fallback == "ridge" and self.ridge <= 0:
            raise ValueError("fallback=ridge needs ridge > 0 (e.g. ridge: 1e-3)")
        return self


# ---------------------------------------------------------------- model
class ModelConfig(StageConfig):
    """Family of ``model`` implementations; the fields here are shared by all."""

    kind: ClassVar[str] = "model"

    weights: str | None = input_file_field(
        None,
        "Weights file: .safetensors, or a state dict saved with torch.save (loaded with "
        "weights_only=True). Omitted: seeded initialisation.",
    )
    seed: int = Field(0, ge=0, description="Seed of the initial weights when no file is given.")
    objective: Literal["sum", "mse"] = Field(
        "sum",
        description="Per-sample objective whose gradient is returned: sum of the outputs, "
        "or mean squared error against load.target.",
    )
    wrt: Literal["params", "input", "both"] = Field(
        "params", description="Gradients with respect to the parameters, the input, or both."
    )
    jacobian: bool = Field(
        False, description="Also write the full per-sample Jacobian of the outputs."
    )
    dtype: Literal["float32", "float64"] = Field("float32", description="Model dtype.")
    mode: Literal["eval", "train"] = Field(
        "eval",
        description="Module mode: eval (default; BatchNorm uses the checkpoint's running "
        "statistics, Dropout is off) or train. train is allowed only where it stays "
        "per-sample and deterministic: a model with BatchNorm (statistics across pixels) "
        "or Dropout/RReLU (random masks that would depend on the tiling) is refused.",
    )
    device: str = speed_field(
        "auto", "auto, cpu, cuda or cuda:N.", pattern=r"^(auto|cpu|cuda(:\d+)?)$"
    )
    chunk_pixels: int | None = speed_field(
        None, "Pixels per vmap chunk; default from the memory budget.", ge=1
    )
    compile: Literal["auto", "always", "never"] = speed_field(
        "auto",
        "torch.compile the per-pixel function: auto (when the grid has at least four million "
        "pixels, where compiling pays), always, or never. A compiled function is checked "
        "against the eager one on the first pixels of each process within the agreement "
        "bound, and any compile failure or disagreement falls back to eager.",
    )

    def cross_stage(self, stages: Mapping[str, StageConfig]) -> list[str]:
        """Objective mse needs the target variable named in the load section."""
        if self.objective == "mse" and getattr(stages.get("load"), "target", None) is None:
            return ["model objective 'mse' needs a target: set load.target"]
        return []


class MultidimLinearModel(ModelConfig):
    """The multidim linear model: tensordot(x, weight, 2) + bias, x of (input_dim, hidden_dim)."""

    model_config = ConfigDict(title="Multidim linear model")

    impl: Literal["multidim_linear"] = "multidim_linear"
    input_dim: int = Field(10, ge=1, description="First input dim (coef = input_dim·hidden_dim).")
    hidden_dim: int = Field(10, ge=1, description="Second input dim.")
    output_dim: int = Field(4, ge=1, description="Number of outputs.")


class ModuleModel(ModelConfig):
    """Any single-sample torch.nn.Module given by import path, batched unchanged with vmap."""

    model_config = ConfigDict(title="Your own single-sample module")

    impl: Literal["module"] = "module"
    target: str = Field(
        ...,
        description="Import path package.module:Class of a single-sample nn.Module.",
        pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$",
    )
    kwargs: dict[str, Any] = Field(
        default_factory=dict, description="Keyword arguments of the constructor."
    )
    input_shape: tuple[int, ...] = Field(
        ..., min_length=1, description="Shape of one sample's input; must multiply to coef."
    )


# ---------------------------------------------------------------- write
class WriteConfig(StageConfig):
    """Family of ``write`` implementations."""

    kind: ClassVar[str] = "write"


class NetCDFWrite(WriteConfig):
    """One NetCDF file with the output contract, written atomically."""

    model_config = ConfigDict(title="Write NetCDF")

    impl: Literal["netcdf"] = "netcdf"
    path: str = path_field(
        "gridsolve-output.nc",
        "Output file. May contain {date}, {scheduled_date}, {flow_run_name}, {flow_run_id}.",
        min_length=1,
    )
    zlib: bool = Field(True, description="zlib-compress the variables.")
    complevel: int = Field(1, ge=0, le=9, description="zlib level (1 is fast, 9 is small).")
    shuffle: bool = Field(True, description="HDF5 byte shuffle before compression.")
    chunks: dict[str, int] | None = Field(
        None,
        description="Chunk size per dim name, e.g. {y: 256, x: 256}; "
        "default: 1 along leading dims, 256×256 spatially.",
    )
    overwrite: bool = Field(True, description="Replace an existing file (atomically).")
    layout: Literal["nested", "flat"] = Field(
        "nested",
        description="nested: every parameter dim of a gradient or Jacobian is its own dim. "
        "flat: a variable's dims before (y, x) become one labelled dim <name>_index, "
        "so tools that read at most one extra dim (CDO, Panoply) read every variable.",
    )

    @field_validator("path")
    @classmethod
    def _known_placeholders(cls, v: str) -> str:
        return check_template(v)

    @model_validator(mode="after")
    def _positive_chunks(self) -> NetCDFWrite:
        if self.chunks is not None and any(v < 1 for v in self.chunks.values()):
            raise ValueError("write.chunks sizes must be >= 1")
        return self


# ---------------------------------------------------------------- run-wide settings
class CacheConfig(BaseModel):
    """Where stage outputs are stored, keyed by content hash."""

    model_config = ConfigDict(frozen=True, extra="forbid", title="Cache")

    root: str = path_field(
        ".gridsolve-cache",
        "Folder of the content-addressed store (shared by every worker at scale).",
        min_length=1,
    )
    enabled: bool = Field(True, description="Reuse stored stage outputs; false recomputes all.")


_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*$", re.IGNORECASE)
_UNITS = {
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_size(text: str | int) -> int:
    """Bytes in a size such as ``"2GiB"``, ``"512MB"`` or ``1048576``."""
    if isinstance(text, int):
        return text
    m = _SIZE_RE.match(text)
    if not m:
        raise ValueError(f"not a size: {text!r} (examples: 2GiB, 512MiB, 1000000)")
    return int(float(m.group(1)) * _UNITS[(m.group(2) or "B").lower()])


class ExecutionConfig(BaseModel):
    """How the pipeline runs. Nothing here changes results or cache keys."""

    model_config = ConfigDict(frozen=True, extra="forbid", title="Execution")

    memory_budget: str = Field(
        "1GiB",
        description="Memory one tile may use (per worker, per device); sets the tile size.",
        pattern=_SIZE_RE.pattern,
    )
    tile_pixels: int | None = Field(
        None, ge=1, description="Pixels per tile; default from the memory budget."
    )
    runner: Literal["threads", "dask"] = Field(
        "threads",
        description="threads: this machine; dask: a Dask cluster (LocalCluster or address).",
    )
    dask_address: str | None = Field(
        None, description="Scheduler address (tcp://host:8786); omitted: start a LocalCluster."
    )
    dask_workers: int = Field(2, ge=1, le=256, description="LocalCluster worker processes.")
    max_workers: int = Field(
        2, ge=1, le=256, description="Concurrent tile tasks with the threads runner."
    )

    @property
    def memory_budget_bytes(self) -> int:
        """The memory budget in bytes."""
        return parse_size(self.memory_budget)


# ---------------------------------------------------------------- registry-backed fields
DEFAULT_IMPL: dict[str, str | None] = {
    "load": "netcdf",
    "design": None,
    "normal_equations": "svd",
    "solve": "lstsq",
    "model": "multidim_linear",
    "write": "netcdf",
}


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


class _RegistryUnion:
    """A union of every registered config of one stage kind, discriminated on ``impl``."""

    def __init__(self, kind: str) -> None:
        self.kind = kind

    def validate(self, value: Any) -> StageConfig:
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
        impl = value.get("impl", DEFAULT_IMPL[self.kind])
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
            variants.append(_inline_refs(js, js.get("$defs", {})))
        if len(variants) == 1:
            only: dict[str, Any] = variants[0]
            return only
        return {"anyOf": variants}


# The type of each stage's parameter: any registered implementation's config.
LoadField: TypeAlias = Annotated[StageConfig, _RegistryUnion("load")]
DesignField: TypeAlias = Annotated[StageConfig, _RegistryUnion("design")]
NormalEquationsField: TypeAlias = Annotated[StageConfig, _RegistryUnion("normal_equations")]
SolveField: TypeAlias = Annotated[StageConfig, _RegistryUnion("solve")]
ModelField: TypeAlias = Annotated[StageConfig, _RegistryUnion("model")]
WriteField: TypeAlias = Annotated[StageConfig, _RegistryUnion("write")]


class PipelineConfig(BaseModel):
    """Everything one run needs: one config per stage, plus cache and execution settings."""

    model_config = ConfigDict(frozen=True, extra="forbid", title="gridsolve pipeline")

    load: LoadField
    design: DesignField
    normal_equations: NormalEquationsField = SVDNormalEquations()
    solve: SolveField = LstsqSolve()
    model: ModelField = MultidimLinearModel()
    write: WriteField = NetCDFWrite()
    cache: CacheConfig = CacheConfig()
    execution: ExecutionConfig = ExecutionConfig()

    @model_validator(mode="after")
    def _cross_stage(self) -> PipelineConfig:
        problems = cross_stage_problems(self.stage_configs())
        if problems:
            raise ValueError("; ".join(problems))
        return self

    def stage_configs(self) -> dict[str, StageConfig]:
        """The stage configs by kind, in pipeline order."""
        return {k: getattr(self, k) for k in STAGE_KINDS}


def cross_stage_problems(stages: Mapping[str, StageConfig]) -> list[str]:
    """Violations that involve two stages' configs (each a sentence with its fix)."""
    return [p for conf in stages.values() for p in conf.cross_stage(stages)]


DEMO_DEFAULTS: dict[str, Any] = {
    "load": {"impl": "demo", "size": "small"},
    "design": {"impl": "random", "coef": 100, "seed": 0},
    "model": {"impl": "multidim_linear", "input_dim": 10, "hidden_dim": 10, "output_dim": 4},
}


# ---------------------------------------------------------------- reading configs
def config_error_from_validation(err: ValidationError, source: str = "config") -> ConfigError:
    """One ConfigError listing every pydantic violation with its dotted location."""
    violations = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"]) or "(top level)"
        msg = e["msg"]
        if e["type"] == "extra_forbidden":
            msg = "unknown key (remove it or check the spelling)"
        elif e["type"] == "missing":
            msg = "required field is missing"
        elif "input" in e and e["type"] not in ("unknown_impl", "missing_impl"):
            msg = f"{msg} (found {e['input']!r})"
        violations.append(f"{loc}: {msg}")
    return ConfigError(
        f"invalid {source} ({len(violations)} problem{'s' if len(violations) != 1 else ''})",
        violations=violations,
        fix="correct the fields listed; `gridsolve schema` prints every field with its meaning",
    )


def _parse_value(text: str) -> Any:
    try:
        return yaml.safe_load(text)
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


def resolve_paths(raw: dict[str, Any], base: Path) -> dict[str, Any]:
    """``raw`` with relative path fields made absolute against ``base``."""
    out: dict[str, Any] = json.loads(json.dumps(raw))
    classes_by_kind = {k: _config_classes(k) for k in STAGE_KINDS}
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
            if isinstance(v, str) and v and "://" not in v and not Path(v).is_absolute():
                section[f] = str((base / v).resolve())
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
        raw = yaml.safe_load(p.read_text())
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


def build_config(raw: Mapping[str, Any], source: str = "config") -> PipelineConfig:
    """Validate a raw mapping into a PipelineConfig, or raise one ConfigError with every problem."""
    try:
        return PipelineConfig.model_validate(dict(raw))
    except ValidationError as err:
        raise config_error_from_validation(err, source) from None


def load_config(path: str | Path, overrides: Iterable[str] = ()) -> PipelineConfig:
    """Read, override, resolve and validate a config file."""
    p = Path(path)
    raw = apply_overrides(read_config_file(p), overrides)
    raw = resolve_paths(raw, p.resolve().parent)
    return build_config(raw, source=f"config {p}")


def config_to_yaml(cfg: PipelineConfig) -> str:
    """The config as YAML, every field explicit."""
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)


def render_template(text: str, values: Mapping[str, str]) -> str:
    """``text`` with its ``{name}`` placeholders replaced by ``values``.

    Values become single path components: anything but letters, digits, ``-``,
    ``_`` and ``.`` is replaced by ``_``, and ``..`` cannot be produced, so a
    run name can never move a path to another folder.
    """

    def safe(name: str) -> str:
        value = re.sub(r"[^\w.-]", "_", values[name])
        return re.sub(r"\.\.+", "_", value) or "_"

    return re.sub(r"{(\w+)}", lambda m: safe(m.group(1)), text)


for _builtin in (
    NetCDFLoad,
    DemoLoad,
    VariableDesign,
    PolynomialDesign,
    HarmonicDesign,
    RandomDesign,
    SVDNormalEquations,
    LstsqSolve,
    MultidimLinearModel,
    ModuleModel,
    NetCDFWrite,
):
    catalog.add(_builtin)
