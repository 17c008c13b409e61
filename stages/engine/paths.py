"""Where gridsolve may write, and temporary files that die with their writer.

A worker that runs flows triggered by other people (a Prefect UI "Custom run")
can pin where runs may write: ``GRIDSOLVE_ALLOWED_ROOTS`` (folders separated
by ``:``). Output files and cache folders must then resolve — after ``..`` and
symbolic links — inside one of them. Unset, any writable path is allowed.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

from gridsolve.schemas.errors import OutputError

ALLOWED_ROOTS_ENV = "GRIDSOLVE_ALLOWED_ROOTS"


def allowed_roots() -> list[Path]:
    """The folders writes are confined to (empty: no restriction)."""
    raw = os.environ.get(ALLOWED_ROOTS_ENV, "")
    return [Path(p).expanduser().resolve() for p in raw.split(os.pathsep) if p.strip()]


def ensure_allowed(path: str | Path, what: str, stage: str | None = None) -> Path:
    """``path`` resolved; OutputError if it falls outside the allowed roots."""
    resolved = Path(path).expanduser().resolve()
    roots = allowed_roots()
    if roots and not any(resolved == r or r in resolved.parents for r in roots):
        raise OutputError(
            f"{what} {resolved} is outside the folders this worker may write to",
            stage=stage,
            expected=f"a path inside {', '.join(str(r) for r in roots)} ({ALLOWED_ROOTS_ENV})",
            found=str(path),
            fix=f"choose a {what} inside those folders",
        )
    return resolved


def writer_tag() -> str:
    """``host~pid``: identifies the process that owns a temporary file."""
    return f"{socket.gethostname()}~{os.getpid()}"


def pid_alive(pid: int) -> bool:
    """Whether a process with this id exists on this host."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def owner_is_dead(tag: str) -> bool:
    """Whether the ``host~pid`` that wrote a temporary file is gone (this host only)."""
    host, _, pid = tag.partition("~")
    return host == socket.gethostname() and pid.isdigit() and not pid_alive(int(pid))
