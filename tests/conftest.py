"""Shared fixtures: seeded cubes written as real NetCDF, a store, and a real Prefect server.

The Prefect server is a real ``prefect server start`` on a free 127.0.0.1
port with a fresh PREFECT_HOME, started once per test session on first use
and stopped at the end. Its address is put in the environment before Prefect
is imported, so every flow run of the session talks to it.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import xarray as xr


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


_PREFECT_HOME = Path(tempfile.mkdtemp(prefix="gridsolve-prefect-home-"))
_PREFECT_PORT = free_port()
os.environ["PREFECT_HOME"] = str(_PREFECT_HOME)
os.environ["PREFECT_API_URL"] = f"http://127.0.0.1:{_PREFECT_PORT}/api"
os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
os.environ["PREFECT_LOGGING_TO_API_WHEN_MISSING_FLOW"] = "ignore"
os.environ["PYTHONUNBUFFERED"] = "1"

from testkit import Chain, make_ds  # noqa: E402


@pytest.fixture
def cube_path(tmp_path: Path) -> Path:
    path = tmp_path / "cube.nc"
    make_ds().to_netcdf(path)
    return path


@pytest.fixture
def write_cube(tmp_path: Path) -> Any:
    def _write(ds: xr.Dataset, name: str = "cube.nc") -> Path:
        path = tmp_path / name
        ds.to_netcdf(path)
        return path

    return _write


@pytest.fixture
def store(tmp_path: Path) -> Any:
    from stages.store import Store

    return Store(tmp_path / "store")


@pytest.fixture
def ctx(store: Any) -> Any:
    from stages.context import StageContext

    return StageContext(store=store, memory_budget=256 * 2**20)


# ---------------------------------------------------------------- prefect server
class PrefectServer:
    def __init__(self, home: Path, port: int) -> None:
        self.home = home
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.api = f"{self.url}/api"
        self.log = home / "server.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 120.0) -> None:
        env = {
            **os.environ,
            "PREFECT_HOME": str(self.home),
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            "PREFECT_UI_API_URL": self.api,
            # schedules in tests fire within seconds, not the default minute
            "PREFECT_SERVER_SERVICES_SCHEDULER_LOOP_SECONDS": "1",
        }
        env.pop("PREFECT_API_URL", None)
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "prefect",
                    "server",
                    "start",
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(self.port),
                ],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"prefect server exited early:\n{self.log.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(f"{self.api}/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.5)
        self.stop()
        raise RuntimeError(
            f"prefect server not healthy after {timeout}s:\n{self.log.read_text()[-3000:]}"
        )

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


@pytest.fixture(scope="session")
def prefect_server() -> Iterator[PrefectServer]:
    server = PrefectServer(_PREFECT_HOME, _PREFECT_PORT)
    server.start()
    try:
        yield server
    finally:
        server.stop()
        shutil.rmtree(_PREFECT_HOME, ignore_errors=True)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if "prefect_server" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.server)


@pytest.fixture
def chain(ctx: Any) -> Chain:
    return Chain(ctx)


# ---------------------------------------------------------------- deployments and a worker
REPO = Path(__file__).resolve().parent.parent
GRIDSOLVE = str(Path(sys.executable).parent / "gridsolve")


class Worker:
    def __init__(self, log: Path) -> None:
        self.log = log
        env = {
            **os.environ,
            "PREFECT_WORKER_QUERY_SECONDS": "1",
            "PREFECT_WORKER_PREFETCH_SECONDS": "5",
        }
        with open(log, "wb") as f:
            self.proc = subprocess.Popen(
                [GRIDSOLVE, "worker"],
                env=env,
                stdout=f,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


@pytest.fixture(scope="session")
def deployments(prefect_server: PrefectServer) -> dict[str, str]:
    """`gridsolve deploy` from the checkout: name → deployment id."""
    res = subprocess.run(
        [GRIDSOLVE, "deploy", "--project", str(REPO)], capture_output=True, text=True, timeout=300
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        found = {d.name: str(d.id) for d in client.read_deployments()}
    assert {"nightly", "on-demand"} <= set(found), found
    return found


@pytest.fixture(scope="session")
def worker(
    deployments: dict[str, str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Worker]:
    w = Worker(tmp_path_factory.mktemp("worker") / "worker.log")
    try:
        yield w
    finally:
        w.stop()
