"""``write.keep_last``: keep the newest N outputs of a templated ``write.path``.

A templated path (``outputs/gridsolve-{flow_run_name}.nc``) gives every run a
new file; after a successful run, :func:`keep_last` deletes the oldest files
matching the template so that at most N remain, newest by mtime. With them go
the files written beside each: ``<output>.quicklook.png``, ``<output>.loss.png``
and ``<output>.weights.safetensors``.

What is never deleted: the output this run just wrote; an output the run
reads or that holds what it reads (a ``load`` file, ``model.weights``, the
config file, the cache root or anything inside it, compared as
:func:`~gridsolve.stages.engine.overlap.refuse_destructive_outputs` compares)
or whose side file it reads (its weights as ``model.weights``): it is logged
as kept and does not count toward N, so the N newest outputs the run does
not read (this run's among them) still remain beside it; an output modified
after this run started (a concurrent run's, counted by the next run); anything
that is not a gridsolve output (a NetCDF file or Zarr store without the
global attribute ``gridsolve_config`` or ``source: gridsolve``); anything
outside ``GRIDSOLVE_ALLOWED_ROOTS``. Each
placeholder matches only what it renders to (``{scheduled_date}`` a date,
``{flow_run_id}`` a UUID, names: letters, digits, ``_``, ``-``, ``.``).
Local paths only: a URL's outputs are left alone.

Only outputs that the same writer made are ever deleted: every run of a
templated path records its output in a ledger kept beside the outputs
(``.gridsolve-keep-<digest>`` in the template's fixed folder), one per
deployment and template (``owner``: the deployment's name, ``local`` for
``gridsolve run``). A custom run of one deployment with another's naming
pattern, or a run with a new template that happens to match old files, deletes
nothing it did not write; outputs written before the ledger existed are left to
their owners.
"""

from __future__ import annotations

import glob
import logging
import re
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gridsolve.schemas.errors import GridsolveError
from gridsolve.stages.engine import storage
from gridsolve.stages.engine.hashing import hash_text
from gridsolve.stages.engine.overlap import Place, read_by_run
from gridsolve.stages.engine.paths import BESIDE_SUFFIXES, atomic_file, ensure_allowed
from gridsolve.stages.engine.provenance import is_gridsolve_output

#: What the writer and the flow put beside an output ``<output><suffix>``.
SIBLINGS = BESIDE_SUFFIXES

_PLACEHOLDER = re.compile(r"{(\w+)}")
#: What each placeholder renders to (schemas.templating.render_template).
_RENDERS = {
    "date": r"\d{4}-\d{2}-\d{2}",
    "scheduled_date": r"\d{4}-\d{2}-\d{2}",
    "scheduled_time": r"\d{8}T\d{6}Z",
    "flow_run_id": r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}|local",
}
_NAME = r"[\w.-]+"


def is_template(path: str) -> bool:
    """Whether ``path`` has ``{placeholders}``."""
    return bool(_PLACEHOLDER.search(path))


def _glob(template: str) -> str:
    parts = _PLACEHOLDER.split(template)  # literal, name, literal, name, …
    return "".join(glob.escape(p) if i % 2 == 0 else "*" for i, p in enumerate(parts))


def _regex(template: str) -> re.Pattern[str]:
    parts = _PLACEHOLDER.split(template)
    return re.compile(
        "".join(
            re.escape(p) if i % 2 == 0 else f"(?:{_RENDERS.get(p, _NAME)})"
            for i, p in enumerate(parts)
        )
    )


def matching_outputs(template: str) -> list[Path]:
    """Existing paths ``template`` could have rendered to (not siblings, not temporaries)."""
    rx = _regex(str(Path(template).expanduser().absolute()))
    out = []
    for found in glob.glob(_glob(str(Path(template).expanduser().absolute()))):
        if found.endswith(SIBLINGS) or ".gridsolve~" in found or not rx.fullmatch(found):
            continue
        out.append(Path(found))
    return out


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def _read_by_run(path: Path, reads: Sequence[Place]) -> Place | None:
    """What the run reads that deleting ``path`` (with its siblings) would destroy, or None."""
    for candidate in (str(path), *(f"{path}{s}" for s in SIBLINGS)):
        if (found := read_by_run(candidate, reads)) is not None:
            return found
    return None


def _on_disk(path: str) -> bool:
    """Whether ``path`` is on this host's file system (retention lists folders; not buckets)."""
    return storage.at(path).local is not None


def outputs_read(template: str, reads: Sequence[Place]) -> list[tuple[Path, Place]]:
    """The outputs matching ``template`` that the run reads (or whose siblings it reads)."""
    if not reads or not _on_disk(template) or not is_template(template):
        return []
    found = ((p, _read_by_run(p, reads)) for p in matching_outputs(template))
    return [(p, r) for p, r in found if r is not None]


def ledger_path(template: str, owner: str) -> Path:
    """Where the outputs ``owner`` made from ``template`` are recorded."""
    fixed = template.split("{", 1)[0]
    folder = Path(fixed) if fixed.endswith("/") else Path(fixed).parent
    digest = hash_text(owner + "\0" + template)[:16]
    return folder.expanduser() / f".gridsolve-keep-{digest}"


def record_output(template: str, written: str, owner: str) -> None:
    """Record that ``owner``'s run wrote ``written`` from ``template`` (local templates only)."""
    if not _on_disk(template) or not _on_disk(written) or not is_template(template) or not written:
        return
    # beside the outputs, so inside the folders this worker may write to
    ledger = ensure_allowed(ledger_path(template, owner), "keep_last ledger")
    line = f"{Path(written).expanduser().resolve()}\n"
    with open(ledger, "a", encoding="utf-8") as f:  # one short append: atomic in POSIX
        f.write(line)


def recorded(template: str, owner: str) -> set[Path]:
    """The outputs ``owner``'s runs recorded for ``template``."""
    try:
        text = ledger_path(template, owner).read_text(encoding="utf-8")
    except OSError:
        return set()
    return {Path(line) for line in text.splitlines() if line.strip()}


def _forget(template: str, owner: str, gone: Sequence[Path]) -> None:
    """Drop ``gone`` (and files no longer there) from ``owner``'s ledger of ``template``.

    A line appended meanwhile by a concurrent run may be lost: that output is then
    only ever kept, never deleted.
    """
    ledger = ledger_path(template, owner)
    keep = sorted(p for p in recorded(template, owner) if p not in set(gone) and p.exists())
    with atomic_file(ledger) as tmp:
        tmp.write_text("".join(f"{p}\n" for p in keep), encoding="utf-8")


def keep_last(
    template: str,
    written: str,
    n: int,
    started_ns: int,
    reads: Sequence[Place] = (),
    owner: str = "local",
) -> list[Path]:
    """Delete the oldest outputs matching ``template`` so at most ``n`` remain; what was deleted.

    ``written``: this run's output (always kept); ``started_ns``: when this run
    started (outputs modified since then belong to concurrent runs: kept);
    ``reads``: what the run reads (:func:`~gridsolve.stages.engine.overlap.run_reads`):
    an output that is one of them, or whose sibling is, is kept and not counted.
    Deletes the outputs' siblings too. Only outputs ``owner`` recorded
    (:func:`record_output`) are candidates. Nothing happens for a URL or a path
    without placeholders.
    """
    if not _on_disk(template) or not _on_disk(written) or not is_template(template):
        return []
    protected = {p for p, _ in outputs_read(template, reads)}
    mine = Path(written).expanduser().resolve()
    ours = recorded(template, owner)
    others: list[tuple[int, Path]] = []
    for path in matching_outputs(template):
        try:
            if path.resolve() == mine or path in protected or path.resolve() not in ours:
                continue
            mtime = path.stat().st_mtime_ns
        except OSError:
            continue
        others.append((mtime, path))
    others.sort(reverse=True)  # newest first
    removed: list[Path] = []
    for mtime, path in others[max(0, n - 1) :]:
        if mtime >= started_ns or not is_gridsolve_output(path):
            continue
        try:
            ensure_allowed(path, "output file")
        except GridsolveError:
            continue
        for sibling in SIBLINGS:
            Path(f"{path}{sibling}").unlink(missing_ok=True)
        _remove(path)
        removed.append(path)
    if removed:
        _forget(template, owner, [p.resolve() for p in removed])
    return removed


def apply_keep_last(
    config: Any,
    written: str,
    started_ns: int,
    logger: logging.Logger | logging.LoggerAdapter[Any],
    reads: Sequence[Place] = (),
    owner: str = "local",
) -> list[Path]:
    """Record this run's output, then :func:`keep_last` if ``keep_last`` is set; never raises.

    ``reads``: what the run reads, never deleted (each kept output is logged);
    ``owner``: the deployment's name (``local`` outside one). The output is
    recorded whether or not ``keep_last`` is set, so that setting it later
    counts the runs before.
    """
    n = getattr(config, "keep_last", None)
    template = getattr(config, "path", None)
    if not isinstance(template, str) or not written:
        return []
    try:
        record_output(template, written, owner)
    except (OSError, ValueError, GridsolveError) as exc:
        logger.warning(
            "write.keep_last: %s not recorded, it will never be removed: %s", written, exc
        )
    if n is None:
        return []
    if not _on_disk(template):
        logger.info("write.keep_last is not applied to %s: local paths only", template)
        return []
    if not is_template(template):
        return []
    try:
        for path, read in outputs_read(template, reads):
            logger.info(
                "write.keep_last %d: kept the old output %s because the run reads it (%s %s); "
                "not counted toward keep_last",
                n,
                path,
                read.label,
                read.path,
            )
        removed = keep_last(template, written, int(n), started_ns, reads, owner)
    except (OSError, ValueError) as exc:  # a broken ledger (not UTF-8) among them
        logger.warning("write.keep_last: old outputs not removed: %s", exc)
        return []
    for path in removed:
        logger.info("write.keep_last %d: removed the old output %s (and its pictures)", n, path)
    return removed
