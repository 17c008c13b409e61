"""A real PostgreSQL server for tests: Debian's ``postgresql`` binaries, a fresh cluster.

``postgres_server()`` runs ``initdb`` into a temporary folder, starts ``postgres`` as a
separate OS process (its own session) listening on a free 127.0.0.1 port only (its Unix
socket in the same temporary folder, never ``/var/run/postgresql``), waits until it
accepts connections, creates one database and yields its address. On exit it stops the
server (fast shutdown, then SIGKILL of its process group) and removes the folder.

Logins need the password made here (``scram-sha-256`` on TCP), as a team's server would.
As root, ``initdb`` and ``postgres`` refuse to run, so both run as Debian's ``postgres``
user (the package creates it). ``fsync`` is off: the cluster is thrown away after the test,
and durability across a power cut is not what the tests check.

Timing on a 2-core machine: ``initdb`` about 1.5 s, the start about 0.5 s.
"""

from __future__ import annotations

import glob
import os
import secrets
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gridsolve.flows.localserver import free_port

#: Seconds to wait for the server to accept connections after starting it.
START_TIMEOUT = 60.0
#: Seconds between the fast-shutdown request and SIGKILL of the server's process group.
STOP_GRACE = 15.0
USER = "gridsolve"
DATABASE = "prefect"


def bindir() -> Path | None:
    """The folder of Debian's PostgreSQL server binaries (the newest installed), or None."""
    found = sorted(
        glob.glob("/usr/lib/postgresql/*/bin/postgres"),
        key=lambda p: int(Path(p).parts[-3]) if Path(p).parts[-3].isdigit() else 0,
    )
    if found:
        return Path(found[-1]).parent
    exe = shutil.which("postgres")
    return Path(exe).parent if exe else None


@dataclass
class PostgresServer:
    """A running PostgreSQL cluster on 127.0.0.1 and the database made for the test."""

    port: int
    password: str
    folder: Path
    proc: subprocess.Popen[bytes]

    @property
    def url(self) -> str:
        """Prefect's connection URL (``PREFECT_API_DATABASE_CONNECTION_URL``)."""
        return f"postgresql+asyncpg://{USER}:{self.password}@127.0.0.1:{self.port}/{DATABASE}"

    def log(self, n: int = 4000) -> str:
        """The end of the server's log."""
        path = self.folder / "postgres.log"
        return path.read_text(errors="replace")[-n:] if path.exists() else ""

    def psql(self, sql: str) -> str:
        """Run one SQL statement with ``psql`` over TCP, as the test's user; its output."""
        res = subprocess.run(
            [
                str(_bin("psql")),
                "-h",
                "127.0.0.1",
                "-p",
                str(self.port),
                "-U",
                USER,
                "-d",
                DATABASE,
                "-At",
                "-c",
                sql,
            ],
            env={**os.environ, "PGPASSWORD": self.password},
            capture_output=True,
            text=True,
            timeout=60,
        )
        if res.returncode != 0:
            raise RuntimeError(f"psql failed: {res.stderr.strip()}")
        return res.stdout.strip()


def _bin(name: str) -> Path:
    found = bindir()
    if found is None or not (found / name).exists():
        raise RuntimeError(
            f"PostgreSQL's {name} not found: apt-get install -y postgresql (.ci/run does)"
        )
    return found / name


def _as_postgres() -> dict[str, Any]:
    """subprocess arguments that run a child as Debian's ``postgres`` user when we are root."""
    if os.geteuid() != 0:
        return {}
    return {"user": "postgres", "group": "postgres", "extra_groups": []}


@contextmanager
def postgres_server() -> Iterator[PostgresServer]:
    """A fresh PostgreSQL cluster on a free 127.0.0.1 port, stopped and removed on exit."""
    folder = Path(tempfile.mkdtemp(prefix="gridsolve-pg-"))
    run_as = _as_postgres()
    if run_as:
        shutil.chown(folder, "postgres", "postgres")
    password = secrets.token_hex(16)
    pwfile = folder / "pw"
    pwfile.write_text(password + "\n")
    if run_as:
        shutil.chown(pwfile, "postgres", "postgres")
    data = folder / "data"
    proc: subprocess.Popen[bytes] | None = None
    try:
        subprocess.run(
            [
                str(_bin("initdb")),
                "-D",
                str(data),
                "-U",
                USER,
                "-E",
                "UTF8",
                "--no-sync",
                "--auth-local=trust",
                "--auth-host=scram-sha-256",
                f"--pwfile={pwfile}",
            ],
            check=True,
            capture_output=True,
            timeout=120,
            cwd=folder,
            **run_as,
        )
        pwfile.unlink()
        port = free_port()
        with open(folder / "postgres.log", "wb") as log:
            if run_as:
                shutil.chown(folder / "postgres.log", "postgres", "postgres")
            proc = subprocess.Popen(
                [
                    str(_bin("postgres")),
                    "-D",
                    str(data),
                    "-h",
                    "127.0.0.1",
                    "-p",
                    str(port),
                    "-k",
                    str(folder),
                    "-c",
                    "fsync=off",
                    "-c",
                    "max_connections=200",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                cwd=folder,
                **run_as,
            )
        server = PostgresServer(port=port, password=password, folder=folder, proc=proc)
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"postgres exited early:\n{server.log()}")
            ready = subprocess.run(
                [str(_bin("pg_isready")), "-h", "127.0.0.1", "-p", str(port), "-q"],
                timeout=30,
                check=False,
            )
            if ready.returncode == 0:
                break
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"postgres not ready after {START_TIMEOUT:.0f} s:\n{server.log()}"
                )
            time.sleep(0.2)
        subprocess.run(
            [str(_bin("createdb")), "-h", "127.0.0.1", "-p", str(port), "-U", USER, DATABASE],
            env={**os.environ, "PGPASSWORD": password},
            check=True,
            capture_output=True,
            timeout=60,
        )
        yield server
    finally:
        if proc is not None:
            with suppress(ProcessLookupError):
                proc.send_signal(signal.SIGINT)  # PostgreSQL's fast shutdown
            with suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=STOP_GRACE)
            with suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        shutil.rmtree(folder, ignore_errors=True)
