"""The content-addressed artifact store.

An artifact is a folder ``objects/<kk>/<key>/`` holding ``.npy`` arrays and a
``manifest.json`` with every file's size and xxh3 checksum plus the stage's
small metadata. It is written in a private temporary folder and renamed into
place, so a reader sees a whole artifact or none, and two processes writing
the same key at once are safe (the second rename loses and is discarded).
An artifact whose files are missing or fail their checksum is moved aside to
``corrupt/`` and reported as absent, so the stage is recomputed. Every hit
stamps the manifest's mtime: the artifact's last use, which the size cap
(:mod:`~gridsolve.stages.engine.prune`) evicts by.

The store is a POSIX folder: local, or a shared mount (NFS, Lustre) that every
Dask worker sees at the same path; or a bucket, for workers that share no disk,
read and written through this host's copy of it (:class:`Store` says how).
One class serves both: where the root is comes from the storage layer
(:mod:`~gridsolve.stages.engine.storage`), which alone tells a folder from a URL.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import itertools
import json
import logging
import mmap
import os
import re
import shutil
import sys
import threading
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, ClassVar, Literal

import numpy as np
import xxhash

from gridsolve.schemas.artifacts import Tile
from gridsolve.schemas.errors import StoreError
from gridsolve.stages.engine import remote, storage
from gridsolve.stages.engine.hashing import hash_file
from gridsolve.stages.engine.paths import owner_is_dead, writer_tag
from gridsolve.stages.engine.pyparse import load_npy

log = logging.getLogger("gridsolve.store")

FORMAT = 1
MANIFEST = "manifest.json"

Status = Literal["hit", "miss", "corrupt"]


@dataclass
class StageOutput:
    """What a stage function returns: named arrays and JSON-able metadata."""

    arrays: dict[str, np.ndarray] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)


class Artifact:
    """A verified artifact read back from the store; arrays are memory-mapped read-only."""

    def __init__(self, path: Path, manifest: Mapping[str, Any]) -> None:
        self.path = path
        self.key: str = manifest["key"]
        self.meta: dict[str, Any] = manifest["meta"]
        self._files: dict[str, dict[str, Any]] = manifest["files"]
        #: how it was made: kind, impl, version, config, input keys
        self.info: dict[str, Any] = {
            k: v for k, v in manifest.items() if k not in ("meta", "files", "format")
        }

    @property
    def names(self) -> list[str]:
        """Names of the stored arrays."""
        return list(self._files)

    def __contains__(self, name: str) -> bool:
        return name in self._files

    def array(self, name: str) -> np.ndarray:
        """One stored array (read-only memory map)."""
        if name not in self._files:
            raise KeyError(f"artifact {self.key} has no array {name!r}; it has {self.names}")
        return load_npy(self.path / self._files[name]["file"])

    def arrays(self) -> dict[str, np.ndarray]:
        """Every stored array."""
        return {n: self.array(n) for n in self._files}


@dataclass
class TiledArtifact:
    """A tiled stage's output as the write stage reads it."""

    key: str
    prepared: Artifact
    tiles: Sequence[tuple[Tile, Artifact]]

    @property
    def meta(self) -> dict[str, Any]:
        """The once-per-stage metadata."""
        return self.prepared.meta


class _HashingWriter:
    """A write-only file wrapper that checksums what passes through it."""

    def __init__(self, f: BinaryIO) -> None:
        self._f = f
        self.hash = xxhash.xxh3_128()
        self.size = 0

    def write(self, data: Any) -> int:
        mv = memoryview(data).cast("B")
        self.hash.update(mv)
        self.size += mv.nbytes
        return self._f.write(mv)


def native_order(a: np.ndarray) -> np.ndarray:
    """``a`` in this machine's byte order (torch and the kernels read no other); else as is.

    Big-endian arrays come from NetCDF-3 files and some archives, through a
    plugin or the Python API.
    """
    a = np.asarray(a)
    return a if a.dtype.isnative else a.astype(a.dtype.newbyteorder("="))


def _write_npy(f: BinaryIO, arr: np.ndarray) -> _HashingWriter:
    """``arr`` as .npy into ``f`` (in native byte order), checksummed; ``np.save``'s bytes."""
    w = _HashingWriter(f)
    arr = native_order(arr)
    if arr.flags.c_contiguous and arr.dtype.kind in "biufc":  # kinds with a buffer interface
        # Straight from the array's memory: write_array copies a file-like wrapper's
        # data through tobytes() in 16 MiB pieces first.
        np.lib.format.write_array_header_1_0(w, np.lib.format.header_data_from_array_1_0(arr))
        w.write(arr.reshape(-1).data.cast("B"))
    else:
        np.lib.format.write_array(w, arr, allow_pickle=False)
    return w


def _cache_full(root: Path, what: str = "") -> StoreError:
    """The error for a cache folder whose disk has no room (for ``what``)."""
    return StoreError(
        f"no space left in the cache folder {root}{what}",
        fix="free disk space or point cache.root at a larger disk",
    )


#: Linux's madvise(MADV_POPULATE_WRITE) (5.14+).
_MADV_POPULATE_WRITE = 23


@functools.cache
def _madvise() -> Any:
    """The C library's ``madvise``, or None off Linux.

    Through ctypes, which lets other threads run during the call; ``mmap.madvise``
    holds the GIL, and another tile's thread waited for it (0.16 s at a time).
    """
    if sys.platform != "linux":
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def _populate(arr: np.memmap) -> bool:
    """Map every page of ``arr``'s file in at once, ready to be written.

    One call instead of a fault at the first write to each page: 0.06 s for
    408 MB here, against 0.18-0.74 s of faults. Where the kernel refuses (older
    than 5.14), the pages fault in as they are written. Whether they were mapped in.
    """
    madvise = _madvise()
    if madvise is None or arr.nbytes == 0:
        return False
    lead = arr.offset % mmap.ALLOCATIONGRANULARITY  # np.memmap maps from an aligned start
    return bool(madvise(arr.ctypes.data - lead, arr.nbytes + lead, _MADV_POPULATE_WRITE) == 0)


#: File systems on which posix_fallocate reserves the blocks that writes through a
#: mapping then fill. Elsewhere (copy-on-write ZFS, glibc's emulation, NFS, whose write
#: errors surface only at close) a full disk during such a write would kill the process
#: (SIGBUS) or go unseen: outputs are made in memory and written the usual way.
_RESERVING_FILE_SYSTEMS = frozenset({"ext4", "xfs", "tmpfs"})


@functools.cache
def _file_system(folder: str) -> str:
    """The type of the file system holding ``folder`` ("" where unknown)."""
    try:
        with open("/proc/self/mountinfo") as f:
            lines = f.read().splitlines()
    except OSError:
        return ""
    best, kind = "", ""
    for line in lines:
        head, _, tail = line.partition(" - ")
        fields = head.split()
        if len(fields) < 5 or not tail:
            continue
        # mount points escape spaces and the like as octal: \040
        point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), fields[4])
        inside = folder == point or folder.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best):
            best, kind = point, tail.split()[0]
    return kind


def _reserves_blocks(folder: Path) -> bool:
    """Whether output files in ``folder`` can be filled through a mapping safely."""
    return (
        hasattr(os, "posix_fallocate")
        and _file_system(os.path.realpath(folder)) in _RESERVING_FILE_SYSTEMS
    )


class Staging:
    """Output arrays that a stage part fills where the store keeps them.

    :meth:`empty` gives an array mapped onto a new ``.npy`` file in the store's
    scratch space; :meth:`Store.put` moves such a file into the artifact as it
    is instead of writing the array's bytes again. Filling the array is
    storing it: no second copy in memory (the checksum is taken from the
    mapping). Only on local file systems that reserve blocks (ext4, xfs,
    tmpfs); elsewhere :meth:`empty` is ``numpy.empty``. On
    the benchmark host a fresh process put 408 MB into 4 new files in a median
    0.12-0.2 s this way, against 0.8-1.6 s made in memory and then written
    (``docs/benchmarks.md``).

    The bytes are those :func:`_write_npy` writes (the same header), so an
    artifact and its checksums do not depend on the way it was stored.
    """

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self._mapped = _reserves_blocks(folder.parent)  # the store's tmp: one lookup
        self._names = itertools.count()
        #: the arrays handed out, by (address, shape): the file, its header's length and
        #: the array itself (held so the mapping stays valid and the address unique)
        self._files: dict[tuple[int, tuple[int, ...]], tuple[Path, int, np.ndarray]] = {}

    def empty(self, shape: Sequence[int], dtype: Any, populate: bool = True) -> np.ndarray:
        """An uninitialised array of ``shape`` and ``dtype``, ready to be stored as it is.

        In memory instead (stored the usual way) where the store's disk takes
        no mapping; a StoreError where it has no room for the array.
        ``populate``: map every page in now, for an array filled through the
        mapping; False for one filled by :meth:`write` in large blocks.
        """
        dt = np.dtype(dtype)
        shape = tuple(int(n) for n in shape)
        nbytes = int(np.prod(shape)) * dt.itemsize
        if not self._mapped or nbytes == 0 or not dt.isnative or dt.hasobject:
            return np.empty(shape, dt)
        path = self.folder / f"s{next(self._names)}.npy"
        header = {"descr": np.lib.format.dtype_to_descr(dt), "fortran_order": False, "shape": shape}
        try:
            with open(path, "wb") as f:
                np.lib.format.write_array_header_1_0(f, header)
                offset = f.tell()
                # Blocks reserved now: writing through a mapping into a file the disk has no
                # room for kills the process (SIGBUS) instead of raising.
                os.posix_fallocate(f.fileno(), 0, offset + nbytes)
            arr = np.memmap(path, dtype=dt, mode="r+", offset=offset, shape=shape)
        except OSError as exc:
            with contextlib.suppress(OSError):
                path.unlink()
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                root = self.folder.parent.parent  # <root>/tmp/<scratch>
                raise _cache_full(root, f" for an output of {nbytes:,} bytes") from exc
            log.debug("staging %s: %s; kept in memory instead", path, exc)
            return np.empty(shape, dt)
        if populate:
            _populate(arr)
        self._files[(arr.ctypes.data, shape)] = (path, offset, arr)
        return arr

    def write(self, arr: np.ndarray, index: tuple[int, ...], data: np.ndarray) -> None:
        """``arr[index] = data``, by a write to the file where ``arr`` is (in) a staged array.

        ``arr[index]`` must be C-contiguous. Filling a staged file by writes of
        whole rows costs a fraction of filling it through its mapping: the
        kernel need not zero each new page first nor take a fault per page
        (the demo's 408 MB of gradients, 4 files on 2 threads: 0.045-0.058 s
        against 0.20-0.34 s). The mapping sees what was written.
        """
        part = arr[index]
        found = self._file_holding(part) if part.flags.c_contiguous else None
        if found is None:
            part[...] = data
            return
        path, start = found
        raw = np.ascontiguousarray(data, dtype=part.dtype)
        if raw.shape != part.shape:
            raw = np.ascontiguousarray(np.broadcast_to(raw, part.shape))
        fd = os.open(path, os.O_WRONLY)
        try:
            view = raw.reshape(-1).view(np.uint8).data
            done = 0
            while done < len(view):  # a write may be short
                wrote = os.pwrite(fd, view[done:], start + done)
                if wrote <= 0:
                    raise OSError(errno.EIO, f"no progress writing {path}")
                done += wrote
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise _cache_full(self.folder.parent.parent, "") from exc
            raise
        finally:
            os.close(fd)

    def _file_holding(self, part: np.ndarray) -> tuple[Path, int] | None:
        """The staged file whose array holds ``part``, and ``part``'s byte offset in it."""
        lo = part.ctypes.data
        for (address, _), (path, offset, mapped) in self._files.items():
            if address <= lo and lo + part.nbytes <= address + mapped.nbytes:
                return path, offset + lo - address
        return None

    def adopt(self, arr: Any) -> tuple[Path, int, str] | None:
        """The staged file that holds exactly ``arr``, its size and xxh3 checksum; else None.

        An adopted file is taken off the list: it can be adopted once.
        """
        if not isinstance(arr, np.ndarray) or not arr.flags.c_contiguous or arr.size == 0:
            return None
        key = (arr.ctypes.data, tuple(arr.shape))
        found = self._files.get(key)
        # the same dtype object, not only its size: a view as another structured dtype
        # would keep the file's header of the first
        if found is None or found[2].dtype != arr.dtype:
            return None
        del self._files[key]
        path, offset, mapped = found
        h = xxhash.xxh3_128()
        with open(path, "rb") as f:
            h.update(f.read(offset))  # the header, as written
        h.update(mapped.reshape(-1).view(np.uint8).data)  # the data, from the page cache
        return path, offset + mapped.nbytes, h.hexdigest()

    def release(self) -> None:
        """Forget the arrays handed out (their files go with the scratch folder)."""
        self._files.clear()


class Store:
    """A content-addressed store of stage artifacts at ``root``: a folder, or a bucket URL.

    The artifacts are kept in a folder of this host: the root itself, or for a
    bucket (``s3://bucket/prefix``) this host's copy of it, under
    ``GRIDSOLVE_MIRROR``. Object stores have no rename, so publication to a
    bucket is by order: an artifact's arrays are uploaded under names that
    are their xxh3 checksums, then its manifest, last; an artifact without a
    manifest does not exist. Two writers of one key upload to distinct names
    (or the same bytes under the same name), so the manifest that lands last
    always names whole arrays. An artifact only in the bucket is downloaded
    into this host's copy and checked against the manifest's size and
    checksum before use; a bad one is deleted from the bucket and recomputed.
    Arrays left by a writer that lost the race stay in the bucket (never read;
    ``aws s3 rm`` cleans them).
    """

    # Verified checksums, per process: a file is hashed once per run, not per reader.
    _verified: ClassVar[dict[str, tuple[tuple[str, int, int], ...]]] = {}
    _lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self, root: str | Path, options: Mapping[str, Any] | None = None) -> None:
        where = storage.at(root, options)
        self.root = where.cache_folder(StoreError)
        #: the bucket this host's folder is a copy of (None: the folder is the store)
        self._shared = where.shared()
        self._setup()

    def _setup(self) -> None:
        try:
            for sub in ("objects", "tmp", "corrupt"):
                (self.root / sub).mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StoreError(
                f"cannot create the cache folder {self.root}: {exc.strerror or exc}",
                fix="set cache.root to a writable folder",
            ) from exc
        if not os.access(self.root / "objects", os.W_OK):
            raise StoreError(
                f"the cache folder {self.root} is not writable",
                fix="set cache.root to a writable folder, or fix its permissions",
            )
        self._sweep_tmp()

    # ------------------------------------------------------------------ layout
    @property
    def location(self) -> str:
        """Where the store is, as the user named it (a folder, or a bucket URL)."""
        return str(self.root) if self._shared is None else self._shared.text

    def path(self, key: str) -> Path:
        """Folder of the artifact with ``key``."""
        return self.root / "objects" / key[:2] / key

    def _sweep_tmp(self) -> None:
        for entry in (self.root / "tmp").iterdir():
            if owner_is_dead(entry.name.rpartition("~")[0]):
                shutil.rmtree(entry, ignore_errors=True)

    @contextlib.contextmanager
    def scratch(self) -> Iterator[Path]:
        """A private folder under the store's ``tmp``, removed afterwards.

        Left by a killed writer, it is swept by the next store opened on this host.
        """
        tmp = self.root / "tmp" / f"{writer_tag()}~{uuid.uuid4().hex}"
        tmp.mkdir()
        try:
            yield tmp
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    @contextlib.contextmanager
    def staging(self) -> Iterator[Staging]:
        """Where a stage part's outputs can be filled in place (:class:`Staging`).

        Pass it to :meth:`put` inside the block; what is not adopted is removed after.
        """
        with self.scratch() as tmp:
            staged = Staging(tmp)
            try:
                yield staged
            finally:
                staged.release()

    # ------------------------------------------------------------------ reading
    def _manifest(self, key: str) -> dict[str, Any] | None:
        try:
            text = (self.path(key) / MANIFEST).read_text()
        except FileNotFoundError:
            return None
        manifest: dict[str, Any] = json.loads(text)
        return manifest

    def check(self, key: str) -> tuple[Status, str]:
        """Whether ``key`` is stored whole: ("hit"|"miss"|"corrupt", why).

        An artifact only in the bucket is downloaded into this host's folder and checked.
        """
        status, why = self._check_here(key)
        if status == "hit" or self._shared is None:
            return status, why
        if status == "corrupt":
            self._quarantine_here(key, why)  # this host's copy is bad: the bucket's may be whole
        return self._download(self._shared, key)

    def _check_here(self, key: str) -> tuple[Status, str]:
        """:meth:`check` of this host's folder."""
        folder = self.path(key)
        try:
            manifest = self._manifest(key)
        except (json.JSONDecodeError, UnicodeDecodeError, OSError) as exc:
            return "corrupt", f"unreadable manifest: {exc}"
        if manifest is None:
            return ("corrupt", "manifest missing") if folder.exists() else ("miss", "")
        if manifest.get("format") != FORMAT or manifest.get("key") != key:
            return "corrupt", "manifest of another key or format"
        stamps = []
        for name, info in manifest["files"].items():
            p = folder / info["file"]
            try:
                st = p.stat()
            except FileNotFoundError:
                return "corrupt", f"array {name!r} missing"
            if st.st_size != info["size"]:
                return "corrupt", f"array {name!r} has {st.st_size} bytes, expected {info['size']}"
            stamps.append((info["file"], st.st_size, st.st_mtime_ns))
        stamp = tuple(stamps)
        with self._lock:
            known = self._verified.get(str(folder)) == stamp
        if not known:
            for name, info in manifest["files"].items():
                if hash_file(folder / info["file"]) != info["xxh3"]:
                    return "corrupt", f"array {name!r} fails its checksum"
            with self._lock:
                self._verified[str(folder)] = stamp
        if not self._mark_used(folder):
            return "miss", ""  # evicted while we looked: computed again
        return "hit", ""

    def _mark_used(self, folder: Path) -> bool:
        """Stamp the artifact's last use (its manifest's mtime); False if it has vanished.

        Pruning (:mod:`~gridsolve.stages.engine.prune`) evicts least recently used
        artifacts first and never one used since the oldest live lease began.
        """
        try:
            os.utime(folder / MANIFEST)
        except FileNotFoundError:
            return False
        except OSError:
            pass  # a read-only cache: still readable, just not pruned by use
        return True

    def lookup(self, key: str) -> tuple[Status, str]:
        """Like :meth:`check`, but a corrupt artifact is moved aside (and reported)."""
        status, why = self.check(key)
        if status == "corrupt":
            self.quarantine(key, why)
        return status, why

    def quarantine(self, key: str, why: str) -> None:
        """Move a bad artifact out of the way (and out of the bucket) so that it is recomputed."""
        self._quarantine_here(key, why)
        if self._shared is not None:
            fs = remote.filesystem(self._shared.text, self._shared.options)
            base = self._remote(self._shared, key)
            with self._translated(self._shared, key), contextlib.suppress(FileNotFoundError):
                fs.rm(f"{base}/{MANIFEST}")  # first: without it the artifact does not exist
                fs.rm(base, recursive=True)

    def _quarantine_here(self, key: str, why: str) -> None:
        """Move this host's copy of a bad artifact aside to ``corrupt/``."""
        folder = self.path(key)
        dest = self.root / "corrupt" / f"{key}~{uuid.uuid4().hex[:8]}"
        log.warning("cache artifact %s is corrupt (%s): moved to %s; recomputing", key, why, dest)
        with contextlib.suppress(FileNotFoundError):
            os.rename(folder, dest)
        with self._lock:
            self._verified.pop(str(folder), None)

    def get(self, key: str) -> Artifact:
        """The verified artifact ``key``; StoreError when absent or corrupt."""
        status, why = self.check(key)
        if status != "hit":
            raise StoreError(
                f"artifact {key} is "
                f"{'not in the cache' if status == 'miss' else 'corrupt: ' + why}",
                fix="rerun: the stage that produces it is recomputed",
            )
        manifest = self._manifest(key)
        if manifest is None:  # evicted (size cap) just after it was checked
            raise StoreError(
                f"artifact {key} left the cache while it was being read",
                fix="rerun: the stage that produces it is recomputed",
                transient=True,
            )
        return Artifact(self.path(key), manifest)

    # ------------------------------------------------------------------ writing
    def put(
        self,
        key: str,
        output: StageOutput,
        info: Mapping[str, Any],
        staged: Staging | None = None,
    ) -> Artifact:
        """Store ``output`` under ``key`` atomically and return it as read back.

        Arrays made by ``staged`` (:meth:`staging`) are moved in as they are.
        For a bucket: stored in this host's copy, then published to the bucket (manifest last).
        """
        art = self._put_here(key, output, info, staged)
        if self._shared is None:
            return art
        try:
            self._upload(self._shared, key, art)
        except BaseException:
            # Not in the bucket, so not here either: a retry computes and uploads it again
            # (other hosts would otherwise find it missing while this one finds it whole).
            shutil.rmtree(art.path, ignore_errors=True)
            with self._lock:
                self._verified.pop(str(art.path), None)
            raise
        return art

    def _put_here(
        self,
        key: str,
        output: StageOutput,
        info: Mapping[str, Any],
        staged: Staging | None,
    ) -> Artifact:
        """:meth:`put` into this host's folder."""
        try:
            with self.scratch() as tmp:
                files: dict[str, dict[str, Any]] = {}
                for i, (name, arr) in enumerate(output.arrays.items()):
                    fname = f"a{i}.npy"
                    ready = None if staged is None else staged.adopt(arr)
                    arr = np.asarray(arr)
                    if ready is not None:
                        src, size, digest = ready
                        os.rename(src, tmp / fname)
                    else:
                        with open(tmp / fname, "wb") as f:
                            w = _write_npy(f, arr)
                        size, digest = w.size, w.hash.hexdigest()
                    files[name] = {
                        "file": fname,
                        "size": size,
                        "xxh3": digest,
                        "dtype": arr.dtype.str,
                        "shape": list(arr.shape),
                    }
                manifest = {
                    "format": FORMAT,
                    "key": key,
                    **dict(info),
                    "meta": output.meta,
                    "files": files,
                }
                (tmp / MANIFEST).write_text(json.dumps(manifest, sort_keys=True, allow_nan=True))
                final = self.path(key)
                final.parent.mkdir(parents=True, exist_ok=True)
                if self._publish(tmp, final, key):
                    self._remember(final, files)
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise _cache_full(self.root) from exc
            raise StoreError(
                f"cannot write to the cache folder {self.root}: {exc}",
                fix="check cache.root is writable",
                transient=True,
            ) from exc
        return self.get(key)

    def _remember(self, folder: Path, files: Mapping[str, Mapping[str, Any]]) -> None:
        # Checksummed while written: reading them back to check again would only re-hash
        # the bytes just hashed. check() reads the manifest's files in sorted order.
        stamp = []
        for name in sorted(files):
            st = (folder / files[name]["file"]).stat()
            stamp.append((files[name]["file"], st.st_size, st.st_mtime_ns))
        with self._lock:
            self._verified[str(folder)] = tuple(stamp)

    def _publish(self, tmp: Path, final: Path, key: str) -> bool:
        """Rename ``tmp`` into place; False when another writer's whole copy was kept."""
        try:
            os.rename(tmp, final)
            return True
        except OSError as exc:
            if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                raise
        # Someone else published this key first: keep theirs if it is whole.
        status, why = self.check(key)
        if status == "hit":
            return False
        self.quarantine(key, why)
        os.rename(tmp, final)
        return True

    def _remote(self, shared: storage.ObjectPath, key: str) -> str:
        return f"{shared.text}/objects/{key[:2]}/{key}"

    def _translated(
        self, shared: storage.ObjectPath, key: str
    ) -> contextlib.AbstractContextManager[None]:
        return remote.translated(
            self._remote(shared, key), "cache artifact", StoreError, None, shared.options
        )

    def _download(self, shared: storage.ObjectPath, key: str) -> tuple[Status, str]:
        """Copy the bucket's artifact ``key`` into this host's folder, checked."""
        fs = remote.filesystem(shared.text, shared.options)
        base = self._remote(shared, key)
        with self._translated(shared, key):
            try:
                text = fs.cat_file(f"{base}/{MANIFEST}")
            except FileNotFoundError:
                return "miss", ""
            try:
                manifest = json.loads(text)
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                return "corrupt", f"unreadable manifest in the bucket: {exc}"
            if manifest.get("format") != FORMAT or manifest.get("key") != key:
                return "corrupt", "manifest in the bucket of another key or format"
            with self.scratch() as tmp:
                for name, info in manifest["files"].items():
                    try:
                        fs.get_file(f"{base}/{info['file']}", str(tmp / info["file"]))
                    except FileNotFoundError:
                        return "corrupt", f"array {name!r} missing in the bucket"
                    if (tmp / info["file"]).stat().st_size != info["size"] or hash_file(
                        tmp / info["file"]
                    ) != info["xxh3"]:
                        return "corrupt", f"array {name!r} in the bucket fails its checksum"
                (tmp / MANIFEST).write_text(text if isinstance(text, str) else text.decode())
                final = self.path(key)
                final.parent.mkdir(parents=True, exist_ok=True)
                if self._publish(tmp, final, key):
                    self._remember(final, manifest["files"])
        return "hit", ""

    def _upload(self, shared: storage.ObjectPath, key: str, art: Artifact) -> None:
        """Publish this host's artifact ``key`` to the bucket: arrays, then the manifest."""
        fs = remote.filesystem(shared.text, shared.options)
        base = self._remote(shared, key)
        manifest = json.loads((art.path / MANIFEST).read_text())
        with self._translated(shared, key):
            fs.invalidate_cache()
            if fs.exists(f"{base}/{MANIFEST}"):
                return  # another writer published it first
            files = {}
            for name, f in manifest["files"].items():
                target = f"{base}/{f['xxh3']}.npy"
                fs.put_file(str(art.path / f["file"]), target)
                got = remote.object_identity(target, shared.options)
                if got["size"] != f["size"]:
                    raise StoreError(
                        f"the upload of cache artifact {key} array {name!r} has "
                        f"{got['size']} bytes, expected {f['size']}",
                        fix="rerun; if it repeats, check the object store",
                        transient=True,
                    )
                files[name] = {**f, "file": f"{f['xxh3']}.npy"}
            text = json.dumps({**manifest, "files": files}, sort_keys=True, allow_nan=True)
            fs.pipe_file(f"{base}/{MANIFEST}", text.encode())


def open_store(root: str, options: Mapping[str, Any] | None = None) -> Store:
    """The store at ``root``: a local (or shared) folder, or a bucket URL."""
    return Store(root, options)
