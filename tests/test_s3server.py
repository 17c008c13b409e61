"""The moto S3 server of tests/s3server.py: real process, real auth, real s3fs errors."""

from __future__ import annotations

import dataclasses
import os
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import botocore.exceptions
import pytest
import s3fs

from s3server import S3Server, s3_server

BUCKET = "gridsolve-data"


@pytest.fixture(scope="module")
def no_aws_env() -> Iterator[None]:
    """No AWS_* variable or ~/.aws file of the developer's leaks into these tests."""
    with pytest.MonkeyPatch.context() as mp:
        for name in [n for n in os.environ if n.startswith("AWS_")]:
            mp.delenv(name)
        mp.setenv("AWS_CONFIG_FILE", os.devnull)
        mp.setenv("AWS_SHARED_CREDENTIALS_FILE", os.devnull)
        yield


@pytest.fixture(scope="module")
def server(no_aws_env: None) -> Iterator[S3Server]:
    with s3_server() as srv:
        srv.make_bucket(BUCKET)
        yield srv


def _client_error_code(exc: BaseException) -> str:
    cause = exc.__cause__
    assert isinstance(cause, botocore.exceptions.ClientError), repr(cause)
    return str(cause.response["Error"]["Code"])


def _moto_pids(port: int) -> list[int]:
    """Processes whose command line is a moto server on ``port`` (Linux /proc)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"moto.server" in argv and str(port).encode() in argv:
            pids.append(int(entry.name))
    return pids


def _port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(2)
        return s.connect_ex(("127.0.0.1", port)) == 0


def test_right_credentials_write_read_ls(server: S3Server) -> None:
    fs = server.filesystem()
    fs.mkdir("made-by-s3fs")
    with fs.open("made-by-s3fs/dir/hello.txt", "wb") as f:
        f.write(b"hello, moto")
    assert fs.cat("made-by-s3fs/dir/hello.txt") == b"hello, moto"
    with fs.open("made-by-s3fs/dir/hello.txt", "rb") as f:
        assert f.read() == b"hello, moto"

    fresh = server.filesystem()  # no listing cache
    assert fresh.ls("made-by-s3fs") == ["made-by-s3fs/dir"]
    assert fresh.ls("made-by-s3fs/dir") == ["made-by-s3fs/dir/hello.txt"]
    assert {"made-by-s3fs", BUCKET} <= set(fresh.ls(""))
    assert fresh.info("made-by-s3fs/dir/hello.txt")["size"] == len(b"hello, moto")


def test_make_bucket_is_seen_by_s3fs(server: S3Server) -> None:
    server.make_bucket("made-by-boto3")
    fs = server.filesystem()
    assert fs.exists("made-by-boto3")
    assert fs.ls("made-by-boto3") == []


@pytest.mark.parametrize(
    ("change", "code"),
    [
        ({"secret": "not-the-secret"}, "SignatureDoesNotMatch"),
        ({"key": "AKIANOTAKEY000000000"}, "InvalidAccessKeyId"),
    ],
)
def test_wrong_credentials_raise_permission_error(
    server: S3Server, change: dict[str, str], code: str
) -> None:
    good = server.filesystem()
    good.pipe(f"{BUCKET}/secret.txt", b"data")
    bad = dataclasses.replace(server, **change).filesystem()

    with pytest.raises(PermissionError) as ls_err:
        bad.ls(BUCKET)
    assert type(ls_err.value) is PermissionError
    assert _client_error_code(ls_err.value) == code

    with pytest.raises(PermissionError) as list_err:
        bad.ls("")
    assert _client_error_code(list_err.value) == code

    # A GET of an object is a HEAD first: a 403 without a body, so no error code from S3.
    with pytest.raises(PermissionError) as read_err:
        bad.cat(f"{BUCKET}/secret.txt")
    assert type(read_err.value) is PermissionError
    assert _client_error_code(read_err.value) == "403"

    with pytest.raises(PermissionError) as write_err:
        bad.pipe(f"{BUCKET}/other.txt", b"x")
    assert _client_error_code(write_err.value) == code
    assert not good.exists(f"{BUCKET}/other.txt")


def test_missing_bucket_raises_file_not_found(server: S3Server) -> None:
    fs = server.filesystem()
    calls: list[Callable[[], object]] = [
        lambda: fs.ls("no-such-bucket"),
        lambda: fs.ls("no-such-bucket/sub"),
        lambda: fs.open("no-such-bucket/key", "rb"),
        lambda: fs.cat("no-such-bucket/key"),
    ]
    for call in calls:
        with pytest.raises(FileNotFoundError) as err:
            call()
        assert type(err.value) is FileNotFoundError
        assert "The specified bucket does not exist" in str(err.value)
    assert not fs.exists("no-such-bucket")
    with pytest.raises(FileNotFoundError):
        fs.open(f"{BUCKET}/no-such-key", "rb")


def test_env_alone_reaches_the_server(server: S3Server, monkeypatch: pytest.MonkeyPatch) -> None:
    """botocore reads AWS_ENDPOINT_URL, and s3fs (via aiobotocore) gets it from there."""
    server.filesystem().pipe(f"{BUCKET}/via-env.txt", b"env")
    for name, value in server.env().items():
        monkeypatch.setenv(name, value)
    fs = s3fs.S3FileSystem(skip_instance_cache=True)
    assert fs.cat(f"{BUCKET}/via-env.txt") == b"env"

    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong")
    with pytest.raises(PermissionError):
        s3fs.S3FileSystem(skip_instance_cache=True).ls(BUCKET)


def test_unreachable_endpoint_fails_fast_without_retries(no_aws_env: None) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed once the block ends
    dead = S3Server(endpoint=f"http://127.0.0.1:{port}", key="k", secret="s")
    fs = dead.filesystem(config_kwargs={"retries": {"total_max_attempts": 1}})
    start = time.monotonic()
    with pytest.raises(botocore.exceptions.EndpointConnectionError):
        fs.ls(BUCKET)
    with pytest.raises(botocore.exceptions.EndpointConnectionError):
        fs.cat(f"{BUCKET}/key")
    assert time.monotonic() - start < 5


def test_exit_closes_port_and_stops_process(no_aws_env: None) -> None:
    start = time.monotonic()
    with s3_server() as srv:
        started = time.monotonic() - start
        port = int(srv.endpoint.rsplit(":", 1)[1])
        assert _port_open(port)
        pids = _moto_pids(port)
        assert len(pids) == 1
        assert os.getpgid(pids[0]) == pids[0]  # its own process group: killpg reaches all
        assert os.getpgid(pids[0]) != os.getpgid(0)
    assert started < 30
    assert not _port_open(port)
    assert _moto_pids(port) == []
    with pytest.raises(ProcessLookupError):
        os.kill(pids[0], 0)


def test_start_timeout_reports_and_cleans_up(no_aws_env: None) -> None:
    before = {p for p in Path("/proc").iterdir() if p.name.isdigit()}
    with pytest.raises(RuntimeError, match="did not answer within 0 s"), s3_server(timeout=0):
        pytest.fail("must not get here")
    leftovers = {
        p
        for p in Path("/proc").iterdir()
        if p.name.isdigit() and p not in before and b"moto.server" in _cmdline(p)
    }
    assert leftovers == set()


def _cmdline(proc_dir: Path) -> bytes:
    try:
        return (proc_dir / "cmdline").read_bytes()
    except OSError:
        return b""
