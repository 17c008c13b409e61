"""A real S3-compatible server for tests: moto in server mode, with authentication enforced.

``s3_server()`` starts ``python -m moto.server`` as a separate OS process (its own process
session) on a free 127.0.0.1 port, waits until it answers, then creates an IAM user that may do
``s3:*`` on ``*`` and an access key for it. Moto checks credentials only when
``INITIAL_NO_AUTH_ACTION_COUNT`` is set: it lets that many authorised requests through
unchecked, then authenticates and authorises every request against its IAM state. The server
gets exactly ``BOOTSTRAP_CALLS`` (the create-user, put-user-policy and create-access-key calls
made here; ``/moto-api/...`` requests, like the readiness probe, are not counted), so from then
on every S3 request must be signed with the created key: an unknown key id is refused with
``InvalidAccessKeyId`` and a wrong secret with ``SignatureDoesNotMatch`` (HTTP 403), which s3fs
raises as ``PermissionError``. The bootstrap checks this before yielding.

Moto's ``POST /moto-api/reset-auth`` (unauthenticated) can switch authentication back off; no
code here calls it.

Environment: the server process inherits none of the test process's ``AWS_*`` or ``MOTO_*``
variables, and its log goes to a temporary file (removed when the context exits), never a pipe.
``S3Server.env()`` gives the variables a child process needs to reach the server; botocore
(>= 1.31) and so s3fs, through aiobotocore, read the endpoint from ``AWS_ENDPOINT_URL`` (checked
against s3fs 2026.9 / aiobotocore 3.10 / botocore 1.43 in ``tests/test_s3server.py``).

Timing on an idle 2-core machine: the server answers about 0.5 s after the start, the bootstrap
takes 0.1-0.2 s more (plus about 0.3 s to import boto3 the first time), stopping about 0.2 s.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import s3fs

#: The region every client here uses (moto's IAM is global; S3 buckets are made here).
REGION = "us-east-1"
#: The number of requests the server lets through unauthenticated: the bootstrap's calls.
BOOTSTRAP_CALLS = 3
#: Seconds to wait for the server to answer after starting it.
START_TIMEOUT = 30.0
#: Seconds between SIGTERM and SIGKILL to the server's process group.
STOP_GRACE = 5.0

_USER = "gridsolve-test"
_POLICY = json.dumps(
    {
        "Version": "2012-10-17",
        "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}],
    }
)


@dataclass(frozen=True)
class S3Server:
    """A running moto S3 server and a valid access key for it."""

    endpoint: str
    key: str
    secret: str
    region: str = REGION

    def env(self) -> dict[str, str]:
        """Environment variables that point botocore (and so s3fs) at this server and key."""
        return {
            "AWS_ACCESS_KEY_ID": self.key,
            "AWS_SECRET_ACCESS_KEY": self.secret,
            "AWS_DEFAULT_REGION": self.region,
            "AWS_ENDPOINT_URL": self.endpoint,
        }

    def filesystem(self, **options: Any) -> s3fs.S3FileSystem:
        """A fresh (uncached) s3fs filesystem with this key and endpoint.

        ``options`` are further ``S3FileSystem`` arguments and override the defaults set here;
        ``config_kwargs`` (botocore ``Config`` arguments) are merged with the region set here,
        e.g. ``config_kwargs={"retries": {"total_max_attempts": 1}}``.
        """
        import s3fs

        # The region goes in the botocore Config, not client_kwargs: from client_kwargs s3fs's
        # mkdir would send LocationConstraint=us-east-1, which S3 (and moto) refuse.
        config_kwargs = {"region_name": self.region, **options.pop("config_kwargs", {})}
        kwargs: dict[str, Any] = {
            "key": self.key,
            "secret": self.secret,
            "endpoint_url": self.endpoint,
            "config_kwargs": config_kwargs,
            "skip_instance_cache": True,
            **options,
        }
        return s3fs.S3FileSystem(**kwargs)

    def make_bucket(self, name: str) -> None:
        """Create the bucket ``name`` (with this key; boto3, not s3fs, so no s3fs cache)."""
        _client("s3", self.endpoint, self.key, self.secret).create_bucket(Bucket=name)


def _client(service: str, endpoint: str, key: str, secret: str) -> Any:
    """A boto3 client for ``service`` at ``endpoint`` that makes each request once (no retry)."""
    import boto3
    from botocore.config import Config

    return boto3.client(
        service,
        endpoint_url=endpoint,
        region_name=REGION,
        aws_access_key_id=key,
        aws_secret_access_key=secret,
        # A retried bootstrap call would use up one of the unauthenticated requests.
        config=Config(retries={"total_max_attempts": 1}),
    )


def _free_port() -> int:
    """A TCP port on 127.0.0.1 that nobody listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _server_env() -> dict[str, str]:
    """The server's environment: ours without AWS_*/MOTO_*, plus the auth switch."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "MOTO_"))}
    env.pop("TEST_SERVER_MODE", None)
    env["INITIAL_NO_AUTH_ACTION_COUNT"] = str(BOOTSTRAP_CALLS)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _tail(log: Path, n: int = 3000) -> str:
    """The end of the server's log."""
    try:
        return log.read_text(errors="replace")[-n:]
    except OSError:
        return ""


def _answers(endpoint: str) -> bool:
    """Whether the server answers HTTP (a moto-api request: not counted against the auth)."""
    try:
        with urllib.request.urlopen(f"{endpoint}/moto-api/config", timeout=2):
            return True
    except urllib.error.HTTPError:
        return True
    except OSError:
        return False


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """Stop the server's whole process group: SIGTERM, then SIGKILL after ``STOP_GRACE``."""
    with suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    with suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=STOP_GRACE)
    with suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)  # children left behind, or a hung server
    proc.wait()


def _start(log: Path, timeout: float) -> tuple[subprocess.Popen[bytes], str]:
    """Start the server on a free port and wait until it answers (retry if the port was taken)."""
    for attempt in range(3):
        port = _free_port()
        endpoint = f"http://127.0.0.1:{port}"
        with open(log, "ab") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                env=_server_env(),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        deadline = time.monotonic() + timeout
        try:
            while proc.poll() is None and time.monotonic() < deadline:
                if _answers(endpoint) and proc.poll() is None:
                    return proc, endpoint
                time.sleep(0.1)
        except BaseException:
            _stop(proc)
            raise
        exited = proc.poll()
        _stop(proc)
        if exited is None:
            raise RuntimeError(
                f"moto server on {endpoint} did not answer within {timeout:.0f} s; "
                f"log tail:\n{_tail(log)}"
            )
        if "Address already in use" not in _tail(log, 500) or attempt == 2:
            raise RuntimeError(f"moto server exited with {exited}; log tail:\n{_tail(log)}")
    raise AssertionError("unreachable")


def _bootstrap(endpoint: str) -> tuple[str, str]:
    """Create the IAM user, its s3:* policy and access key (``BOOTSTRAP_CALLS`` requests)."""
    import botocore.exceptions

    iam = _client("iam", endpoint, "bootstrap", "bootstrap")
    iam.create_user(UserName=_USER)
    iam.put_user_policy(UserName=_USER, PolicyName="s3-all", PolicyDocument=_POLICY)
    created = iam.create_access_key(UserName=_USER)["AccessKey"]
    key, secret = str(created["AccessKeyId"]), str(created["SecretAccessKey"])
    # From here on moto authenticates every request: an unknown key must be refused.
    try:
        _client("s3", endpoint, "AKIANOTAVALIDKEY0000", "nope").list_buckets()
    except botocore.exceptions.ClientError as e:
        if e.response["Error"]["Code"] != "InvalidAccessKeyId":
            raise
    else:
        raise RuntimeError("moto server accepted an unknown access key: auth is not enforced")
    return key, secret


@contextmanager
def s3_server(timeout: float = START_TIMEOUT) -> Iterator[S3Server]:
    """Start a moto S3 server with authentication enforced, bootstrap a key, yield, stop it.

    Waits up to ``timeout`` seconds for the server to answer (``RuntimeError`` with the tail of
    its log otherwise). On exit the server's process group gets SIGTERM, then SIGKILL after
    ``STOP_GRACE`` seconds, and its log is removed.
    """
    with tempfile.TemporaryDirectory(prefix="gridsolve-s3server-") as tmp:
        log = Path(tmp) / "moto.log"
        proc, endpoint = _start(log, timeout)
        try:
            try:
                key, secret = _bootstrap(endpoint)
            except Exception as e:
                raise RuntimeError(
                    f"moto server bootstrap failed: {e}; log tail:\n{_tail(log)}"
                ) from e
            yield S3Server(endpoint=endpoint, key=key, secret=secret, region=REGION)
        finally:
            _stop(proc)


def forget_filesystems() -> None:
    """Drop cached s3fs instances and gridsolve's bucket probes: credentials are read afresh.

    For tests that change ``AWS_*`` variables in this process (a real process reads them once).
    """
    import s3fs

    from gridsolve.stages.engine import remote

    s3fs.S3FileSystem.clear_instance_cache()
    remote.forget_probes()
