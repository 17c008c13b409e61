"""`gridsolve server` and `gridsolve worker` stop with everything they started.

Each test starts the real wrapper in the background, signals the wrapper's
PID only (what `kill %1`, systemd and docker do), and checks that every
process it started is gone, and the port closed, within 10 s.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gridsolve.flows.localserver import free_port

pytestmark = pytest.mark.slow

GRIDSOLVE = str(Path(sys.executable).parent / "gridsolve")


def descendants(pid: int) -> set[int]:
    """Every living process below ``pid`` (from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if fields[0] == "Z":
            continue
        children.setdefault(int(fields[1]), []).append(int(entry))
    found: set[int] = set()
    todo = [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def wait_for(check: object, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():  # type: ignore[operator]
            return
        time.sleep(0.2)
    raise AssertionError(f"not within {timeout:.0f} s: {what}")


def stop_and_check(proc: subprocess.Popen[bytes], signum: int, port: int | None) -> float:
    """Signal the wrapper only; everything it started must be gone within 10 s."""
    below = descendants(proc.pid)
    assert below, "the wrapper started nothing"
    t0 = time.monotonic()
    os.kill(proc.pid, signum)
    wait_for(lambda: proc.poll() is not None, 10, "the wrapper exits")
    wait_for(lambda: not any(alive(p) for p in below), 10, f"its children {below} exit")
    if port is not None:
        wait_for(lambda: not listening(port), 10, f"port {port} closes")
    return time.monotonic() - t0


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_server_stops_with_its_wrapper(tmp_path: Path, signum: int) -> None:
    port = free_port()
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "home")}
    env.pop("PREFECT_API_URL", None)
    log = open(tmp_path / "server.log", "wb")  # noqa: SIM115 (closed below)
    proc = subprocess.Popen(
        [GRIDSOLVE, "server", "--port", str(port)], env=env, stdout=log, stderr=subprocess.STDOUT
    )
    try:
        wait_for(lambda: listening(port), 120, "the server listens")
        assert rss_mb(proc.pid) <= 50, f"wrapper holds {rss_mb(proc.pid):.0f} MB"
        took = stop_and_check(proc, signum, port)
        assert proc.returncode == 128 + signum
    finally:
        if proc.poll() is None:
            proc.kill()
        log.close()
    text = (tmp_path / "server.log").read_text()
    assert f"export PREFECT_API_URL=http://127.0.0.1:{port}/api" in text
    print(f"stopped in {took:.1f} s")


def test_server_refuses_a_busy_port(tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        res = subprocess.run(
            [GRIDSOLVE, "server", "--port", str(port)],
            env={**os.environ, "PREFECT_HOME": str(tmp_path / "home")},
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert res.returncode == 2
    assert f"port {port} on 127.0.0.1 is already in use" in res.stderr
    assert "Prefect UI at" not in res.stdout  # no address printed that is not ours


@pytest.mark.usefixtures("prefect_server")
def test_worker_stops_with_its_wrapper(tmp_path: Path) -> None:
    log_path = tmp_path / "worker.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [GRIDSOLVE, "worker", "--pool", "wrapper-test-pool"],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        wait_for(
            lambda: "started" in log_path.read_text(errors="replace").lower(),
            120,
            "the worker starts",
        )
        assert rss_mb(proc.pid) <= 50, f"wrapper holds {rss_mb(proc.pid):.0f} MB"
        stop_and_check(proc, signal.SIGTERM, None)
    finally:
        if proc.poll() is None:
            proc.kill()
