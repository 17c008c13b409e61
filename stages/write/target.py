"""Where an output goes and whether it may: the checks both writers make before writing.

A local output's folder is made, must be writable, and an existing file or
store there is replaced only when it is a previous gridsolve output
(:func:`refuse_foreign`); a bucket output's bucket must exist and take our
writes. After writing, the facts of what was written (size and checksum, or an
object's identity) are what a cache hit checks (:func:`still_valid`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from gridsolve.schemas.errors import OutputError
from gridsolve.schemas.kinds.write import NetCDFWrite, ZarrWrite
from gridsolve.schemas.metadata import WriteMeta
from gridsolve.stages.engine import remote, storage
from gridsolve.stages.engine.paths import ensure_allowed, ensure_allowed_url
from gridsolve.stages.engine.provenance import ZARR_MARKERS, is_gridsolve_output

#: The stage named in errors when the caller names none.
STAGE = "write/netcdf"


def free_bytes(folder: Path) -> int:
    """Bytes free to us in ``folder`` (a huge number where that cannot be known)."""
    try:
        st = os.statvfs(folder)
    except OSError:
        return 2**62
    return st.f_bavail * st.f_frsize


def check_output_url(
    url: str,
    overwrite: bool,
    options: Mapping[str, Any],
    folder: bool = False,
    stage: str = STAGE,
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
        is_store = f"{url}/.gridsolve-writing" in objects or (
            f"{url}/.zmetadata" in objects and _store_is_ours(url, options)
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
        raw = remote.filesystem(url, options).cat_file(f"{url}/.zmetadata")
        attrs = json.loads(raw).get("metadata", {}).get(".zattrs", {})
    except (OSError, ValueError, AttributeError):
        return False
    return isinstance(attrs, dict) and "gridsolve_config" in attrs


def check_write_target(config: Any) -> None:
    """Before any work: a bucket output's bucket exists, takes our writes, may be replaced.

    Local outputs are checked by the writer (their folder is made then); a
    plugin writer's config without ``path``/``overwrite`` is left to the plugin.
    """
    if isinstance(config, NetCDFWrite | ZarrWrite) and storage.at(config.path).local is None:
        check_output_url(
            config.path,
            config.overwrite,
            config.storage_options,
            folder=isinstance(config, ZarrWrite),
            stage=f"write/{config.impl}",
        )


def check_output_path(path: str, overwrite: bool, folder: bool = False, stage: str = STAGE) -> Path:
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
    :func:`~gridsolve.stages.write.retention.is_gridsolve_output`): a Zarr
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


def staging_root() -> Path:
    """The local folder of the private folders that outputs for a bucket are written in."""
    root = remote.mirror_root() / "outputs"
    root.mkdir(parents=True, exist_ok=True)
    return root


def url_facts(url: str, options: Mapping[str, Any]) -> dict[str, Any]:
    """URL, size and ETag of an object the writer made, and how to reach it (no credentials)."""
    return storage.at(url, options).facts()


def file_facts(path: Path) -> dict[str, Any]:
    """Path, size and xxh3 of a file the writer made (what ``still_valid`` checks)."""
    return storage.at(path).facts()


def _unchanged(facts: Mapping[str, Any]) -> bool:
    return storage.at(facts["path"], facts.get("storage_options")).unchanged(facts)


def still_valid(meta: Mapping[str, Any]) -> bool:
    """Whether the files a stored write artifact describes are still there, unchanged."""
    return _unchanged(meta) and sides_unchanged(meta)


def side_facts(
    output: str | Path, suffixes: Iterable[str], options: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """The write meta's ``side_files`` entry: facts of each ``<output><suffix>`` ({} if none).

    Objects beside a URL output are identified as :func:`url_facts` does (``options``:
    the bucket's storage options), local files as :func:`file_facts` does.
    """
    facts = {s: storage.at(f"{output}{s}", options).facts() for s in suffixes}
    return {"side_files": facts} if facts else {}


def sides_unchanged(meta: Mapping[str, Any]) -> bool:
    """Whether the files a stored write artifact describes beside its output are unchanged."""
    return all(_unchanged(facts) for facts in WriteMeta.of(meta).side_files.values())
