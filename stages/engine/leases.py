"""Leases: which processes are using a cache right now, so pruning spares what they use.

A lease is a small JSON file ``<cache root>/leases/<host>-<pid>-<id>.json``
that a run (a flow run, ``gridsolve run``, ``gridsolve cache prune``) creates
when it starts and removes when it ends, also when it fails. It records the
host, the process id and that process's start time (from ``/proc/<pid>/stat``,
or psutil where there is no ``/proc``), so a reused pid is not mistaken for
the run. The lease's *start* is the file's modification time: the same clock
as the artifacts' last-use stamps (the manifests' mtimes, see
:meth:`Store.check <gridsolve.stages.engine.store.Store.check>`), even on a
shared mount.

A lease is *expired* when its process is gone: on this host, the pid is not
alive or now belongs to a process started at another time; on another host,
when it is older than :data:`FOREIGN_TIMEOUT_S` (that host's processes cannot
be seen from here). An unreadable lease older than a minute is expired too.
Expired leases are swept by whoever prunes.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from gridsolve.stages.engine.paths import pid_alive

LEASES = "leases"
#: How long a lease of a process on another host counts as live (no way to ask that host).
FOREIGN_TIMEOUT_S = 3 * 24 * 3600
#: A lease file that cannot be read is treated as being written for this long, then expired.
UNREADABLE_GRACE_S = 60


def process_start(pid: int) -> str | None:
    """An identifier of when process ``pid`` started (None: not known here).

    ``/proc/<pid>/stat`` field 22 (clock ticks since boot) where there is a
    ``/proc``, else psutil's create time; a reused pid gets another value.
    """
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        text = ""
    if text:
        # comm (field 2) may hold spaces and parentheses: count fields after the last ')'
        fields = text.rpartition(")")[2].split()
        if len(fields) > 19:
            return f"proc:{fields[19]}"
    try:
        import psutil
    except ImportError:
        return None
    try:
        return f"psutil:{psutil.Process(pid).create_time():.3f}"
    except Exception:  # no such process, or not allowed to ask
        return None


@dataclass(frozen=True)
class Lease:
    """One lease file and what it says."""

    path: Path
    host: str
    pid: int
    #: when the process started (:func:`process_start`), None where unknown
    pid_start: str | None
    #: the lease's start: the file's mtime (the cache's clock), in ns
    started_ns: int
    purpose: str = ""

    def expired(self, now: float | None = None) -> bool:
        """Whether the process that holds this lease has ended (see the module's doc)."""
        if self.host != socket.gethostname():
            return (now if now is not None else time.time()) - self.started_ns / 1e9 > (
                FOREIGN_TIMEOUT_S
            )
        if not pid_alive(self.pid):
            return True
        if self.pid_start is None:
            return False
        current = process_start(self.pid)
        if current is None or current.split(":")[0] != self.pid_start.split(":")[0]:
            return False  # cannot compare: the pid is alive, keep trusting it
        return current != self.pid_start

    @property
    def started(self) -> str:
        """The start as an ISO time (UTC, seconds)."""
        return (
            datetime.fromtimestamp(self.started_ns / 1e9, UTC).isoformat(timespec="seconds")
        ).replace("+00:00", "Z")


def _read(path: Path) -> Lease | None:
    """The lease at ``path``; None when it cannot be read (or vanished)."""
    st = path.stat()
    try:
        raw: dict[str, Any] = json.loads(path.read_text())
        return Lease(
            path=path,
            host=str(raw["host"]),
            pid=int(raw["pid"]),
            pid_start=raw.get("pid_start"),
            started_ns=st.st_mtime_ns,
            purpose=str(raw.get("purpose", "")),
        )
    except (OSError, ValueError, KeyError, TypeError):
        return None


@dataclass(frozen=True)
class LeaseScan:
    """The leases of one cache: those of running processes, and those left by ended ones."""

    live: list[Lease]
    expired: list[Path]

    @property
    def oldest_start_ns(self) -> int | None:
        """Start of the oldest live lease (None: no live lease)."""
        return min((lease.started_ns for lease in self.live), default=None)


def scan(root: Path, sweep: bool = False) -> LeaseScan:
    """Every lease under ``root``: live ones, and expired ones (removed when ``sweep``)."""
    folder = root / LEASES
    live: list[Lease] = []
    expired: list[Path] = []
    now = time.time()
    try:
        entries = sorted(folder.glob("*.json"))
    except OSError:
        entries = []
    for path in entries:
        try:
            lease = _read(path)
            if lease is None:
                if now - path.stat().st_mtime > UNREADABLE_GRACE_S:
                    expired.append(path)
                continue
        except FileNotFoundError:
            continue  # released while we looked
        if lease.expired(now):
            expired.append(path)
        else:
            live.append(lease)
    if sweep:
        for path in expired:
            path.unlink(missing_ok=True)
        for tmp in folder.glob(".*.json.tmp"):  # a lease being written when its process died
            with contextlib.suppress(OSError):
                if now - tmp.stat().st_mtime > UNREADABLE_GRACE_S:
                    tmp.unlink()
    return LeaseScan(live=live, expired=expired)


def _safe(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._]", "_", text) or "_"


def acquire(root: Path, purpose: str) -> Lease:
    """Create this process's lease in ``root`` (written whole, then renamed into place)."""
    folder = root / LEASES
    folder.mkdir(parents=True, exist_ok=True)
    host, pid = socket.gethostname(), os.getpid()
    pid_start = process_start(pid)
    record = {
        "host": host,
        "pid": pid,
        "pid_start": pid_start,
        "started": datetime.now(UTC).isoformat(timespec="seconds").replace("+00:00", "Z"),
        "purpose": purpose,
    }
    name = f"{_safe(host)}-{pid}-{uuid.uuid4().hex[:12]}.json"
    tmp = folder / f".{name}.tmp"
    tmp.write_text(json.dumps(record, sort_keys=True))
    final = folder / name
    os.replace(tmp, final)
    return Lease(
        path=final,
        host=host,
        pid=pid,
        pid_start=pid_start,
        started_ns=final.stat().st_mtime_ns,
        purpose=purpose,
    )


def release(lease: Lease) -> None:
    """Remove ``lease`` (already gone is fine)."""
    with contextlib.suppress(OSError):
        lease.path.unlink()


@contextlib.contextmanager
def held(root: Path, purpose: str) -> Iterator[Lease]:
    """Hold a lease on the cache at ``root`` for this process while the block runs."""
    lease = acquire(root, purpose)
    try:
        yield lease
    finally:
        release(lease)
