"""Shared fixtures: seeded cubes written as real NetCDF, a store, and a real Prefect server.

The Prefect server is a real ``prefect server start`` on a free 127.0.0.1
port with a fresh PREFECT_HOME, started once per test session on first use
and stopped at the end. Its address is put in the environment before Prefect
is imported, so every flow run of the session talks to it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import xarray as xr

from gridsolve.flows.localserver import LocalServer, free_port, stop_group

_PREFECT_HOME = Path(tempfile.mkdtemp(prefix="gridsolve-prefect-home-"))
_PREFECT_PORT = free_port()
os.environ["PREFECT_HOME"] = str(_PREFECT_HOME)
os.environ["PREFECT_API_URL"] = f"http://127.0.0.1:{_PREFECT_PORT}/api"
os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
os.environ["PREFECT_LOGGING_TO_API_WHEN_MISSING_FLOW"] = "ignore"
os.environ["PYTHONUNBUFFERED"] = "1"
# A loaded 2-core machine can keep the SQLite-backed server answering 503 (database
# busy) for a minute; clients here and in the CLI/worker children retry longer.
os.environ.setdefault("PREFECT_CLIENT_MAX_RETRIES", "8")
os.environ.setdefault("PREFECT_SERVER_LOG_RETRYABLE_ERRORS", "true")
# Flow runs send a heartbeat every 30 s (Prefect's least), and `gridsolve deploy` makes
# the silent-run automation crash a run after 120 s without one: a run whose machine
# dies is marked Crashed within a test's patience (tests/flows/test_crash_retry.py).
os.environ["PREFECT_FLOWS_HEARTBEAT_FREQUENCY"] = "30"
os.environ["GRIDSOLVE_SILENT_RUN_SECONDS"] = "120"

import gridsolve.stages  # noqa: E402, F401  (registers the built-in implementations)

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
    from gridsolve.stages.engine.store import Store

    return Store(tmp_path / "store")


@pytest.fixture
def mappable_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """``tmp_path``, with the store's staging on whatever file system holds it.

    Staging's own safety rule maps output files only on ext4, xfs and tmpfs; a test of
    the mechanism must not depend on the file system the machine's /tmp is on.
    """
    from gridsolve.stages.engine import store

    kind = store._file_system(os.path.realpath(tmp_path))
    monkeypatch.setattr(store, "_RESERVING_FILE_SYSTEMS", frozenset({kind}))
    return tmp_path


@pytest.fixture
def ctx(store: Any) -> Any:
    from gridsolve.stages.engine.context import StageContext

    return StageContext(store=store, memory_budget=256 * 2**20)


@pytest.fixture(scope="module")
def one_torch_thread() -> Iterator[None]:
    """torch on one thread for a module's tests (the machine is shared; their fits are small)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# ---------------------------------------------------------------- prefect server
@pytest.fixture(scope="session")
def prefect_server() -> Iterator[LocalServer]:
    # Schedules in tests fire within seconds, not the default minute.
    server = LocalServer(_PREFECT_HOME, _PREFECT_PORT, scheduler_seconds=1)
    server.start()
    try:
        yield server
    finally:
        server.stop()
        shutil.rmtree(_PREFECT_HOME, ignore_errors=True)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    # A session that started no server (a targeted run) left the folder behind in /tmp.
    shutil.rmtree(_PREFECT_HOME, ignore_errors=True)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if "prefect_server" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.server)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    report = yield
    if report.failed and "prefect_server" in getattr(item, "fixturenames", ()):
        # What the server said when a test that used it failed (e.g. why it answered 503).
        log = _PREFECT_HOME / "server.log"
        if log.exists():
            report.sections.append(
                ("prefect server log (end)", log.read_text(errors="replace")[-6000:])
            )
    return report


# ---------------------------------------------------------------- object storage
@dataclass
class S3Bucket:
    """A fresh bucket on the test S3 server."""

    server: Any
    bucket: str

    def url(self, name: str = "") -> str:
        """``s3://<bucket>/<name>``."""
        return f"s3://{self.bucket}/{name}"

    @property
    def fs(self) -> Any:
        """An s3fs filesystem with the valid key (uncached)."""
        return self.server.filesystem()

    def objects(self) -> list[str]:
        """Every object in the bucket (paths without the bucket)."""
        fs = self.fs
        return sorted(p.split("/", 1)[1] for p in fs.find(self.bucket))


@pytest.fixture(scope="session")
def s3_server() -> Iterator[Any]:
    """A real S3-compatible server (moto, auth enforced) on 127.0.0.1, for the session."""
    from s3server import s3_server as start

    with start() as server:
        yield server


@pytest.fixture
def s3(s3_server: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """The S3 server's credentials and endpoint in the environment, a fresh bucket, a mirror.

    ``s3.bucket`` is the new bucket's name; this host's copies go under
    ``tmp_path/mirror`` (``GRIDSOLVE_MIRROR``).
    """
    import uuid

    from gridsolve.stages.engine import remote

    from s3server import forget_filesystems

    for k, v in s3_server.env().items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv(remote.MIRROR_ENV, str(tmp_path / "mirror"))
    forget_filesystems()
    bucket = f"test-{uuid.uuid4().hex[:12]}"
    s3_server.make_bucket(bucket)
    yield S3Bucket(s3_server, bucket)
    forget_filesystems()


@pytest.fixture
def chain(ctx: Any) -> Chain:
    return Chain(ctx)


# ---------------------------------------------------------------- deployments and a worker
REPO = Path(__file__).resolve().parent.parent
GRIDSOLVE = str(Path(sys.executable).parent / "gridsolve")


class Worker:
    def __init__(self, log: Path, home: Path) -> None:
        self.log = log
        self.home = home  # GRIDSOLVE_HOME: where deployment runs' relative paths point
        env = {
            **os.environ,
            "PREFECT_WORKER_QUERY_SECONDS": "1",
            "PREFECT_WORKER_PREFETCH_SECONDS": "5",
            "GRIDSOLVE_HOME": str(home),
        }
        with open(log, "wb") as f:
            self.proc = subprocess.Popen(
                # the tests' data and outputs are in their temporary folders
                [GRIDSOLVE, "worker", "--unconfined"],
                env=env,
                stdout=f,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def stop(self) -> None:
        stop_group(self.proc)


@pytest.fixture(scope="session")
def deployments(prefect_server: LocalServer) -> dict[str, str]:
    """`gridsolve deploy` from the checkout: name → deployment id."""
    res = subprocess.run(
        [GRIDSOLVE, "deploy", "--project", str(REPO)], capture_output=True, text=True, timeout=300
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    # Prefect's hint names its own worker; gridsolve's output names its own
    assert "prefect worker start" not in res.stdout + res.stderr
    assert "gridsolve worker --pool gridsolve-process" in res.stdout  # the pool was created
    assert "automation: gridsolve: retry a crashed nightly run once" in res.stdout
    assert "automation: gridsolve: mark a run that stopped sending heartbeats crashed" in res.stdout
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        found = {d.name: str(d.id) for d in client.read_deployments()}
    assert {"nightly", "on-demand"} <= set(found), found
    return found


@pytest.fixture(scope="session")
def worker(
    deployments: dict[str, str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Worker]:
    folder = tmp_path_factory.mktemp("worker")
    w = Worker(folder / "worker.log", folder / "home")
    try:
        yield w
    finally:
        w.stop()
