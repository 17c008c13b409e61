"""Putting an output in place, on a disk or in a bucket: checked first, whole when it appears.

The storage layer's output operations (:meth:`Location.check_output`,
:meth:`Location.staged_file`, :meth:`Location.staged_store`) do their work
here; :func:`~gridsolve.stages.engine.storage.at` picks the local or the bucket
half once, so the writers call one operation and never ask where the output
goes. What each half keeps:

- Only a previous gridsolve output is ever replaced (its provenance attribute,
  or the mark a killed gridsolve writer left in a bucket); an input, someone's
  data or a file in the way of a folder is refused with one clear error.
- A local file is written to a temporary file beside it and renamed over it
  (:func:`~gridsolve.stages.engine.paths.atomic_file`, in the writer: the same
  code writes a bucket's file in its staging folder). A file for a bucket is
  written in a private local folder, uploaded with the files beside it to
  temporary keys, each checked, and only then copied into place; a failure
  after the first copy deletes what was copied.
- A local Zarr store is built in a temporary folder and renamed into place. A
  bucket has no rename: its store is written in place, the old store's
  consolidated metadata deleted first and the new one's written last, so a
  reader that honours it sees no complete store until the new one is whole; a
  failure deletes what was written.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gridsolve.schemas.errors import GridsolveError, OutputError
from gridsolve.stages.engine import remote
from gridsolve.stages.engine.paths import (
    BESIDE_SUFFIXES,
    atomic_folder,
    ensure_allowed,
    ensure_allowed_url,
    sweep_dead_temporaries,
)
from gridsolve.stages.engine.provenance import ZARR_MARKERS, is_gridsolve_output

#: The object that marks a store in a bucket as being written by gridsolve (removed last).
WRITING = ".gridsolve-writing"
#: A Zarr store's consolidated metadata: the mark of a complete store, written last.
CONSOLIDATED = ".zmetadata"
#: Writes the file ``<output><suffix>`` at the path it is given.
SideWriter = Callable[[Path], None]


@dataclass
class Staged:
    """An output file on its way: where to write it now; once published, what identifies it."""

    #: the local path to write the file at (the files beside it: ``<path><suffix>``)
    path: Path
    #: what ``describe`` said once the file was published
    facts: dict[str, Any] = field(default_factory=dict)


# ---------------------------------------------------------------- before writing
def check_output_path(path: str, overwrite: bool, folder: bool, stage: str) -> Path:
    """The output path, its folder created if missing; OutputError if it cannot be written.

    ``folder``: the output is itself a folder (a Zarr store), replaced as a whole.
    Only a previous gridsolve output is ever replaced (see :func:`refuse_foreign`).
    """
    p = ensure_allowed(path, "output file", stage)
    parent = p.parent
    if parent.exists() and not parent.is_dir():
        raise OutputError(f"output folder {parent} is a file", stage=stage, fix="fix write.path")
    try:
        parent.mkdir(
            parents=True, exist_ok=True
        )  # like mkdir -p: nightly runs write into new folders
    except OSError as exc:
        raise OutputError(
            f"cannot create the output folder {parent}: {exc.strerror or exc}",
            stage=stage,
            fix="set write.path to a writable location, or create the folder first",
        ) from exc
    if not os.access(parent, os.W_OK | os.X_OK):
        raise OutputError(
            f"output folder {parent} is not writable",
            stage=stage,
            fix="set write.path to a writable folder, or fix its permissions",
        )
    if p.is_dir() and not folder:
        raise OutputError(
            f"output path {p} is a folder", stage=stage, fix="set write.path to a file name"
        )
    if folder and p.exists() and not p.is_dir():
        raise OutputError(
            f"output path {p} is a file, not a Zarr store",
            stage=stage,
            fix="set write.path to a new name (e.g. out.zarr), or remove the file",
        )
    if p.exists() and not overwrite:
        raise OutputError(
            f"output file {p} exists and write.overwrite is false",
            stage=stage,
            fix="remove it, set write.overwrite: true, or template write.path with {flow_run_name}",
        )
    refuse_foreign(p, folder, stage)
    return p


def refuse_foreign(p: Path, folder: bool, stage: str) -> None:
    """OutputError when ``p`` exists and is not an output gridsolve wrote (it is never replaced).

    Replacing means deleting, so both writers replace only what carries the
    provenance every gridsolve output has (``gridsolve_config``; see
    :func:`~gridsolve.stages.engine.provenance.is_gridsolve_output`): a Zarr
    store of either format version, a NetCDF file, or anything else without it
    (someone's data, an input) is left as it is. An empty file or folder holds
    nothing to lose and is replaced.
    """
    if folder and p.is_dir():
        if not any(p.iterdir()) or is_gridsolve_output(p):
            return
        if any((p / m).exists() for m in ZARR_MARKERS):
            raise OutputError(
                f"output path {p} is a Zarr store that gridsolve did not write (its attributes "
                "carry no gridsolve provenance); it is left as it is",
                stage=stage,
                fix="set write.path to a new name (e.g. out.zarr); only a previous gridsolve "
                "output is replaced",
            )
        raise OutputError(
            f"output path {p} is a folder that is not a Zarr store; it is left as it is",
            stage=stage,
            fix="set write.path to a new name (e.g. out.zarr) or to an existing store",
        )
    if not folder and p.is_file() and p.stat().st_size > 0 and not is_gridsolve_output(p):
        raise OutputError(
            f"output file {p} exists and is not a gridsolve output (no gridsolve_config "
            "attribute); it is left as it is",
            stage=stage,
            fix="set write.path to a new name, or remove that file yourself if it may go; only "
            "a previous gridsolve output is replaced",
        )


def check_output_url(
    url: str, overwrite: bool, options: Mapping[str, Any], folder: bool, stage: str
) -> str:
    """The output URL; OutputError if its bucket is missing or refuses us, or it is not replaceable.

    ``folder``: the output is a prefix (a Zarr store), replaced as a whole.
    """
    url = ensure_allowed_url(url.rstrip("/"), "output URL", stage)
    # A store is probed inside its own prefix: a policy that refuses writes there is
    # found before the previous store is touched.
    where = url if folder else url.rsplit("/", 1)[0]
    remote.probe_writable(where, options, "output", OutputError, stage, shown=url)
    with remote.translated(url, "output", OutputError, stage, options):
        objects = remote.find(url, options)
        # a complete store, or what a killed gridsolve writer left (its marker object)
        is_store = f"{url}/{WRITING}" in objects or (
            f"{url}/{CONSOLIDATED}" in objects and _store_is_ours(url, options)
        )
        is_object = url in objects
    if folder and is_object:
        raise OutputError(
            f"output URL {url} is an object, not a Zarr store",
            stage=stage,
            fix="set write.path to a new name (e.g. s3://bucket/out.zarr), or remove the object",
        )
    if objects and not is_object and not (folder and is_store):
        raise OutputError(
            f"output URL {url} is a prefix holding objects that are not "
            f"{'a gridsolve Zarr store' if folder else 'one file'}; they are left as they are",
            stage=stage,
            fix="set write.path to a new name",
        )
    if objects and not overwrite:
        raise OutputError(
            f"output {url} exists and write.overwrite is false",
            stage=stage,
            fix="remove it, set write.overwrite: true, or template write.path with {flow_run_name}",
        )
    return url


def _store_is_ours(url: str, options: Mapping[str, Any]) -> bool:
    """Whether the consolidated Zarr store at ``url`` carries gridsolve's provenance."""
    try:
        raw = remote.filesystem(url, options).cat_file(f"{url}/{CONSOLIDATED}")
        attrs = json.loads(raw).get("metadata", {}).get(".zattrs", {})
    except (OSError, ValueError, AttributeError):
        return False
    return isinstance(attrs, dict) and "gridsolve_config" in attrs


def staging_root() -> Path:
    """The local folder of the private folders that outputs for a bucket are written in."""
    root = remote.mirror_root() / "outputs"
    root.mkdir(parents=True, exist_ok=True)
    return root


# ---------------------------------------------------------------- a file for a bucket
@contextlib.contextmanager
def uploaded_file(
    url: str,
    options: Mapping[str, Any],
    suffixes: Sequence[str],
    describe: Callable[[], dict[str, Any]],
) -> Iterator[Staged]:
    """A private local folder to write the file for ``url`` (and ``<it><suffix>``) in.

    When the block succeeds, every file is uploaded to a temporary key and
    checked before any is copied into place, so a failed upload leaves the
    previous output (and side files) as they were; then ``describe`` is asked
    what identifies them. A failure from the first copy on deletes what was copied.
    """
    sides = list(suffixes)
    targets = [url] + [f"{url}{suffix}" for suffix in sides]
    staging = Path(tempfile.mkdtemp(prefix="write-", dir=staging_root()))
    out = Staged(staging / url.rsplit("/", 1)[-1])
    uploaded: list[str] = []
    published: list[str] = []
    try:
        yield out
        files = [out.path] + [Path(f"{out.path}{suffix}") for suffix in sides]
        uploaded = [
            remote.stage_upload(
                f, t, options, "output file" if f == out.path else f"side file {f.name}"
            )
            for f, t in zip(files, targets, strict=True)
        ]
        for tmp, target in zip(uploaded, targets, strict=True):
            remote.publish(tmp, target, options, "output file")
            published.append(target)
        out.facts = describe()
    except BaseException:
        for done in published:  # a run that failed leaves no half-published output behind
            with contextlib.suppress(Exception):
                remote.remove(done, options)
        raise
    finally:
        for tmp in uploaded:
            with contextlib.suppress(Exception):
                remote.remove(tmp, options)
        shutil.rmtree(staging, ignore_errors=True)


# ---------------------------------------------------------------- a Zarr store
@contextlib.contextmanager
def renamed_store(final: Path, sides: Mapping[str, SideWriter], stage: str) -> Iterator[str]:
    """A temporary folder beside ``final`` to build a store in, renamed into place when complete.

    The files ``sides`` write beside the store follow it, once it is in place.
    """
    sweep_dead_temporaries(final)
    try:
        with atomic_folder(final) as tmp:
            yield str(tmp)
        for suffix, write in sides.items():
            write(Path(f"{final}{suffix}"))
    except GridsolveError:
        raise
    except (OSError, RuntimeError) as exc:
        raise OutputError(
            f"writing {final} failed",
            stage=stage,
            found=f"{type(exc).__name__}: {exc}",
            fix="check write.path and the free space; nothing was written under the final name",
        ) from exc


@contextlib.contextmanager
def store_in_bucket(
    url: str, options: Mapping[str, Any], sides: Mapping[str, SideWriter], stage: str
) -> Iterator[str]:
    """The store's URL to write into in place; :data:`CONSOLIDATED` goes first out and last in.

    A bucket has no rename: the old store's consolidated metadata is deleted
    before anything else changes, so from then on readers that honour it
    (gridsolve, ``xarray.open_zarr(consolidated=True)``) see no complete store
    until the block has written the new one's, last. The files ``sides`` write
    beside the store are then uploaded, verified. A failure deletes what was written.
    """
    # what describes the old store goes with it
    beside = [f"{url}{suffix}" for suffix in dict.fromkeys((*BESIDE_SUFFIXES, *sides))]
    with remote.translated(url, "output", OutputError, stage, options):
        remote.remove(f"{url}/{CONSOLIDATED}", options)
        remote.remove(url, options)
        for extra in beside:
            remote.remove(extra, options)
        # Marks the prefix as gridsolve's own store being written, so that what a killed
        # writer leaves is replaced by the next run rather than refused as someone's data.
        remote.filesystem(url, options).pipe_file(f"{url}/{WRITING}", b"gridsolve")
        try:
            yield url
            if sides:
                _upload_sides(url, options, sides)
            remote.remove(f"{url}/{WRITING}", options)
        except BaseException:
            with contextlib.suppress(Exception):
                remote.remove(f"{url}/{CONSOLIDATED}", options)
                remote.remove(url, options)
                for suffix in sides:
                    remote.remove(f"{url}{suffix}", options)
            raise


def _upload_sides(url: str, options: Mapping[str, Any], sides: Mapping[str, SideWriter]) -> None:
    """Write the files beside a store in a private local folder and upload each, verified."""
    staging = Path(tempfile.mkdtemp(prefix="write-", dir=staging_root()))
    try:
        store_name = staging / url.rsplit("/", 1)[-1]
        for suffix, write in sides.items():
            write(Path(f"{store_name}{suffix}"))
            remote.upload(Path(f"{store_name}{suffix}"), f"{url}{suffix}", options, "side file")
    finally:
        shutil.rmtree(staging, ignore_errors=True)
