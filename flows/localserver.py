"""A local Prefect server started by gridsolve itself: `gridsolve server`, tests, benchmarks.

It listens on 127.0.0.1 unless told otherwise, keeps its database under the
given PREFECT_HOME, and points the UI at its own API. Started in a new process
session so that stopping it stops every process it spawned.
"""

from __future__ import annotations

import base64
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on right now."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def stop_group(proc: subprocess.Popen[bytes], timeout: float = 30) -> None:
    """Stop a process started in its own session, and all it spawned (TERM, then KILL)."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def port_in_use(host: str, port: int) -> bool:
    """Whether something already listens on ``host:port`` (binding it fails).

    Binds as the server will (SO_REUSEADDR, as uvicorn does): connections a stopped
    server left in TIME-WAIT do not count, so a restart right after a stop starts
    (without it, a systemd restart loop failed for ~60 s, issue 32).
    """
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


def _die_with_parent(signum: int) -> Callable[[], None]:
    """A pre-exec hook: the child gets ``signum`` when its parent dies (Linux), even by SIGKILL."""

    def hook() -> None:
        try:
            import ctypes

            ctypes.CDLL(None, use_errno=True).prctl(1, signum)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass  # not Linux: the signal handlers below still stop the children

    return hook


def supervise(
    command: list[str],
    env: dict[str, str],
    grace: float = 5.0,
    death_signal: int = signal.SIGTERM,
) -> int:
    """Run ``command`` in its own process group until it exits, and stop all of it with us.

    SIGTERM, SIGINT or SIGHUP to this process sends SIGTERM to the child's whole
    group, then SIGKILL to what is left after ``grace`` seconds; the child gets
    ``death_signal`` if this process is killed outright (SIGKILL for a child that
    does not end on SIGTERM: nobody is left to send the SIGKILL after the grace).
    Returns the child's exit status, or 128 + the signal that stopped us.
    """
    proc = subprocess.Popen(
        command, env=env, start_new_session=True, preexec_fn=_die_with_parent(death_signal)
    )
    stopped: list[tuple[int, float]] = []  # (signal, when) of the first stop signal

    def stop(signum: int, _frame: object) -> None:
        if not stopped:
            stopped.append((signum, time.monotonic()))
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)

    previous = {s: signal.signal(s, stop) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    try:
        while True:
            try:
                code = proc.wait(timeout=0.2)
                break
            except subprocess.TimeoutExpired:
                if stopped and time.monotonic() > stopped[0][1] + grace:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(proc.pid, signal.SIGKILL)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # what the child left in its group
        for s, handler in previous.items():
            signal.signal(s, handler)
    return 128 + stopped[0][0] if stopped else code


#: How long the server keeps an automation's expired buckets (Prefect's default: 60 s).
#: The silent-run automation fires when a run's bucket expires; a server that was down
#: then sweeps, at restart, every bucket that expired more than this before, without
#: firing it (prefect/server/events/triggers.py, periodic_evaluation), and the run stays
#: Running for good. A week covers any outage an operator sits out; expired buckets are
#: one row per run and automation. An operator's own value is kept.
BUCKET_BUFFER_ENV, BUCKET_BUFFER = "PREFECT_SERVER_EVENTS_EXPIRED_BUCKET_BUFFER", "P7D"
#: The database's statement and connection timeouts (Prefect's defaults: 10 s and 5 s).
#: A team's server on a small machine with many runs at once answered a flow run's call
#: with a 500 and failed that run (20 runs at once on 2 busy cores, PostgreSQL); a slow
#: answer is better than a failed run. The operator's own values win.
DB_TIMEOUTS = {
    "PREFECT_SERVER_DATABASE_TIMEOUT": "60",
    "PREFECT_SERVER_DATABASE_CONNECTION_TIMEOUT": "30",
}


def server_env(home: Path, api: str, scheduler_seconds: int | None = None) -> dict[str, str]:
    """Environment of a `prefect server start` process."""
    env = {
        BUCKET_BUFFER_ENV: BUCKET_BUFFER,
        **DB_TIMEOUTS,
        **os.environ,
        "PREFECT_HOME": str(home),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_UI_API_URL": api,
    }
    env.pop("PREFECT_API_URL", None)
    if scheduler_seconds is not None:
        env["PREFECT_SERVER_SERVICES_SCHEDULER_LOOP_SECONDS"] = str(scheduler_seconds)
    return env


class LocalServer:
    """A `prefect server start` child process and its address."""

    def __init__(
        self,
        home: Path,
        port: int | None = None,
        host: str = "127.0.0.1",
        scheduler_seconds: int | None = None,
        extra_env: dict[str, str] | None = None,
    ) -> None:
        self.home = Path(home)
        self.extra_env = dict(extra_env or {})
        self.host = host
        self.port = port or free_port(host)
        self.url = f"http://{host}:{self.port}"
        self.api = f"{self.url}/api"
        self.log = self.home / "server.log"
        self.scheduler_seconds = scheduler_seconds
        self.proc: subprocess.Popen[bytes] | None = None

    def command(self) -> list[str]:
        """The command line that runs the server."""
        return [
            sys.executable,
            "-m",
            "prefect",
            "server",
            "start",
            "--host",
            self.host,
            "--port",
            str(self.port),
        ]

    def env(self) -> dict[str, str]:
        """The server's environment."""
        return {**server_env(self.home, self.api, self.scheduler_seconds), **self.extra_env}

    def healthy(self) -> bool:
        """Whether the API answers its health check."""
        try:
            with urllib.request.urlopen(f"{self.api}/health", timeout=2) as r:
                return bool(r.status == 200)
        except OSError:
            return False

    def start(self, timeout: float = 120.0) -> LocalServer:
        """Start in the background and wait until healthy."""
        self.home.mkdir(parents=True, exist_ok=True)
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                self.command(),
                env=self.env(),
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"prefect server exited early:\n{self.tail()}")
            if self.healthy():
                return self
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"prefect server not healthy after {timeout:.0f} s:\n{self.tail()}")

    def tail(self, n: int = 3000) -> str:
        """The end of the server's log."""
        return self.log.read_text(errors="replace")[-n:] if self.log.exists() else ""

    def stop(self) -> None:
        """Stop the server and everything it started."""
        if self.proc is not None:
            stop_group(self.proc)

    def __enter__(self) -> LocalServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def api_refusal(api: str, auth: str | None, timeout: float = 10.0) -> str | None:
    """Why the Prefect API at ``api`` refuses this client (basic auth ``auth``), or None.

    One authenticated request (the server's version); None also when the server
    cannot be reached, which Prefect's client reports itself.
    """
    req = urllib.request.Request(f"{api.rstrip('/')}/admin/version")
    if auth:
        token = base64.b64encode(auth.encode("utf-8")).decode("ascii")
        req.add_header("Authorization", f"Basic {token}")
    try:
        with urllib.request.urlopen(req, timeout=timeout):
            return None
    except urllib.error.HTTPError as err:
        if err.code != 401:
            return None
        if auth:
            return f"the Prefect server at {api} refused PREFECT_API_AUTH_STRING (401 Unauthorized)"
        return f"the Prefect server at {api} requires a login (401 Unauthorized)"
    except (OSError, ValueError):  # unreachable, or not a URL: Prefect's client says which
        return None


def database_summary() -> str:
    """Which database a Prefect server started from this environment uses (no password).

    Read from PREFECT_API_DATABASE_CONNECTION_URL (or its legacy name) without importing
    Prefect or SQLAlchemy: the `gridsolve server` wrapper that prints it stays small
    (tests/flows/test_wrappers.py). SQLite in PREFECT_HOME when nothing is set.
    """
    from urllib.parse import urlsplit

    raw = os.environ.get("PREFECT_API_DATABASE_CONNECTION_URL") or os.environ.get(
        "PREFECT_SERVER_DATABASE_CONNECTION_URL", ""
    )
    url = urlsplit(raw) if raw else None
    if url is None or url.scheme.startswith("sqlite"):
        where = (url.path.removeprefix("/") if url is not None else "") or "PREFECT_HOME"
        return (
            f"database: SQLite at {where} (one user; for a team or many runs at once, "
            "PostgreSQL: docs/operations.md)"
        )
    return f"database: PostgreSQL at {url.hostname}:{url.port or 5432}{url.path}"
