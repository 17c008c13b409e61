"""Object storage (``s3://…`` and other fsspec URLs): identities, copies, verified uploads.

Credentials come from the environment of every process that runs gridsolve
(``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``, ``AWS_PROFILE``, an instance
role, …) and the endpoint from ``AWS_ENDPOINT_URL`` or a config's
``storage_options`` (``endpoint_url``, ``region_name``, …). The configs refuse
secrets (:func:`gridsolve.schemas.base.check_storage_options`): a config is a
Prefect flow-run parameter, stored and shown by the server.

An object's identity is its size and ETag, which the server derives from the
bytes, so a cache key over objects never downloads them. Remote NetCDF inputs
are read from a local copy (NetCDF-4 needs a file), one per object version
under :func:`mirror_root`; the copy is checked against the object's size (and
MD5 when the ETag is one) before it is used.
"""

from __future__ import annotations

import contextlib
import getpass
import hashlib
import os
import re
import shutil
import tempfile
import threading
import uuid
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import fsspec
from fsspec.core import split_protocol

from gridsolve.schemas.base import is_url as is_url
from gridsolve.schemas.errors import GridsolveError, InputError, OutputError
from gridsolve.stages.engine.hashing import canonical_json, hash_text
from gridsolve.stages.engine.paths import atomic_file, owner_is_dead, writer_tag

MIRROR_ENV = "GRIDSOLVE_MIRROR"
_MD5 = re.compile(r"^[0-9a-f]{32}$")
_LOCK = threading.Lock()
_CREDENTIALS_FIX = (
    "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE) in the environment of "
    "every process that runs gridsolve (CLI, Prefect worker, Dask workers), and check the "
    "bucket's policy allows them"
)


def mirror_root() -> Path:
    """Local folder of copies of remote inputs and of the bucket cache (``GRIDSOLVE_MIRROR``)."""
    raw = os.environ.get(MIRROR_ENV)
    if raw:
        return Path(raw).expanduser().resolve()
    return Path(tempfile.gettempdir()) / f"gridsolve-mirror-{getpass.getuser()}"


def storage_options(options: Mapping[str, Any] | None) -> dict[str, Any]:
    """``options`` with the endpoint from ``AWS_ENDPOINT_URL(_S3)`` when they name none."""
    out = dict(options or {})
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    if endpoint and "endpoint_url" not in out:
        out["endpoint_url"] = endpoint
    return out


def filesystem(url: str, options: Mapping[str, Any] | None = None) -> Any:
    """The fsspec filesystem of ``url`` with ``options`` (fsspec reuses equal instances)."""
    protocol, _ = split_protocol(url)
    return fsspec.filesystem(protocol, **storage_options(options))


def endpoint(url: str, options: Mapping[str, Any] | None = None) -> str:
    """Where ``url``'s server is, for messages (never credentials)."""
    ep = storage_options(options).get("endpoint_url")
    return f"{url} (endpoint {ep})" if ep else url


def bucket_of(url: str) -> str:
    """The bucket (first component) of an object URL."""
    return str(split_protocol(url)[1]).split("/", 1)[0]


def storage_error(
    exc: BaseException,
    url: str,
    what: str,
    cls: type[GridsolveError],
    stage: str | None,
    options: Mapping[str, Any] | None = None,
) -> GridsolveError:
    """One clear error for a failed object-store call on ``url`` (``what``: "input file", …)."""
    text = f"{type(exc).__name__}: {exc}"
    where = endpoint(url, options)
    code = _error_code(exc)
    # By type and the server's error code, never by the message: it holds the key names.
    if code == "NoSuchBucket" or (
        isinstance(exc, FileNotFoundError) and "bucket does not exist" in str(exc).lower()
    ):
        return cls(
            f"the bucket {bucket_of(url)!r} of {what} {url} does not exist",
            stage=stage,
            found=where,
            fix="create the bucket, or correct the URL (and AWS_ENDPOINT_URL / "
            "storage_options.endpoint_url)",
        )
    if (
        isinstance(exc, PermissionError)
        or code in _REFUSED
        or type(exc).__name__ in ("NoCredentialsError", "PartialCredentialsError")
    ):
        return cls(
            f"the object store refused access to {what} {url}: wrong or missing credentials, "
            "or no permission",
            stage=stage,
            found=text,
            fix=_CREDENTIALS_FIX,
        )
    if isinstance(exc, FileNotFoundError):
        return cls(
            f"{what} not found: {url}",
            stage=stage,
            found=where,
            fix="check the URL (the object's key is case-sensitive)",
        )
    if type(exc).__name__ in _UNREACHABLE or isinstance(exc, ConnectionError | TimeoutError):
        return cls(
            f"cannot reach the object store of {what} {where}",
            stage=stage,
            found=text,
            fix="check AWS_ENDPOINT_URL / storage_options.endpoint_url and the network",
            transient=True,
        )
    return cls(
        f"object store call on {what} {url} failed",
        stage=stage,
        found=text,
        fix="check the URL, the credentials and the endpoint",
        transient=isinstance(exc, OSError),
    )


_REFUSED = frozenset(
    {"AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "403", "Forbidden"}
)
_UNREACHABLE = frozenset(
    {
        "EndpointConnectionError",
        "ConnectTimeoutError",
        "ReadTimeoutError",
        "ConnectionClosedError",
        "ClientConnectorError",
        "ServerDisconnectedError",
    }
)


def _error_code(exc: BaseException) -> str:
    """The S3 error code of a botocore ClientError in ``exc``'s chain ("" if none)."""
    seen: BaseException | None = exc
    for _ in range(5):
        if seen is None:
            break
        response = getattr(seen, "response", None)
        if isinstance(response, dict):
            return str(response.get("Error", {}).get("Code", ""))
        seen = seen.__cause__ or seen.__context__
    return ""


@contextlib.contextmanager
def translated(
    url: str,
    what: str,
    cls: type[GridsolveError],
    stage: str | None,
    options: Mapping[str, Any] | None = None,
) -> Iterator[None]:
    """Object-store failures inside the block raised as :func:`storage_error`."""
    try:
        yield
    except GridsolveError:
        raise
    except Exception as exc:
        raise storage_error(exc, url, what, cls, stage, options) from exc


def identity(info: Mapping[str, Any]) -> dict[str, Any]:
    """Size and ETag of an object as fsspec's ``info`` describes it.

    InputError without an ETag: the size alone would let a changed object of the
    same size be a cache hit.
    """
    etag = str(info.get("ETag") or info.get("etag") or "").strip('"')
    if not etag:
        raise InputError(
            f"the object store gives no ETag for {info.get('name', 'an object')}",
            stage="load",
            fix="use an S3-compatible store that returns ETags (AWS S3, MinIO, Ceph, GCS "
            "through its S3 API)",
        )
    return {"size": int(info.get("size") or 0), "etag": etag}


def object_identity(url: str, options: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The identity of one object, asked of the server now (not a cached listing)."""
    fs = filesystem(url, options)
    fs.invalidate_cache()
    return identity(fs.info(url))


def object_digest(ident: Mapping[str, Any]) -> str:
    """A digest of an object's content from its identity (the server's checksum and size)."""
    return hash_text(f"{ident['etag']}:{ident['size']}")


def glob(pattern: str, options: Mapping[str, Any] | None = None) -> list[str]:
    """URLs of the objects ``pattern`` matches, sorted."""
    fs = filesystem(pattern, options)
    fs.invalidate_cache()
    return sorted(fs.unstrip_protocol(p) for p in fs.glob(pattern) if fs.isfile(p))


def find(url: str, options: Mapping[str, Any] | None = None) -> dict[str, dict[str, Any]]:
    """Every object under ``url`` (a prefix) with its identity, by URL, sorted."""
    fs = filesystem(url, options)
    fs.invalidate_cache()
    found = fs.find(url, detail=True)
    return {fs.unstrip_protocol(p): identity(i) for p, i in sorted(found.items())}


def exists(url: str, options: Mapping[str, Any] | None = None) -> bool:
    """Whether an object (or a prefix with objects) is at ``url``."""
    fs = filesystem(url, options)
    fs.invalidate_cache()
    return bool(fs.exists(url))


def _md5(path: Path) -> str:
    h = hashlib.md5(usedforsecurity=False)
    with open(path, "rb") as f:
        while chunk := f.read(8 * 2**20):
            h.update(chunk)
    return h.hexdigest()


def _check_copy(path: Path, ident: Mapping[str, Any]) -> str | None:
    """Why the file at ``path`` is not the object ``ident`` describes (None: it is)."""
    size = path.stat().st_size
    if size != ident["size"]:
        return f"{size} bytes, the object has {ident['size']}"
    if _MD5.match(ident["etag"]) and _md5(path) != ident["etag"]:
        return "its MD5 differs from the object's ETag"
    return None


def local_copy(
    url: str, options: Mapping[str, Any] | None = None, ident: Mapping[str, Any] | None = None
) -> str:
    """A verified local copy of the object at ``url`` (version ``ident``, default: current)."""
    with translated(url, "input file", InputError, "load", options):
        ident = dict(ident) if ident is not None else object_identity(url, options)
        folder = mirror_root() / "inputs" / hash_text(url)[:20]
        dest = folder / hash_text(canonical_json(ident))[:20] / url.rstrip("/").rsplit("/", 1)[-1]
        if dest.exists() and dest.stat().st_size == ident["size"]:
            return str(dest)
        fs = filesystem(url, options)
        with atomic_file(dest) as tmp:
            fs.get_file(url, str(tmp))
            problem = _check_copy(tmp, ident)
            if problem is None and not _MD5.match(ident["etag"]):
                # a multipart ETag is no MD5 of the bytes: the object must still be that version
                now = object_identity(url, options)
                problem = None if now == dict(ident) else f"the object is now {now}"
            if problem is not None:
                now = object_identity(url, options)
                raise InputError(
                    f"the copy of input file {url} is not the object that was hashed ({problem})",
                    stage="load",
                    found=f"object now {now}, expected {dict(ident)}",
                    fix="rerun once the object is no longer being replaced",
                )
    # Older versions of the same object are of no further use.
    for old in folder.iterdir():
        if old != dest.parent:
            shutil.rmtree(old, ignore_errors=True)
    return str(dest)


def upload(local: Path, url: str, options: Mapping[str, Any] | None, what: str) -> None:
    """Put the file ``local`` at ``url``, verified, never exposing a partial or unverified object.

    The bytes go to a temporary key beside ``url``, are checked (size, and MD5
    where the ETag is one), then copied server-side to ``url`` (a copy is atomic
    for readers) and the temporary object removed.
    """
    tmp = stage_upload(local, url, options, what)
    try:
        publish(tmp, url, options, what)
    finally:
        with contextlib.suppress(Exception):
            filesystem(url, options).rm(tmp)


def stage_upload(local: Path, url: str, options: Mapping[str, Any] | None, what: str) -> str:
    """Upload ``local`` to a temporary key beside ``url``, verified; that key's URL.

    Temporary keys a dead writer of this host left beside ``url`` are removed first.
    """
    fs = filesystem(url, options)
    parent, _, name = url.rstrip("/").rpartition("/")
    prefix = f"{parent}/.{name}.gridsolve~"
    tmp = f"{prefix}{writer_tag()}~{uuid.uuid4().hex[:12]}.tmp"
    size = local.stat().st_size
    md5 = _md5(local)
    with translated(url, what, OutputError, "write", options):
        for left in fs.glob(f"{prefix}*.tmp"):
            tag = left.rsplit("gridsolve~", 1)[1].rsplit("~", 1)[0]
            if owner_is_dead(tag):
                with contextlib.suppress(FileNotFoundError):
                    fs.rm(left)
        try:
            fs.put_file(str(local), tmp)
            got = object_identity(tmp, options)
            if got["size"] != size or (_MD5.match(got["etag"]) and got["etag"] != md5):
                raise OutputError(
                    f"the upload of {what} {url} does not match the local file",
                    stage="write",
                    found=f"object {got}, local {size} bytes, MD5 {md5}",
                    fix="rerun; if it repeats, check the object store",
                    transient=True,
                )
        except BaseException:
            with contextlib.suppress(Exception):
                fs.rm(tmp)
            raise
    return tmp


def publish(tmp: str, url: str, options: Mapping[str, Any] | None, what: str) -> None:
    """Copy the verified temporary object ``tmp`` to ``url`` (server-side) and check it."""
    fs = filesystem(url, options)
    with translated(url, what, OutputError, "write", options):
        size = object_identity(tmp, options)["size"]
        fs.copy(tmp, url)
        final = object_identity(url, options)
        if final["size"] != size:
            raise OutputError(
                f"{what} {url} has {final['size']} bytes after the copy, expected {size}",
                stage="write",
                fix="rerun; if it repeats, check the object store",
                transient=True,
            )


def remove(url: str, options: Mapping[str, Any] | None = None) -> None:
    """Delete the object or every object under the prefix ``url`` (absent: nothing to do)."""
    fs = filesystem(url, options)
    fs.invalidate_cache()
    with contextlib.suppress(FileNotFoundError):
        fs.rm(url, recursive=True)


_PROBED: set[str] = set()


def probe_writable(
    url: str,
    options: Mapping[str, Any] | None,
    what: str,
    cls: type[GridsolveError],
    stage: str | None,
    shown: str | None = None,
) -> None:
    """Write and delete a small object under ``url``: the bucket exists and takes our writes.

    ``shown``: the URL errors name (default ``url``).
    """
    key = url + canonical_json(storage_options(options))
    with _LOCK:
        if key in _PROBED:
            return
    fs = filesystem(url, options)
    probe = f"{url.rstrip('/')}/.gridsolve-probe~{writer_tag()}~{uuid.uuid4().hex[:8]}"
    with translated(shown or url, what, cls, stage, options):
        fs.pipe_file(probe, b"gridsolve")
        fs.rm(probe)
    with _LOCK:
        _PROBED.add(key)


def forget_probes() -> None:
    """Probe every URL again (credentials or buckets changed in this process)."""
    with _LOCK:
        _PROBED.clear()
