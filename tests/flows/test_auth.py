"""A team server with Prefect's basic auth: strangers get 401, the team's worker still runs.

A real `prefect server` started with PREFECT_SERVER_API_AUTH_STRING on a free
loopback port; `gridsolve deploy`, `gridsolve worker` and `prefect deployment
run` as separate processes with and without PREFECT_API_AUTH_STRING.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import xarray as xr

from gridsolve.flows.localserver import LocalServer, stop_group

from testkit import make_ds

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
GRIDSOLVE = str(Path(sys.executable).parent / "gridsolve")
LOGIN = "alice:correct-horse-battery"


def status_of(url: str, auth: str | None, data: bytes | None = None) -> int:
    """The HTTP status of one request to ``url`` (POST when ``data``)."""
    req = urllib.request.Request(url, data=data, method="POST" if data is not None else "GET")
    req.add_header("Content-Type", "application/json")
    if auth is not None:
        req.add_header("Authorization", "Basic " + base64.b64encode(auth.encode()).decode())
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return int(r.status)
    except urllib.error.HTTPError as err:
        return int(err.code)


def deploy(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """`gridsolve deploy` of the checkout as a client with ``env``."""
    return subprocess.run(
        [GRIDSOLVE, "deploy", "--project", str(REPO)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def client_env(api: str, auth: str | None, home: Path) -> dict[str, str]:
    """The environment of a client process of the server at ``api``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(
        PREFECT_API_URL=api,
        PREFECT_HOME=str(home),
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
        PREFECT_WORKER_QUERY_SECONDS="1",
        PREFECT_WORKER_PREFETCH_SECONDS="5",
        # the conftest's heartbeat interval, which its silent-run window is sized for
        PREFECT_FLOWS_HEARTBEAT_FREQUENCY=os.environ["PREFECT_FLOWS_HEARTBEAT_FREQUENCY"],
    )
    if auth is not None:
        env["PREFECT_API_AUTH_STRING"] = auth
    return env


def test_basic_auth_refuses_strangers_and_runs_the_team_deployment(tmp_path: Path) -> None:
    cube = tmp_path / "cube.nc"
    make_ds(n_obs=16, ny=5, nx=6).to_netcdf(cube)
    out = tmp_path / "out-auth.nc"
    params = {
        "load": {"impl": "netcdf", "path": str(cube)},
        "design": {"impl": "polynomial", "degree": 3},
        "model": {"impl": "multidim_linear", "input_dim": 2, "hidden_dim": 2, "output_dim": 3},
        "write": {"impl": "netcdf", "path": str(out)},
        "cache": {"root": str(tmp_path / "cache")},
    }
    server = LocalServer(
        tmp_path / "server", extra_env={"PREFECT_SERVER_API_AUTH_STRING": LOGIN}
    ).start()
    worker = None
    try:
        api = server.api
        # the health check stays open (for probes); everything else wants the login
        assert status_of(f"{api}/health", None) == 200
        assert status_of(f"{api}/admin/version", None) == 401
        assert status_of(f"{api}/flows/filter", None, b"{}") == 401
        assert status_of(f"{api}/flows/filter", "alice:wrong", b"{}") == 401
        assert status_of(f"{api}/flows/filter", LOGIN, b"{}") == 200

        # A client without the login: one message naming the fix, no traceback, nothing made.
        strangers = client_env(api, None, tmp_path / "stranger")
        res = deploy(strangers)
        assert res.returncode == 2, res.stdout + res.stderr
        assert "requires a login (401 Unauthorized)" in res.stderr
        assert "PREFECT_API_AUTH_STRING" in res.stderr and "Traceback" not in res.stderr
        wrong = client_env(api, "alice:wrong", tmp_path / "stranger")
        res = deploy(wrong)
        assert res.returncode == 2 and "refused PREFECT_API_AUTH_STRING" in res.stderr
        assert "alice:wrong" not in res.stdout + res.stderr and "wrong" not in res.stderr

        cfg = tmp_path / "cfg.yaml"
        cfg.write_text(json.dumps(params))
        res = subprocess.run(
            [GRIDSOLVE, "run", str(cfg)], env=strangers, capture_output=True, text=True, timeout=300
        )
        assert res.returncode == 2 and "requires a login" in res.stderr, res.stderr
        assert not out.exists()

        # The team: deploy, a worker, and a run of the on-demand deployment.
        team = client_env(api, LOGIN, tmp_path / "team")
        res = deploy(team)
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
        assert LOGIN.split(":")[1] not in res.stdout + res.stderr  # the password is never shown
        log = tmp_path / "worker.log"
        with open(log, "wb") as f:
            worker = subprocess.Popen(
                [GRIDSOLVE, "worker", "--unconfined"],  # the test's files are in tmp_path
                env=team,
                stdout=f,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                cwd=tmp_path,
            )
        t0 = time.monotonic()
        res = subprocess.run(
            [
                sys.executable,
                "-m",
                "prefect",
                "deployment",
                "run",
                "gridsolve/on-demand",
                "--params",
                json.dumps(params),
                "--watch",
                "--watch-timeout",
                "400",
            ],
            env=team,
            capture_output=True,
            text=True,
            timeout=480,
        )
        seconds = time.monotonic() - t0
        assert res.returncode == 0, (
            res.stdout[-3000:] + res.stderr[-3000:] + log.read_text(errors="replace")[-3000:]
        )
        assert "Completed" in res.stdout, res.stdout[-2000:]
        assert seconds < 400
        assert LOGIN.split(":")[1] not in log.read_text(errors="replace")
    finally:
        if worker is not None:
            stop_group(worker)
        server.stop()

    # The output is right: each pixel's cubic fit, by numpy, on the scaled time axis.
    with xr.open_dataset(out) as ds:
        coef = ds["coefficients"].transpose("coef", "y", "x").values
    with xr.open_dataset(cube) as src:
        y = src["signal"].values.reshape(16, -1)
    t = np.linspace(-1.0, 1.0, 16)
    oracle = np.polynomial.polynomial.polyfit(t, y, 3).reshape(4, 5, 6)
    np.testing.assert_allclose(coef, oracle, rtol=1e-4, atol=1e-5)
