"""The cache's size cap: least recently used artifacts first, never one in use.

*Last use* of an artifact is its manifest's mtime, stamped by every cache hit
and every write (:meth:`Store.check <gridsolve.stages.engine.store.Store.check>`).
*In use* means: last used at or after the start of the oldest live lease
(:mod:`~gridsolve.stages.engine.leases`) — every run holds one from its start
to its end, so whatever a running flow has read or written since it started
is in use, in whichever process it runs. Pruning itself holds a lease, so an
artifact a run touches while the pruner works is spared too.

:func:`prune` removes quarantined artifacts (``corrupt/``, never read again)
first, then artifacts in least-recently-used order, until the cache is at or
under the cap; it stops at the first artifact in use (every later one is in
use too). Each eviction renames the artifact into the store's ``tmp`` first
(atomic: a reader finds it whole or absent, and recomputes it when absent),
checks its last use once more, and puts it back if a run used it meanwhile.
Local caches only: a bucket cache (``s3://``) is not pruned.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from gridsolve.stages.engine import leases, storage
from gridsolve.stages.engine.paths import ensure_allowed, writer_tag
from gridsolve.stages.engine.store import MANIFEST, Store

#: Prefect's cache records, one file per key (see flows.pipeline.PREFECT_RECORDS).
RECORDS = "prefect"

Logger = logging.Logger | logging.LoggerAdapter[Any]


def format_size(n: int) -> str:
    """``n`` bytes for people: ``6.4 MiB``."""
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(size) < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def _when(ns: int) -> str:
    return datetime.fromtimestamp(ns / 1e9, UTC).strftime("%Y-%m-%d %H:%M:%SZ")


@dataclass(frozen=True)
class Entry:
    """One artifact folder (or one quarantined folder) of the cache."""

    key: str
    path: Path
    size: int
    #: last use (manifest mtime; the folder's for a quarantined one), ns
    last_used_ns: int
    quarantined: bool = False


def _folder_size(folder: Path) -> int:
    total = 0
    with contextlib.suppress(FileNotFoundError), os.scandir(folder) as it:
        for e in it:
            with contextlib.suppress(FileNotFoundError):
                if e.is_dir(follow_symlinks=False):
                    total += _folder_size(Path(e.path))
                else:
                    total += e.stat(follow_symlinks=False).st_size
    return total


def _entry(folder: Path, key: str, quarantined: bool) -> Entry | None:
    try:
        if quarantined:
            used = folder.stat().st_mtime_ns
        else:
            try:
                used = (folder / MANIFEST).stat().st_mtime_ns
            except FileNotFoundError:
                used = folder.stat().st_mtime_ns  # no manifest: a broken artifact
    except FileNotFoundError:
        return None  # evicted or quarantined while we looked
    return Entry(key, folder, _folder_size(folder), used, quarantined)


def artifacts(root: Path) -> list[Entry]:
    """Every artifact under ``root/objects`` with its size and last use."""
    out: list[Entry] = []
    objects = root / "objects"
    with contextlib.suppress(FileNotFoundError):
        for prefix in sorted(objects.iterdir()):
            if not prefix.is_dir():
                continue
            for folder in sorted(prefix.iterdir()):
                if folder.is_dir() and (e := _entry(folder, folder.name, False)) is not None:
                    out.append(e)
    return out


def quarantined(root: Path) -> list[Entry]:
    """Every folder moved aside to ``root/corrupt`` (never read again)."""
    out: list[Entry] = []
    with contextlib.suppress(FileNotFoundError):
        for folder in sorted((root / "corrupt").iterdir()):
            if (e := _entry(folder, folder.name.split("~")[0], True)) is not None:
                out.append(e)
    return out


@dataclass(frozen=True)
class Usage:
    """What a cache holds: artifacts, quarantined folders, leases."""

    root: Path
    artifacts: list[Entry]
    quarantined: list[Entry]
    leases: leases.LeaseScan

    @property
    def artifact_bytes(self) -> int:
        """Bytes of the artifacts."""
        return sum(e.size for e in self.artifacts)

    @property
    def quarantined_bytes(self) -> int:
        """Bytes of the quarantined folders."""
        return sum(e.size for e in self.quarantined)

    @property
    def total_bytes(self) -> int:
        """Bytes the size cap counts: artifacts and quarantined folders."""
        return self.artifact_bytes + self.quarantined_bytes


def usage(root: Path) -> Usage:
    """The cache at ``root`` as it is now (read only: nothing swept)."""
    return Usage(root, artifacts(root), quarantined(root), leases.scan(root))


@dataclass
class PruneReport:
    """What :func:`prune` removed (or, in a dry run, would remove)."""

    root: Path
    max_bytes: int
    before_bytes: int
    after_bytes: int
    removed: list[Entry] = field(default_factory=list)
    #: artifacts used since the oldest live lease started: never removed
    in_use: int = 0
    #: live leases of runs (a pruner's own lease is not counted)
    runs: int = 0
    swept_leases: int = 0
    artifacts_left: int = 0
    dry_run: bool = False

    @property
    def freed_bytes(self) -> int:
        """Bytes removed."""
        return sum(e.size for e in self.removed)

    def lines(self) -> list[str]:
        """The report for people: one line per removed folder, then :meth:`summary`."""
        verb = "would remove" if self.dry_run else "removed"
        return [
            f"{verb} {e.key[:16]}{' (quarantined)' if e.quarantined else ''}  "
            f"{format_size(e.size):>10}  last used {_when(e.last_used_ns)}"
            for e in self.removed
        ] + self.summary()

    def summary(self) -> list[str]:
        """What was freed, what is left, and why the cache is still over its cap if it is."""
        out: list[str] = []
        freed = "would free" if self.dry_run else "freed"
        out.append(
            f"{freed} {format_size(self.freed_bytes)} ({len(self.removed)} folder(s)); "
            f"cache {format_size(self.before_bytes)} -> {format_size(self.after_bytes)} "
            f"(cap {format_size(self.max_bytes)}), {self.artifacts_left} artifact(s) left"
        )
        if self.after_bytes > self.max_bytes:
            out.append(
                f"still over the cap: {self.in_use} artifact(s) are in use (used since the "
                f"oldest live lease began; {self.runs} run(s) hold one) and were kept; "
                "a later prune removes them once those runs have ended"
            )
        if self.swept_leases:
            out.append(f"swept {self.swept_leases} expired lease(s) of ended processes")
        return out


def _evict(root: Path, entry: Entry, cutoff_ns: int) -> bool:
    """Remove ``entry`` unless a run used it meanwhile; whether it was removed."""
    trash = root / "tmp" / f"{writer_tag()}~evict-{uuid.uuid4().hex}"
    try:
        os.rename(entry.path, trash)  # atomic: readers see it whole or absent
    except FileNotFoundError:
        return False  # another pruner was first
    if not entry.quarantined:
        try:
            used = (trash / MANIFEST).stat().st_mtime_ns
        except FileNotFoundError:
            used = 0
        if used >= cutoff_ns:  # used between our look and the rename: put it back
            try:
                os.rename(trash, entry.path)
            except OSError:  # recomputed meanwhile: theirs stays
                shutil.rmtree(trash, ignore_errors=True)
            return False
    shutil.rmtree(trash, ignore_errors=True)
    if not entry.quarantined:
        (root / RECORDS / entry.key).unlink(missing_ok=True)
        with Store._lock:
            Store._verified.pop(str(entry.path), None)
    return True


def prune(
    root: Path, max_bytes: int, *, dry_run: bool = False, lease: leases.Lease | None = None
) -> PruneReport:
    """Bring the cache at ``root`` under ``max_bytes`` (see the module's doc).

    ``lease``: the caller's own lease (a run pruning at its end); without one,
    the pruner takes its own for the time it works (none in a dry run, which
    changes nothing).
    """
    if lease is None and not dry_run:
        with leases.held(root, "prune") as own:
            return _prune(root, max_bytes, own, dry_run)
    return _prune(root, max_bytes, lease, dry_run)


def _prune(root: Path, max_bytes: int, own: leases.Lease | None, dry_run: bool) -> PruneReport:
    scan = leases.scan(root, sweep=not dry_run)
    starts = [lease.started_ns for lease in scan.live]
    if own is None:
        starts.append(time.time_ns())  # a dry run: what is used from now on is spared too
    cutoff = min(starts)
    arts = sorted(artifacts(root), key=lambda e: (e.last_used_ns, e.key))
    bad = sorted(quarantined(root), key=lambda e: (e.last_used_ns, e.key))
    before = sum(e.size for e in arts) + sum(e.size for e in bad)
    report = PruneReport(
        root=root,
        max_bytes=max_bytes,
        before_bytes=before,
        after_bytes=before,
        runs=sum(1 for lease in scan.live if lease.purpose != "prune"),
        swept_leases=0 if dry_run else len(scan.expired),
        dry_run=dry_run,
    )
    total = before
    left = len(arts)
    for entry in [*bad, *arts]:
        if total <= max_bytes:
            break
        if not entry.quarantined and entry.last_used_ns >= cutoff:
            break  # in use, and so is every artifact used after it
        if dry_run or _evict(root, entry, cutoff):
            report.removed.append(entry)
            total -= entry.size
            left -= 0 if entry.quarantined else 1
    report.after_bytes = total
    report.artifacts_left = left
    report.in_use = sum(1 for e in arts if e.last_used_ns >= cutoff)
    return report


@contextlib.contextmanager
def run_housekeeping(root: str, max_bytes: int | None, logger: Logger) -> Iterator[None]:
    """Hold a lease on the cache at ``root`` for the block; then prune it to ``max_bytes``.

    Pruning happens while the lease is still held (so what the run used is
    spared), after the block ends normally or with an error; it never fails the
    run. A bucket cache, or a folder outside the allowed roots (the run then
    fails with that message when it opens the store), gets neither lease nor prune.
    """
    if storage.at(root).shared() is not None:
        if max_bytes is not None:
            logger.warning(
                "cache.max_size is not applied to %s: bucket caches are not pruned "
                "(local caches only)",
                root,
            )
        yield
        return
    try:
        folder = ensure_allowed(root, "cache folder")
        lease: leases.Lease | None = leases.acquire(folder, "run")
    except Exception as exc:  # the store reports a bad cache folder with its own message
        logger.debug("no cache lease taken: %s", exc)
        lease, folder = None, Path(root)
    try:
        try:
            yield
        except Exception:
            _prune_after_run(folder, max_bytes, lease, logger)
            raise
        _prune_after_run(folder, max_bytes, lease, logger)
    finally:
        if lease is not None:
            leases.release(lease)


def _prune_after_run(
    folder: Path, max_bytes: int | None, lease: leases.Lease | None, logger: Logger
) -> None:
    if max_bytes is None or lease is None:
        return
    try:
        report = prune(folder, max_bytes, lease=lease)
    except Exception as exc:  # housekeeping never fails a run
        logger.warning("cache %s not pruned: %s", folder, exc)
        return
    for line in report.lines()[: len(report.removed)]:
        logger.debug("cache %s: %s", folder, line)
    if report.removed or report.after_bytes > max_bytes:
        for line in report.summary():
            logger.info("cache %s: %s", folder, line)
    else:
        logger.info(
            "cache %s: %s, under its cap of %s",
            folder,
            format_size(report.after_bytes),
            format_size(max_bytes),
        )
