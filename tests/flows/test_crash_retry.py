"""A nightly run whose process is SIGKILLed is retried once, by the shipped automation.

Through the session's real server, deployments and `gridsolve worker`: the run's
engine process (the worker's child) is killed mid-solve; the worker marks the
run Crashed, the automation installed by `gridsolve deploy` puts it back to
AwaitingRetry, the worker runs it again, and the retry completes with the
tiles stored before the kill reused.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any
from uuid import UUID

import numpy as np
import pytest
import xarray as xr
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId
from prefect.deployments import run_deployment

from gridsolve.flows.automations import RETRY_CRASHED

from testkit import make_ds, tiles_stored

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("worker")]


def engine_pid(flow_run_id: UUID) -> int | None:
    """The process running the flow run (the worker's child), found by its environment."""
    mark = f"PREFECT__FLOW_RUN_ID={flow_run_id}".encode()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            env = Path(f"/proc/{entry}/environ").read_bytes().split(b"\0")
            cmd = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:
            continue
        if mark in env and b"python" in cmd:
            return int(entry)
    return None


def flow_run(run_id: UUID) -> Any:
    with get_client(sync_client=True) as client:
        return client.read_flow_run(run_id)


def test_a_killed_nightly_run_is_retried_once_and_reuses_its_tiles(tmp_path: Path) -> None:
    with get_client(sync_client=True) as client:
        assert client.read_automations_by_name(RETRY_CRASHED), "gridsolve deploy installs it"
    cube = tmp_path / "cube.nc"
    make_ds(n_obs=30, ny=128, nx=128, nan_fraction=0.1, dtype="float32").to_netcdf(cube)
    cache, out = tmp_path / "cache", tmp_path / "night.nc"
    params = {
        "load": {"impl": "netcdf", "path": str(cube)},
        "design": {"impl": "harmonic", "harmonics": 1},
        "model": {"impl": "multidim_linear", "input_dim": 2, "hidden_dim": 2, "output_dim": 3},
        "write": {"impl": "netcdf", "path": str(out)},
        "cache": {"root": str(cache)},
        "execution": {"tile_pixels": 1024},
    }
    run = run_deployment("gridsolve/nightly", parameters=params, timeout=0)
    deadline = time.monotonic() + 300
    pid = None
    while time.monotonic() < deadline:
        state = flow_run(run.id).state
        assert state is None or not state.is_final(), state  # killed before it could finish
        pid = engine_pid(run.id)
        if pid is not None and tiles_stored(cache, "solve") >= 2:
            break
        time.sleep(0.05)
    assert pid is not None, "the run's process never appeared"
    os.kill(pid, signal.SIGKILL)
    killed_with = tiles_stored(cache, "solve")

    deadline = time.monotonic() + 400
    final = None
    while time.monotonic() < deadline:
        final = flow_run(run.id)
        if final.state is not None and final.state.is_final() and final.run_count >= 2:
            break
        time.sleep(1)
    assert final is not None and final.state is not None
    with get_client(sync_client=True) as client:
        states = client.read_flow_run_states(run.id)
        names = [s.name for s in states]
    history = [(s.name, s.timestamp.isoformat(), s.message) for s in states]
    assert final.state.is_completed(), (final.state, history)
    # retried exactly once, as the same flow run
    assert names.count("Crashed") == 1 and names.count("AwaitingRetry") == 1, (names, history[5:])
    with get_client(sync_client=True) as client:
        artifacts = client.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[run.id]))
        )
    assert "Crashed" in names and "AwaitingRetry" in names, names
    assert names.index("Crashed") < names.index("AwaitingRetry") < len(names) - 1

    # The retry reused what the killed run stored: its solve row shows tiles hit.
    summary = [a for a in artifacts if a.key == "gridsolve-summary"]
    assert len(summary) == 1, [a.key for a in artifacts]
    rows = json.loads(summary[0].data) if isinstance(summary[0].data, str) else summary[0].data
    solve = next(r for r in rows if r["stage"] == "solve")
    assert solve["cache"] != "miss", solve
    hit = solve["cache"].split("/")[0]
    assert solve["cache"] == "hit" or int(hit) >= killed_with, (solve, killed_with)

    # And the output is right: per-pixel least squares on its valid observations (numpy).
    with xr.open_dataset(out) as ds, xr.open_dataset(cube) as src:
        A = ds["design"].transpose("time", "coef").values.astype(np.float64)
        coef = ds["coefficients"].transpose("coef", "y", "x").values
        y = src["signal"].transpose("time", "y", "x").values.astype(np.float64)
    rng = np.random.default_rng(0)
    for i, j in rng.integers(0, 128, size=(40, 2)):
        ok = np.isfinite(y[:, i, j])
        ref = np.linalg.lstsq(A[ok], y[ok, i, j], rcond=None)[0]
        np.testing.assert_allclose(coef[:, i, j], ref, rtol=1e-3, atol=1e-4)


def test_a_run_whose_machine_dies_is_marked_crashed(tmp_path: Path) -> None:
    # The whole "machine" of a run is killed at once (its process group: no worker, no
    # engine left to report anything). Its heartbeats stop, and the silent-run
    # automation marks it Crashed (the conftest sets 30-s heartbeats, a 120-s window).
    import subprocess
    import sys

    import yaml

    from gridsolve.flows.automations import CRASH_SILENT

    with get_client(sync_client=True) as client:
        assert client.read_automations_by_name(CRASH_SILENT), "gridsolve deploy installs it"
    cube = tmp_path / "cube.nc"
    make_ds(n_obs=30, ny=128, nx=128, nan_fraction=0.1, dtype="float32").to_netcdf(cube)
    cache, out = tmp_path / "cache", tmp_path / "lost.nc"
    cfg = tmp_path / "run.yaml"
    cfg.write_text(
        yaml.safe_dump(
            {
                "load": {"impl": "netcdf", "path": str(cube)},
                "design": {"impl": "harmonic", "harmonics": 1},
                "write": {"impl": "netcdf", "path": str(out)},
                "cache": {"root": str(cache)},
                "execution": {"tile_pixels": 512},
            }
        )
    )
    gridsolve = str(Path(sys.executable).parent / "gridsolve")
    proc = subprocess.Popen(
        [gridsolve, "run", str(cfg)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and tiles_stored(cache, "solve") < 2:
            assert proc.poll() is None, "the run ended before it could be killed"
            time.sleep(0.05)
        run_id = running_run_writing(out)
        assert run_id is not None, "the run is not Running on the server"
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    killed = time.monotonic()

    deadline = killed + 120 + 30 + 120  # window + one heartbeat interval + the services' pace
    state = flow_run(run_id).state
    while time.monotonic() < deadline and not (state is not None and state.is_final()):
        time.sleep(2)
        state = flow_run(run_id).state
    assert state is not None and state.is_crashed(), state
    assert "no heartbeat" in (state.message or ""), state.message
    assert not out.exists()  # nothing half-written under the output's name


def running_run_writing(out: Path) -> UUID | None:
    """The Running flow run whose config writes ``out``."""
    from prefect.client.schemas.filters import (
        FlowRunFilter,
        FlowRunFilterState,
        FlowRunFilterStateType,
    )
    from prefect.client.schemas.objects import StateType

    running = FlowRunFilterState(type=FlowRunFilterStateType(any_=[StateType.RUNNING]))
    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(flow_run_filter=FlowRunFilter(state=running))
    for r in runs:
        if (r.parameters.get("write") or {}).get("path") == str(out):
            found: UUID = r.id
            return found
    return None
