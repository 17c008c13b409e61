"""The local server's port check and the supervisors (flows/localserver.py)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from gridsolve.flows.localserver import free_port, port_in_use


def test_a_port_left_in_time_wait_by_a_stopped_server_is_free() -> None:
    """A server that closed its connections first leaves them in TIME-WAIT for ~60 s;
    a restart on that port binds with SO_REUSEADDR (as uvicorn does), so it is free."""
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]
    client = socket.create_connection(("127.0.0.1", port))
    served, _ = listener.accept()
    served.close()  # the server closes first: its side goes to TIME-WAIT
    client.close()
    listener.close()
    assert not port_in_use("127.0.0.1", port)


def test_a_listening_port_is_in_use() -> None:
    with socket.socket() as busy:
        busy.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        assert port_in_use("127.0.0.1", busy.getsockname()[1])


def _children(pid: int) -> list[int]:
    """The live processes whose parent is ``pid``."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            # the fields after the command's closing parenthesis: state, ppid, …
            state, ppid = stat.rsplit(")", 1)[1].split()[:2]
            if int(ppid) == pid and state != "Z":
                found.append(int(entry))
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.slow  # a Prefect server and worker start: ≥ 5 s
@pytest.mark.parametrize("what", ["server", "worker"])
def test_a_supervisor_killed_outright_takes_its_prefect_process_down(
    what: str, tmp_path: Path, deployments: Any
) -> None:
    # `gridsolve worker` needs the session's server and pool (deployments); `gridsolve
    # server` runs one of its own on a free port. SIGKILL of the supervisor leaves no
    # Prefect process behind: a worker left online would take runs beside a restarted one.
    gridsolve = str(Path(sys.executable).parent / "gridsolve")
    home = tmp_path / "gridsolve-home"
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "home"), "GRIDSOLVE_HOME": str(home)}
    for name in list(env):
        if name.startswith("GRIDSOLVE_ALLOWED_"):
            del env[name]
    cmd = (
        [gridsolve, "worker"]
        if what == "worker"
        else [gridsolve, "server", "--port", str(free_port())]
    )
    children: list[int] = []
    log = tmp_path / f"{what}.log"
    ready = "started!" if what == "worker" else "Check out the dashboard"
    with open(log, "wb") as out:
        # SIGINT ignored, as a shell's `gridsolve worker &` starts it (the ignore is
        # inherited): Prefect's worker then outlives SIGTERM, which it turns into SIGINT
        supervisor = subprocess.Popen(
            cmd,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
        )
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and ready not in log.read_text(errors="replace"):
            assert supervisor.poll() is None, log.read_text()[-2000:]
            time.sleep(0.2)
        assert ready in log.read_text(errors="replace"), log.read_text()[-2000:]
        children = _children(supervisor.pid)
        assert children, f"gridsolve {what} started no Prefect process"
        if what == "worker":  # confined by default: what the worker's runs inherit
            environ = Path(f"/proc/{children[0]}/environ").read_bytes().split(b"\0")
            seen = dict(e.decode().split("=", 1) for e in environ if b"=" in e)
            assert seen["GRIDSOLVE_ALLOWED_ROOTS"] == str(home)
            assert seen["GRIDSOLVE_ALLOWED_INPUTS"] == str(home / "data")
            assert seen["GRIDSOLVE_ALLOWED_MODULES"] == "gridsolve"
            assert seen["GRIDSOLVE_ALLOWED_URLS"] == ""
            assert "runs read inputs from" in log.read_text()
        supervisor.kill()
        supervisor.wait()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and any(map(_alive, children)):
            time.sleep(0.2)
        left = [c for c in children if _alive(c)]
        assert not left, f"gridsolve {what} killed, its Prefect process {left} lives on"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(supervisor.pid, signal.SIGKILL)
        for c in children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(c, signal.SIGKILL)


def test_the_server_names_its_database_and_never_its_password(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from gridsolve.flows.localserver import database_summary

    db = tmp_path / "prefect.db"
    monkeypatch.setenv("PREFECT_API_DATABASE_CONNECTION_URL", f"sqlite+aiosqlite:///{db}")
    said = database_summary()
    assert said.startswith(f"database: SQLite at {db}") and "PostgreSQL" in said, said
    url = "postgresql+asyncpg://prefect:s3cret-pw@db.example:5433/prefect"
    monkeypatch.setenv("PREFECT_API_DATABASE_CONNECTION_URL", url)
    said = database_summary()
    assert said == "database: PostgreSQL at db.example:5433/prefect", said
