"""What every stage implementation's config is built from (the plugin author's surface).

:class:`StageConfig` is the base of each implementation's frozen pydantic
model. Fields built with :func:`speed_field` change only how fast or where a
stage runs (device, chunk sizes); they are left out of cache keys. Fields built
with :func:`path_field` are file paths, resolved against the config file's
folder; :func:`input_file_field` paths are also keyed by their content.
"""

from __future__ import annotations

import os
import re
import types
from collections.abc import Mapping
from typing import Annotated, Any, ClassVar, Union, get_args, get_origin

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationInfo, field_validator

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


def housekeeping_field(default: Any, description: str, **kwargs: Any) -> Any:
    """A field about tidying up (how many old outputs to keep): never in cache keys."""
    return Field(
        default,
        description=f"{description} Housekeeping only: not part of the cache key.",
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


#: Option names that hold secrets: refused in configs (which Prefect stores and shows).
_SECRET_WORDS = (
    "secret|password|passwd|token|credential|^key$|access_?key|session|customer_?key|sse|kms"
)
_SECRET = re.compile(_SECRET_WORDS, re.IGNORECASE)


def _any_case(pattern: str) -> str:
    """``pattern`` matching either case letter by letter (``key`` → ``[kK][eE][yY]``).

    JSON Schema patterns are ECMA-262 regular expressions, with no inline
    case-insensitive flag that both the server's validator and the UI's accept.
    """
    return "".join(f"[{c.lower()}{c.upper()}]" if c.isalpha() else c for c in pattern)


def _no_secret_keys(depth: int) -> dict[str, Any]:
    """JSON Schema: an object none of whose keys, ``depth`` levels down, names a secret."""
    schema: dict[str, Any] = {"propertyNames": {"not": {"pattern": _any_case(_SECRET_WORDS)}}}
    if depth > 1:  # keywords of objects are ignored for other values: no type test needed
        schema["additionalProperties"] = _no_secret_keys(depth - 1)
    return schema


def check_storage_options(options: dict[str, Any]) -> dict[str, Any]:
    """``options`` unchanged; ValueError naming any option that holds a secret (nested too)."""

    def walk(value: Any, where: str) -> list[str]:
        if isinstance(value, list | tuple):
            return [f for i, v in enumerate(value) for f in walk(v, f"{where}[{i}]")]
        if not isinstance(value, dict):
            return []
        found = []
        for k, v in value.items():
            name = f"{where}.{k}" if where else str(k)
            if _SECRET.search(str(k)):
                found.append(name)
            found += walk(v, name)
        return found

    secrets = walk(options, "")
    if secrets:
        raise ValueError(
            f"storage_options may not hold credentials ({', '.join(secrets)}): a config is "
            "stored and shown by the Prefect server. Set AWS_ACCESS_KEY_ID and "
            "AWS_SECRET_ACCESS_KEY (or AWS_PROFILE) in the environment of every process that "
            "runs gridsolve instead"
        )
    return options


#: A ``storage_options`` mapping, checked to hold no credentials.
StorageOptions = Annotated[dict[str, Any], AfterValidator(check_storage_options)]


def storage_options_field() -> Any:
    """``storage_options`` of an object-store URL: endpoint, region, … (never credentials)."""
    return Field(
        default_factory=dict,
        description="Options of the fsspec filesystem of s3:// (or other) URLs, e.g. "
        "{endpoint_url: http://minio:9000, client_kwargs: {region_name: eu-west-1}}. "
        "Credentials are refused here: they come from the environment (AWS_ACCESS_KEY_ID, "
        "AWS_SECRET_ACCESS_KEY, AWS_PROFILE). Where data is, not what it is: not part of the "
        "cache key.",
        # In the JSON schema too: a deployment enforcing its parameter schema refuses a
        # credential before the run (and its stored parameters) exists (checked 3 deep).
        json_schema_extra={_SPEED: True, **_no_secret_keys(3)},
    )


#: URL schemes gridsolve reads and writes: S3 and S3-compatible stores, whose objects
#: carry an ETag (the content checksum that keys inputs without downloading them).
URL_SCHEMES = ("s3",)


def is_url(path: str) -> bool:
    """Whether ``path`` is a URL (``s3://…``), not a local path (``file://`` is local)."""
    return bool(re.match(r"^[A-Za-z][A-Za-z0-9+.-]*://", path)) and not path.lower().startswith(
        "file://"
    )


def check_url(path: str) -> str:
    """``path``; ValueError for a URL of a scheme gridsolve does not support."""
    if is_url(path) and path.split("://", 1)[0].lower() not in URL_SCHEMES:
        raise ValueError(
            f"{path!r}: only {', '.join(s + '://' for s in URL_SCHEMES)} URLs are supported "
            "(objects are keyed by their ETags); copy other data to a local path or a bucket"
        )
    return path


def _field_flag(model: type[BaseModel], name: str, flag: str) -> bool:
    extra = model.model_fields[name].json_schema_extra
    return isinstance(extra, dict) and bool(extra.get(flag))


def _numbers_only(annotation: Any) -> bool:
    """Whether a field takes numbers and nothing else (``int``, ``float | None``, …)."""
    union = get_origin(annotation) in (Union, types.UnionType)
    kinds = [a for a in (get_args(annotation) if union else (annotation,)) if a is not type(None)]
    return bool(kinds) and all(a in (int, float) for a in kinds)


class NoBoolNumbers(BaseModel):
    """A model whose number fields refuse ``true``/``false``.

    Pydantic reads a bool as 1 or 0 where a number is expected, so
    ``--set design.degree=true`` was a degree-1 fit: a bool there is always a
    mistake, in a file, on the command line or in the Prefect form alike. Text
    with ``_`` (``1_0``, text in YAML 1.2) is refused too: pydantic reads it as
    Python does, 10, as YAML 1.1 would.
    """

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_for_a_number(cls, value: Any, info: ValidationInfo) -> Any:
        field = cls.model_fields.get(info.field_name or "")
        if field is None or not _numbers_only(field.annotation):
            return value
        if isinstance(value, bool):
            raise ValueError(f"{str(value).lower()} is a bool, where a number is expected")
        if isinstance(value, str) and "_" in value:
            raise ValueError(f"{value!r} is text (YAML 1.2), where a number is expected")
        return value


class StageConfig(NoBoolNumbers):
    """Base of every stage implementation's config: frozen, no unknown keys."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    impl: str

    #: the stage kind this config belongs to; set by each concrete family.
    kind: ClassVar[str] = ""
    #: other kinds' ``impl`` when a run with this config leaves their section out
    #: (``solve: curvefit`` reads no design: ``{"design": "none"}``)
    implies: ClassVar[Mapping[str, str]] = {}

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

    @property
    def active(self) -> bool:
        """Whether the stage runs at all; ``False`` leaves it out of the plan (``train: none``)."""
        return True

    def peer_payload(self) -> dict[str, Any]:
        """What a stage that reads this config as a peer depends on (its share of that key).

        Defaults to :meth:`key_payload`; a config narrows it to the fields that
        matter to others (the model: its module, not what it outputs).
        """
        return self.key_payload()

    def cross_stage(self, stages: Mapping[str, StageConfig]) -> list[str]:
        """What this config needs from the other stages' configs and lacks (sentences with fixes).

        ``stages`` holds every stage's config by kind. Implementations override
        it; a rule lives with the config it belongs to, never in a list that
        names implementations.
        """
        return []

    def imported_modules(self) -> list[str]:
        """Modules the stage imports because the config names them (``model.target``)."""
        return []

    def input_files(self) -> dict[str, str | list[str]]:
        """Absolute path(s) of each input this config names (the paths used by a run)."""
        out: dict[str, str | list[str]] = {}
        for name in sorted(self.content_keyed_fields()):
            value = getattr(self, name)
            if isinstance(value, str):
                out[name] = _absolute(value)
            elif isinstance(value, list) and all(isinstance(v, str) for v in value):
                out[name] = [_absolute(v) for v in value]
        return out


def _absolute(path: str) -> str:
    return path if is_url(path) else os.path.abspath(os.path.expanduser(path))


def needs_load_field(stages: Mapping[str, StageConfig], field: str, problem: str) -> list[str]:
    """``[problem]`` when the load section leaves ``field`` unset, else ``[]``.

    For :meth:`StageConfig.cross_stage` rules such as "objective mse needs
    load.target"; ``problem`` is the sentence, its fix included.
    """
    if getattr(stages.get("load"), field, None) is None:
        return [problem]
    return []
