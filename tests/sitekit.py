"""A whole gridsolve site for fault tests: its own `gridsolve server`, deployments and worker.

Unlike the session's server (tests/conftest.py), a ``Site`` belongs to one test module, so a
test may stop its server, kill its worker or point it at PostgreSQL without disturbing other
tests. Everything is started the way an operator starts it (``gridsolve server``, ``gridsolve
deploy``, ``gridsolve worker``) on a free 127.0.0.1 port, each in its own process session,
and talked to over the REST API with plain httpx (no Prefect client, no retries).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from gridsolve.flows.localserver import free_port, stop_group

GRIDSOLVE = str(Path(sys.executable).parent / "gridsolve")
REPO = Path(__file__).resolve().parents[1]
FINAL = ("COMPLETED", "FAILED", "CRASHED", "CANCELLED")


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (children, their children, …), read from /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


class Site:
    """A server (SQLite in ``folder/prefect`` unless ``database_url``), deployments, a worker."""

    def __init__(self, folder: Path, database_url: str | None = None, **env: str) -> None:
        self.folder = folder
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api = f"{self.url}/api"
        self.home = folder / "home"  # the worker's GRIDSOLVE_HOME
        (self.home / "data").mkdir(parents=True, exist_ok=True)
        base = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("GRIDSOLVE_ALLOWED", "PREFECT_API"))
        }
        self.env = {
            **base,
            "PREFECT_HOME": str(folder / "prefect"),
            "PREFECT_API_URL": self.api,
            "GRIDSOLVE_HOME": str(self.home),
            **env,
        }
        self.database_url = database_url
        self.server: subprocess.Popen[bytes] | None = None
        self.worker: subprocess.Popen[bytes] | None = None
        self.starts = 0

    # ------------------------------------------------------------ processes
    def _popen(self, cmd: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
        with open(log, "ab") as f:
            return subprocess.Popen(
                cmd, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True
            )

    @property
    def server_log(self) -> Path:
        return self.folder / "server.log"

    @property
    def worker_log(self) -> Path:
        return self.folder / "worker.log"

    def start_server(self, timeout: float = 180) -> None:
        """`gridsolve server` on this site's port, waiting until its API answers."""
        env = dict(self.env)
        if self.database_url:
            env["PREFECT_API_DATABASE_CONNECTION_URL"] = self.database_url
        self.server = self._popen(
            [GRIDSOLVE, "server", "--port", str(self.port)], env, self.server_log
        )
        self.starts += 1
        deadline = time.monotonic() + timeout
        while not self.healthy():
            assert self.server.poll() is None, self.tail(self.server_log)
            assert time.monotonic() < deadline, self.tail(self.server_log)
            time.sleep(0.5)

    def stop_server(self) -> None:
        """SIGTERM to `gridsolve server` (as systemd stops it), waiting until it exited."""
        if self.server is not None:
            self.server.send_signal(signal.SIGTERM)
            self.server.wait(timeout=60)
            stop_group(self.server)

    def deploy(self) -> None:
        """`gridsolve deploy` of the checkout's prefect.yaml (pool, deployments, automations)."""
        res = subprocess.run(
            [GRIDSOLVE, "deploy", "--project", str(REPO)],
            env={**self.env, "PREFECT_CLIENT_MAX_RETRIES": "5"},
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]

    def start_worker(self, *args: str) -> None:
        """`gridsolve worker` (confined by default, as deployed)."""
        env = {**self.env, "PREFECT_WORKER_QUERY_SECONDS": "1"}
        self.worker = self._popen([GRIDSOLVE, "worker", *args], env, self.worker_log)

    def kill_worker_host(self) -> int:
        """SIGKILL every process of the worker at once (its supervisor, Prefect's worker, the
        runs' engines): what a machine that loses power leaves. Returns how many died."""
        assert self.worker is not None
        pids = [self.worker.pid, *descendants(self.worker.pid)]
        for pid in pids:  # frozen first, so none can report or clean up
            with_process(pid, signal.SIGSTOP)
        for pid in pids:
            with_process(pid, signal.SIGKILL)
        self.worker.wait(timeout=30)
        return len(pids)

    def stop(self) -> None:
        """Stop the worker and the server, and everything they started."""
        for proc in (self.worker, self.server):
            if proc is not None:
                stop_group(proc)

    @staticmethod
    def tail(log: Path, n: int = 4000) -> str:
        return log.read_text(errors="replace")[-n:] if log.exists() else ""

    # ------------------------------------------------------------ API
    def healthy(self) -> bool:
        try:
            return httpx.get(f"{self.api}/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def deployment_id(self, name: str) -> str:
        r = httpx.get(f"{self.api}/deployments/name/gridsolve/{name}", timeout=30)
        r.raise_for_status()
        return str(r.json()["id"])

    def create_run(self, deployment: str, parameters: dict[str, Any]) -> dict[str, Any]:
        r = httpx.post(
            f"{self.api}/deployments/{self.deployment_id(deployment)}/create_flow_run",
            json={"parameters": parameters},
            timeout=60,
        )
        assert r.status_code == 201, r.text
        return dict(r.json())

    def run(self, run_id: str) -> dict[str, Any]:
        r = httpx.get(f"{self.api}/flow_runs/{run_id}", timeout=30)
        r.raise_for_status()
        return dict(r.json())

    def states(self, run_id: str) -> list[dict[str, Any]]:
        r = httpx.get(f"{self.api}/flow_run_states/", params={"flow_run_id": run_id}, timeout=30)
        r.raise_for_status()
        return sorted(r.json(), key=lambda s: s["timestamp"])

    def runs_of(self, deployment_id: str) -> list[dict[str, Any]]:
        r = httpx.post(
            f"{self.api}/flow_runs/filter",
            json={"deployments": {"id": {"any_": [deployment_id]}}, "limit": 200},
            timeout=60,
        )
        r.raise_for_status()
        return list(r.json())

    def artifact(self, run_id: str, key: str) -> Any:
        r = httpx.post(
            f"{self.api}/artifacts/filter",
            json={"artifacts": {"flow_run_id": {"any_": [run_id]}, "key": {"any_": [key]}}},
            timeout=30,
        )
        r.raise_for_status()
        found = r.json()
        assert len(found) == 1, found
        return found[0]["data"]

    def wait_final(self, run_id: str, timeout: float, min_run_count: int = 1) -> dict[str, Any]:
        """The run once its state is final (and it ran at least ``min_run_count`` times)."""
        deadline = time.monotonic() + timeout
        while True:
            run = self.run(run_id)
            if run["state"]["type"] in FINAL and run["run_count"] >= min_run_count:
                return run
            if time.monotonic() > deadline:
                return run
            time.sleep(2)


def with_process(pid: int, sig: int) -> None:
    """Send ``sig`` to ``pid`` if it still exists."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)
