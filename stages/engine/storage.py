"""One storage layer: a local folder and an object-store URL behind the same operations.

Design decision (issue 28, item 4). Every path gridsolve reads or writes —
an input, an output, the cache root — is turned into a :class:`Location` by
:func:`at`, and the caller asks the location to do things: make itself
absolute, compare itself with another (same place, inside, matched by a
glob), list a glob, exist, give a local file to read, describe and check the
identity of what it holds, store a few bytes atomically, hold the cache, and
take an output: check it may be (re)placed, stage it, publish it whole
(:meth:`Location.staged_file`, :meth:`Location.staged_store`; the work is in
:mod:`~gridsolve.stages.engine.staging`). Only
this module asks whether a path is a URL (a test counts the calls): the
answer picks :class:`LocalPath` or :class:`ObjectPath` once, and from then on
the operations differ by class, not by ``if``.

Why two small classes over a plain fsspec filesystem, rather than fsspec's
``LocalFileSystem`` for local paths as well (as pangeo-forge's
``FSSpecTarget`` does): the local hot path — the cache's checksums, renames
and stat calls — stays plain ``os``/``pathlib`` calls with no fsspec
overhead, and local semantics fsspec does not model (symbolic and hard
links, letter case, folders above a path) keep their exact behaviour.
Object stores go through fsspec (:mod:`~gridsolve.stages.engine.remote`,
this layer's driver for them). The cache store
(:class:`~gridsolve.stages.engine.store.Store`) is one class over a location:
a local folder is its own shared copy; an object location is shared through
this host's folder (:meth:`Location.shared`).

What is genuinely different between a disk and a bucket is behind these
operations: an atomic rename against an upload copied into place, a Zarr store
renamed into place against one written in place with its consolidated
metadata last. The few callers that still read :attr:`Location.local` (the
local file system path, or None where there is none) are listed, with why, in
``tests/stages/test_storage_layer.py``. The one place outside this layer that
still tests whether a string is a URL is the config edge,
:func:`gridsolve.schemas.base.check_url`, which refuses unsupported schemes
while a config is validated (schemas import nothing of the stages).
"""

from __future__ import annotations

import fnmatch
import glob as _glob
import os
import posixpath
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any

from gridsolve.schemas.base import is_url as _is_url
from gridsolve.schemas.errors import GridsolveError
from gridsolve.stages.engine import remote, staging
from gridsolve.stages.engine.hashing import canonical_json, file_digest, hash_text
from gridsolve.stages.engine.paths import atomic_file, ensure_allowed, ensure_allowed_url
from gridsolve.stages.engine.staging import SideWriter, Staged

_MAGIC = set("*?[")
Blame = tuple[str, type[GridsolveError], str | None]
"""How a failure is reported: (what, error class, stage), as :func:`remote.translated` takes."""


class Location:
    """A path or URL gridsolve reads or writes, with the operations the pipeline needs."""

    #: the local file system path, or None for an object in a bucket
    local: Path | None = None
    #: what one item here is called in messages ("file", "object")
    noun = "file"
    #: whether a glob here is expanded by listing it now (cheap), not kept as a pattern
    #: (listing a bucket costs a request per check)
    lists_globs = True

    def __init__(self, text: str, options: Mapping[str, Any] | None = None) -> None:
        self.text = text
        self.options: dict[str, Any] = dict(options or {})

    def __str__(self) -> str:
        return self.text

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.text!r})"

    def is_pattern(self) -> bool:
        """Whether this names a glob (characters ``*?[`` that do not name an existing path)."""
        return any(c in _MAGIC for c in self.text)

    def absolute(self) -> str:
        """The absolute form (a local path expanded and made absolute; a URL as is)."""
        return self.text

    def normal(self) -> str:
        """A comparable form: the real path in the file system's case, or the URL tidied."""
        raise NotImplementedError

    def inside(self, outer: Location) -> bool:
        """Whether this (normalised) is ``outer`` or lies under it; never across kinds."""
        if type(outer) is not type(self):
            return False
        inner, out = self.normal(), outer.normal()
        return inner == out or inner.startswith(out.rstrip(self._sep) + self._sep)

    _sep = "/"

    def matched_by(self, pattern: Location) -> bool:
        """Whether this (normalised) is a path the glob ``pattern`` matches (``*``: one level)."""
        raise NotImplementedError

    def same_kind(self, other: Location) -> bool:
        """Whether ``other`` lives on the same kind of storage (comparisons are meaningful)."""
        return type(other) is type(self)

    def glob(self, blame: Blame) -> list[str]:
        """What this pattern matches now, sorted."""
        raise NotImplementedError

    def glob_fix(self, hint: str) -> str:
        """How to fix a pattern that matches nothing (``hint``: the local folder's context)."""
        return f"check the pattern and the folder ({hint})"

    def exists(self) -> bool:
        """Whether something is there now."""
        raise NotImplementedError

    def holds_any(self, names: tuple[str, ...], blame: Blame) -> bool:
        """Whether this is a folder (or prefix) holding one of ``names``."""
        raise NotImplementedError

    def files_under(self, blame: Blame) -> list[str]:
        """Every file (or object) under this folder (or prefix), sorted."""
        raise NotImplementedError

    def is_folder(self, marker: str) -> bool:
        """Whether this is a folder; for an object store, a prefix holding ``marker``."""
        raise NotImplementedError

    def relative(self, path: str) -> str:
        """``path`` (a file under this folder) named relative to it."""
        raise NotImplementedError

    def readable(self) -> str:
        """A local file path with these bytes (a verified local copy of an object)."""
        return self.text

    def open_options(self) -> dict[str, Any] | None:
        """The ``storage_options`` xarray/zarr open this with (None: a local path)."""
        return None

    def native(self) -> Path | str:
        """The path as the code that opens it holds it: a ``Path``, or an object's URL."""
        return self.text

    def stat(self) -> os.stat_result | None:
        """The status of an existing local path; None for an object or a missing path."""
        return None

    def file_id(self) -> tuple[int, int] | None:
        """(device, inode) of an existing local path; None for an object or a missing path."""
        return None

    def folders_above(self, parent: bool = False) -> list[tuple[int, int]]:
        """Identities of this path (``parent``: its folder) and each existing folder above it.

        None for an object: a bucket has no folders with identities.
        """
        return []

    def write_bytes(self, data: bytes) -> None:
        """Store ``data`` here whole or not at all (temp + rename; one PUT)."""
        raise NotImplementedError

    def facts(self) -> dict[str, Any]:
        """What identifies the file here now: path, size and a checksum (or the ETag)."""
        raise NotImplementedError

    def unchanged(self, facts: Mapping[str, Any]) -> bool:
        """Whether the file here is still the one :meth:`facts` described."""
        raise NotImplementedError

    def folder_facts(self) -> dict[str, Any]:
        """What identifies the folder (or prefix) here now: path, size, a digest of its files.

        The digest covers every file's name and checksum (an object's ETag).
        """
        raise NotImplementedError

    def folder_unchanged(self, facts: Mapping[str, Any]) -> bool:
        """Whether the folder here is still the one :meth:`folder_facts` described."""
        raise NotImplementedError

    # ------------------------------------------------------------ an output, whole or absent
    def check_output(self, overwrite: bool, *, folder: bool, stage: str) -> Location:
        """The place checked as an output: the location to write (resolved; a URL tidied).

        OutputError if it cannot be written, or holds what may not be replaced
        (only a previous gridsolve output is). ``folder``: the output is a folder
        (a Zarr store), replaced as a whole.
        """
        raise NotImplementedError

    def precheck_output(self, overwrite: bool, *, folder: bool, stage: str) -> None:
        """Before any work: the checks of :meth:`check_output` that leave nothing behind."""
        raise NotImplementedError

    def staged_file(
        self, suffixes: Sequence[str], describe: Callable[[], dict[str, Any]]
    ) -> AbstractContextManager[Staged]:
        """Where on this host to write an output file for here; published when the block succeeds.

        The block writes the file at ``Staged.path`` through a temporary file
        renamed over it (a failure meanwhile leaves the previous file), then the
        files ``<path><suffix>`` of ``suffixes`` beside it. Then the output is
        published here (for a bucket: only now, and only if the block succeeded)
        and ``describe`` is asked what identifies it (``Staged.facts``).
        """
        raise NotImplementedError

    def staged_store(
        self, sides: Mapping[str, SideWriter], stage: str
    ) -> AbstractContextManager[str]:
        """Where to write a Zarr store that appears here whole; ``sides`` then written beside it.

        The block writes the store (its consolidated metadata last) at the
        location yielded, opened with :meth:`open_options`. A failure leaves no
        partial store under this name.
        """
        raise NotImplementedError

    def shared(self) -> ObjectPath | None:
        """Where a cache here is shared with other hosts, beyond this host's folder.

        None: the folder itself is shared (a local disk, or a mount every worker sees).
        """
        return None

    def confine(self, what: str, stage: str | None = None) -> None:
        """OutputError if writes are confined and this is outside the allowed places."""
        raise NotImplementedError

    def cache_folder(self, errors: type[GridsolveError]) -> Path:
        """The folder of a cache here on this host (checked allowed; a bucket checked writable)."""
        raise NotImplementedError

    def host_folder(self) -> Path:
        """The folder of a cache here on this host, unchecked (the folder, or the bucket's copy)."""
        raise NotImplementedError


class LocalPath(Location):
    """A path on this host's file system (a local disk, or a shared mount)."""

    _sep = os.sep

    def __init__(self, text: str, options: Mapping[str, Any] | None = None) -> None:
        super().__init__(text, options)
        self.local = Path(text)

    def is_pattern(self) -> bool:
        """Whether this names a glob (and no existing path: a folder may be named "exp[2]")."""
        return super().is_pattern() and not os.path.exists(self.text)

    def absolute(self) -> str:
        """The path expanded (``~``) and made absolute."""
        return os.path.abspath(os.path.expanduser(self.text))

    def normal(self) -> str:
        """The real path (links, ``..``) in the file system's case."""
        return os.path.normcase(os.path.realpath(self.text))

    def matched_by(self, pattern: Location) -> bool:
        """Whether this path is one the glob ``pattern`` matches (its folders resolved too)."""
        if not isinstance(pattern, LocalPath):
            return False
        path = self.normal()
        head, tail = os.path.split(pattern.text)
        want = pattern.text
        if not any(c in head for c in _MAGIC):
            want = os.path.join(at(head).normal(), os.path.normcase(tail))
        got, parts = path.split(os.sep), want.split(os.sep)
        return len(got) == len(parts) and all(map(fnmatch.fnmatchcase, got, parts))

    def glob(self, blame: Blame) -> list[str]:
        """The paths the pattern matches now, sorted."""
        return sorted(_glob.glob(self.text))

    def exists(self) -> bool:
        """Whether the path exists."""
        return os.path.exists(self.text)

    def holds_any(self, names: tuple[str, ...], blame: Blame) -> bool:
        """Whether this is a folder with one of ``names`` in it."""
        p = Path(self.text)
        return p.is_dir() and any((p / m).exists() for m in names)

    def is_folder(self, marker: str) -> bool:
        """Whether this is a folder (``marker`` is for buckets, which have none)."""
        return Path(self.text).is_dir()

    def files_under(self, blame: Blame) -> list[str]:
        """Every file in the folder tree, sorted."""
        found = []
        for root, _dirs, names in os.walk(self.text):
            found += [os.path.join(root, n) for n in names]
        return sorted(found)

    def relative(self, path: str) -> str:
        """``path`` relative to this folder."""
        return os.path.relpath(path, self.text)

    def native(self) -> Path | str:
        """The path as a ``Path``."""
        return Path(self.text)

    def stat(self) -> os.stat_result | None:
        """The path's status; None if it does not exist."""
        try:
            return os.stat(self.text)
        except OSError:
            return None

    def file_id(self) -> tuple[int, int] | None:
        """(device, inode) of the existing path; None if it does not exist."""
        st = self.stat()
        return None if st is None else (st.st_dev, st.st_ino)

    def folders_above(self, parent: bool = False) -> list[tuple[int, int]]:
        """Identities of this path (``parent``: its folder) and each existing folder above it.

        Nearest first.
        """
        out = []
        here = os.path.abspath(os.path.dirname(self.text) if parent else self.text)
        while True:
            ident = LocalPath(here).file_id()
            if ident is not None:
                out.append(ident)
            up = os.path.dirname(here)
            if up == here:
                return out
            here = up

    def write_bytes(self, data: bytes) -> None:
        """Write ``data`` to a temporary file beside the path and rename it into place."""
        with atomic_file(Path(self.text)) as tmp:
            tmp.write_bytes(data)

    def facts(self) -> dict[str, Any]:
        """Path, size and xxh3 of the file."""
        p = Path(self.text)
        return {"path": str(p), "size": p.stat().st_size, "xxh3": file_digest(p)}

    def confine(self, what: str, stage: str | None = None) -> None:
        """OutputError if the path is outside the allowed roots."""
        ensure_allowed(self.text, what, stage)

    def cache_folder(self, errors: type[GridsolveError]) -> Path:
        """The folder itself, resolved."""
        return ensure_allowed(self.text, "cache folder")

    def host_folder(self) -> Path:
        """The folder, expanded and resolved."""
        return Path(self.text).expanduser().resolve()

    def unchanged(self, facts: Mapping[str, Any]) -> bool:
        """Same size and xxh3 as recorded."""
        p = Path(self.text)
        try:
            return bool(p.stat().st_size == facts["size"] and file_digest(p) == facts["xxh3"])
        except OSError:
            return False

    def folder_facts(self) -> dict[str, Any]:
        """Path, size and a digest of every file of the folder (names included)."""
        path = Path(self.text)
        files = sorted(p for p in path.rglob("*") if p.is_file())
        digests = [[str(p.relative_to(path)), file_digest(p)] for p in files]
        return {
            "path": str(path),
            "size": sum(p.stat().st_size for p in files),
            "xxh3": hash_text(canonical_json(digests)),
        }

    def folder_unchanged(self, facts: Mapping[str, Any]) -> bool:
        """A folder still, with the same files and bytes as recorded."""
        try:
            if not Path(self.text).is_dir():
                return False
            return self.folder_facts() == {k: facts[k] for k in ("path", "size", "xxh3")}
        except OSError:
            return False

    def check_output(self, overwrite: bool, *, folder: bool, stage: str) -> Location:
        """The path resolved, its folder made and writable, what is there replaceable."""
        checked = staging.check_output_path(self.text, overwrite, folder, stage)
        return LocalPath(str(checked), self.options)

    def precheck_output(self, overwrite: bool, *, folder: bool, stage: str) -> None:
        """Nothing: checking would make the output's folder; the writer checks it then.

        (A foreign file or store there is refused before any work by
        :func:`~gridsolve.stages.engine.overlap.refuse_destructive_outputs`.)
        """

    @contextmanager
    def staged_file(
        self, suffixes: Sequence[str], describe: Callable[[], dict[str, Any]]
    ) -> Iterator[Staged]:
        """The path itself: the writer's temporary file renamed over it is the publication."""
        out = Staged(Path(self.text))
        yield out
        out.facts = describe()

    def staged_store(
        self, sides: Mapping[str, SideWriter], stage: str
    ) -> AbstractContextManager[str]:
        """A temporary folder beside the path, renamed into place when the block succeeds."""
        return staging.renamed_store(Path(self.text), sides, stage)


class ObjectPath(Location):
    """An object, or a prefix of objects, in an object store (``s3://bucket/key``)."""

    noun = "object"
    lists_globs = False

    def normal(self) -> str:
        """The URL with its scheme and bucket in lower case and its key normalised."""
        scheme, rest = self.text.split("://", 1)
        bucket, _, key = rest.partition("/")
        key = posixpath.normpath("/" + key).lstrip("/") if key else ""
        return f"{scheme.lower()}://{bucket.lower()}/{key}".rstrip("/")

    def matched_by(self, pattern: Location) -> bool:
        """Whether this URL is one the glob ``pattern`` (a URL) matches."""
        if not isinstance(pattern, ObjectPath):
            return False
        return fnmatch.fnmatchcase(self.normal(), pattern.normal())

    def glob(self, blame: Blame) -> list[str]:
        """URLs of the objects the pattern matches, sorted (a listing request)."""
        with self.translated(blame):
            return remote.glob(self.text, self.options)

    def glob_fix(self, hint: str) -> str:
        """Keys are case-sensitive: check the prefix."""
        return "check the pattern and the bucket's prefix (keys are case-sensitive)"

    def exists(self) -> bool:
        """Whether an object (or a prefix with objects) is there."""
        return remote.exists(self.text, self.options)

    def holds_any(self, names: tuple[str, ...], blame: Blame) -> bool:
        """Whether the prefix holds an object named one of ``names``."""
        with self.translated(blame):
            base = self.text.rstrip("/")
            return any(remote.exists(f"{base}/{m}", self.options) for m in names)

    def is_folder(self, marker: str) -> bool:
        """Whether the prefix holds ``marker`` (a bucket has no folders, only names)."""
        return remote.exists(f"{self.text}/{marker}", self.options)

    def files_under(self, blame: Blame) -> list[str]:
        """Every object under the prefix, sorted."""
        with self.translated(blame):
            return list(remote.find(self.text, self.options))

    def relative(self, path: str) -> str:
        """``path`` with this prefix cut off."""
        return path[len(self.text.rstrip("/")) + 1 :]

    def readable(self) -> str:
        """A verified local copy of the object (NetCDF needs a file)."""
        return remote.local_copy(self.text, self.options)

    def open_options(self) -> dict[str, Any] | None:
        """The options with the environment's endpoint."""
        return remote.storage_options(self.options)

    def write_bytes(self, data: bytes) -> None:
        """One PUT: the object is whole or absent."""
        remote.filesystem(self.text, self.options).pipe_file(self.text, data)

    def folder_facts(self) -> dict[str, Any]:
        """URL, size and a digest of every object's ETag under the prefix, and how to reach it."""
        objects = remote.find(self.text, self.options)
        cut = len(self.text) + 1
        digests = [[u[cut:], i["etag"], i["size"]] for u, i in objects.items()]
        return {
            "path": self.text,
            "size": sum(i["size"] for i in objects.values()),
            "xxh3": hash_text(canonical_json(digests)),
            "storage_options": dict(self.options),
        }

    def folder_unchanged(self, facts: Mapping[str, Any]) -> bool:
        """The same objects with the same ETags as recorded (gone or unreachable: changed)."""
        try:
            now = self.folder_facts()
            return now == {k: facts[k] for k in now}
        except Exception:  # gone or unreachable: write it again
            return False

    def check_output(self, overwrite: bool, *, folder: bool, stage: str) -> Location:
        """The URL tidied; its bucket exists and took a probe write, what is there replaceable."""
        url = staging.check_output_url(self.text, overwrite, self.options, folder, stage)
        return ObjectPath(url, self.options)

    def precheck_output(self, overwrite: bool, *, folder: bool, stage: str) -> None:
        """The whole check: a bucket output's probe write leaves nothing behind."""
        self.check_output(overwrite, folder=folder, stage=stage)

    def staged_file(
        self, suffixes: Sequence[str], describe: Callable[[], dict[str, Any]]
    ) -> AbstractContextManager[Staged]:
        """A private local folder; its files uploaded verified, then copied into place."""
        return staging.uploaded_file(self.text, self.options, suffixes, describe)

    def staged_store(
        self, sides: Mapping[str, SideWriter], stage: str
    ) -> AbstractContextManager[str]:
        """The URL itself: written in place, its consolidated metadata out first and in last."""
        return staging.store_in_bucket(self.text, self.options, sides, stage)

    def facts(self) -> dict[str, Any]:
        """URL, size and ETag, and how to reach it (no credentials)."""
        ident = remote.object_identity(self.text, self.options)
        return {"path": self.text, **ident, "storage_options": dict(self.options)}

    def unchanged(self, facts: Mapping[str, Any]) -> bool:
        """Same size and ETag as recorded (gone or unreachable: changed)."""
        try:
            now = remote.object_identity(self.text, facts.get("storage_options"))
        except Exception:  # gone, or unreachable: write it again
            return False
        return bool(now == {k: facts.get(k) for k in now})

    def shared(self) -> ObjectPath | None:
        """The bucket prefix itself: a cache here is shared through it."""
        return ObjectPath(self.text.rstrip("/"), self.options)

    def confine(self, what: str, stage: str | None = None) -> None:
        """OutputError if the URL is under no allowed prefix."""
        ensure_allowed_url(self.text, what, stage)

    def cache_folder(self, errors: type[GridsolveError]) -> Path:
        """The copy of the bucket cache on this host, once the bucket took a probe write."""
        url = ensure_allowed_url(self.text.rstrip("/"), "cache URL")
        remote.probe_writable(url, self.options, "cache", errors, None)
        return cache_mirror(url)

    def host_folder(self) -> Path:
        """The copy of the bucket cache on this host."""
        return cache_mirror(self.text)

    def translated(self, blame: Blame) -> Any:
        """Object-store failures inside the block raised as ``blame`` says."""
        what, cls, stage = blame
        return remote.translated(self.text, what, cls, stage, self.options)


def at(path: str | Path, options: Mapping[str, Any] | None = None) -> Location:
    """The location ``path`` names: an object-store URL, or a local path.

    ``options``: the object store's ``storage_options``.
    """
    text = str(path)
    return ObjectPath(text, options) if _is_url(text) else LocalPath(text, options)


def cache_mirror(url: str) -> Path:
    """The local folder of the bucket cache at ``url`` on this host (copies, scratch, records)."""
    return remote.mirror_root() / "cache" / hash_text(url.rstrip("/"))[:20]
