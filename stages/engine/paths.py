"""Where gridsolve may write, and files written atomically through temporaries.

A worker that runs flows triggered by other people (a Prefect UI "Custom run")
pins where runs may write: ``GRIDSOLVE_ALLOWED_ROOTS`` (folders separated
by ``:``). Output files and cache folders must then resolve — after ``..`` and
symbolic links — inside one of them. Unset, any writable path is allowed;
``gridsolve worker`` and ``gridsolve serve`` set it, and the input, URL and
module allowances, to the defaults of ``schemas/confinement.py`` unless the
operator set them or passed ``--unconfined`` (``*``: anywhere).

Wherever it may write, a run never writes over what it reads: see
:mod:`~gridsolve.stages.engine.overlap`.
"""

from __future__ import annotations

import importlib
import os
import shutil
import socket
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from gridsolve.schemas.confinement import (
    ALLOWED_INPUTS_ENV,
    ALLOWED_MODULES_ENV,
    ALLOWED_ROOTS_ENV,
    ALLOWED_URLS_ENV,
    ANYWHERE,
)
from gridsolve.schemas.errors import ConfigError, InputError, OutputError

if TYPE_CHECKING:
    pass


def allowed_roots() -> list[Path]:
    """The folders writes are confined to (empty: no restriction)."""
    raw = os.environ.get(ALLOWED_ROOTS_ENV, "")
    if raw.strip() == ANYWHERE:
        return []
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


def under_prefix(url: str, prefixes: list[str]) -> bool:
    """Whether ``url`` is one of ``prefixes`` (no trailing ``/``) or lies under one of them."""
    return any(url == p or url.startswith(p + "/") for p in prefixes)


def ensure_allowed_url(url: str, what: str, stage: str | None = None) -> str:
    """``url``; OutputError if writes are confined and it is under no allowed prefix.

    With ``GRIDSOLVE_ALLOWED_ROOTS`` unset nothing is confined; set, a URL must
    start with one of the prefixes in ``GRIDSOLVE_ALLOWED_URLS``.
    """
    if not allowed_roots():
        return url
    prefixes = [p.rstrip("/") for p in os.environ.get(ALLOWED_URLS_ENV, "").split() if p]
    if ANYWHERE not in prefixes and not under_prefix(url, prefixes):
        raise OutputError(
            f"{what} {url} is outside the places this worker may write to",
            stage=stage,
            expected=f"a URL under {', '.join(prefixes) or '(none allowed)'} ({ALLOWED_URLS_ENV})",
            found=url,
            fix=f"choose a {what} under those prefixes, or add its bucket to {ALLOWED_URLS_ENV}",
        )
    return url


def _listed(env: str) -> list[str]:
    """The entries of ``env`` (empty: no restriction, as is ``*``)."""
    listed = [p for p in os.environ.get(env, "").split() if p]
    return [] if ANYWHERE in listed else listed


def ensure_input_allowed(path: str, what: str, stage: str | None = None) -> None:
    """InputError if reads are confined (``GRIDSOLVE_ALLOWED_INPUTS``) and ``path`` is outside.

    A local path is resolved (``..`` and symbolic links) before it is compared.
    """
    allowed = _listed(ALLOWED_INPUTS_ENV)
    if not allowed:
        return
    if "://" in path:
        ok = under_prefix(path, [a.rstrip("/") for a in allowed])
    else:
        resolved = Path(path).expanduser().resolve()
        roots = [Path(a).expanduser().resolve() for a in allowed if "://" not in a]
        ok = any(resolved == r or r in resolved.parents for r in roots)
    if not ok:
        raise InputError(
            f"{what} {path} is outside the places this worker may read from",
            stage=stage,
            expected=f"a path or URL under {' '.join(allowed)} ({ALLOWED_INPUTS_ENV})",
            found=path,
            fix=f"move the data under those folders, or add its folder to {ALLOWED_INPUTS_ENV} "
            "on the worker",
        )


def ensure_module_allowed(module: str, stage: str | None = None) -> None:
    """ConfigError, before any import, if ``module`` is under no ``GRIDSOLVE_ALLOWED_MODULES``."""
    allowed = _listed(ALLOWED_MODULES_ENV)
    if not allowed:
        return
    field = "solve" if (stage or "").startswith("solve") else "model"
    if not any(module == a or module.startswith(a + ".") for a in allowed):
        raise ConfigError(
            f"{field}.target module {module!r} is not one this worker may import",
            stage=stage,
            expected=f"a module under {' '.join(allowed)} ({ALLOWED_MODULES_ENV})",
            found=module,
            fix=f"use a model from those packages, or add its package to {ALLOWED_MODULES_ENV} "
            "on the worker",
        )


def import_named(target: str, stage: str, field: str) -> object:
    """What ``package.module:name`` names, imported (None if the module lacks the name).

    Checked against the worker's allowed modules first; a module that cannot be
    imported is a ConfigError naming ``field`` (``model.target``, ``solve.target``).
    """
    mod_name, _, name = target.partition(":")
    ensure_module_allowed(mod_name, stage)
    try:
        module = importlib.import_module(mod_name)
    except Exception as exc:
        raise ConfigError(
            f"cannot import module {mod_name!r} for {field}",
            stage=stage,
            found=f"{type(exc).__name__}: {exc}",
            fix="check the spelling, and that the package is installed where the flow runs",
        ) from exc
    return getattr(module, name, None)


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


def _temporary_beside(final: Path) -> Path:
    return final.with_name(f".{final.name}.gridsolve~{writer_tag()}~{uuid.uuid4().hex[:12]}.tmp")


def sweep_dead_temporaries(final: Path) -> None:
    """Remove the temporary files that killed writers left beside ``final`` (this host)."""
    for tmp in final.parent.glob(f".{final.name}.gridsolve~*.tmp"):
        tag = tmp.name.split("~", 1)[1].rsplit("~", 1)[0]
        if owner_is_dead(tag):
            if tmp.is_dir():
                shutil.rmtree(tmp, ignore_errors=True)
            else:
                tmp.unlink(missing_ok=True)


@contextmanager
def atomic_file(final: Path) -> Iterator[Path]:
    """A temporary path beside ``final`` that becomes ``final`` when the block succeeds.

    Readers see the old file or the whole new one, never a partial one; on any
    error the temporary file is removed and ``final`` is untouched. The name
    carries the writer's ``host~pid`` so :func:`sweep_dead_temporaries` can
    remove what a killed writer left.
    """
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = _temporary_beside(final)
    try:
        yield tmp
        os.replace(tmp, final)
    finally:
        tmp.unlink(missing_ok=True)


@contextmanager
def atomic_folder(final: Path) -> Iterator[Path]:
    """A temporary folder beside ``final`` that replaces ``final`` when the block succeeds.

    Readers never see a partial folder: the new one appears under ``final`` by a
    rename once complete. Replacing an existing ``final`` takes two renames (the
    old one is moved aside first), so a reader may find no folder in between, but
    never a mix. On any error the temporary folder is removed and ``final`` is
    untouched; :func:`sweep_dead_temporaries` removes what a killed writer left.
    """
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = _temporary_beside(final)
    old = _temporary_beside(final)
    try:
        tmp.mkdir()
        yield tmp
        if final.exists():
            os.replace(final, old)
        try:
            os.replace(tmp, final)
        except OSError:
            if old.exists() and not final.exists():
                os.replace(old, final)  # put the previous one back
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(old, ignore_errors=True)


# ---------------------------------------------------------------- outputs that would destroy
#: Files a run writes beside ``write.path`` (gridsolve/report/pictures.py, stages/train/outputs.py).
QUICKLOOK_SUFFIX = ".quicklook.png"
LOSS_SUFFIX = ".loss.png"
WEIGHTS_SUFFIX = ".weights.safetensors"
#: Every suffix of a file beside an output that describes it (replaced or removed with it).
BESIDE_SUFFIXES = (WEIGHTS_SUFFIX, QUICKLOOK_SUFFIX, LOSS_SUFFIX)
