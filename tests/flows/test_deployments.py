"""Deployments from prefect.yaml on a real server, run by a real process worker."""

from __future__ import annotations

import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import xarray as xr
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import (
    DeploymentFilter,
    DeploymentFilterId,
)
from prefect.client.schemas.schedules import IntervalSchedule
from prefect.deployments import run_deployment
from prefect.exceptions import PrefectHTTPStatusError

from gridsolve.schemas.errors import ConfigError
from gridsolve.schemas.pipeline import build_config

from testkit import make_ds, settled_task_runs

REPO = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("worker")]


def params(tmp_path: Path, cube: Path, **over: Any) -> dict[str, Any]:
    raw: dict[str, Any] = {
        "load": {"impl": "netcdf", "path": str(cube)},
        "design": {"impl": "polynomial", "degree": 3},
        "model": {"impl": "multidim_linear", "input_dim": 2, "hidden_dim": 2, "output_dim": 3},
        "write": {"impl": "netcdf", "path": str(tmp_path / "out-{flow_run_name}.nc")},
        "cache": {"root": str(tmp_path / "cache")},
    }
    raw.update(over)
    return raw


def task_states(flow_run_id: Any) -> dict[str, str]:
    runs = settled_task_runs(flow_run_id)
    return {r.name: r.state.name for r in runs if r.state is not None}


def test_custom_runs_through_the_api_reuse_unchanged_stages(
    tmp_path: Path, write_cube: Any
) -> None:
    cube = write_cube(make_ds(n_obs=20, ny=12, nx=10, nan_fraction=0.1))
    first = run_deployment("gridsolve/on-demand", parameters=params(tmp_path, cube), timeout=600)
    assert first.state is not None and first.state.is_completed(), first.state
    out = tmp_path / f"out-{first.name}.nc"
    with xr.open_dataset(out) as ds:
        assert ds.sizes["coef"] == 4 and "grad_weight" in ds

    changed = params(
        tmp_path,
        cube,
        model={"impl": "multidim_linear", "input_dim": 2, "hidden_dim": 2, "output_dim": 2},
    )
    second = run_deployment("gridsolve/on-demand", parameters=changed, timeout=600)
    assert second.state is not None and second.state.is_completed(), second.state
    states = task_states(second.id)
    for name, state in states.items():
        upstream = name.split("-")[0] in ("load", "design", "normal_equations", "solve")
        assert state == ("Cached" if upstream else "Completed"), (name, state)
    assert {n.split("-")[0] for n in states} >= {
        "load",
        "design",
        "normal_equations",
        "solve",
        "model",
        "write",
    }
    assert second.parameters["model"]["output_dim"] == 2
    assert second.parameters["load"]["path"] == str(cube)  # the other sections are kept


def test_server_rejects_a_negative_ridge_before_the_run(tmp_path: Path, write_cube: Any) -> None:
    cube = write_cube(make_ds())
    bad = params(tmp_path, cube, solve={"impl": "lstsq", "policy": "ridge", "ridge": -1.0})
    with pytest.raises(PrefectHTTPStatusError) as err:
        run_deployment("gridsolve/on-demand", parameters=bad, timeout=0)
    assert err.value.response.status_code == 409
    # Prefect reports ONE error, picked by jsonschema's best_match: in a section with
    # several implementations (solve: lstsq, curvefit) the other variant's 'impl' mismatch
    # sorts first ('impl' < 'ridge'). The UI form's validation lists every error of the
    # chosen implementation; `gridsolve validate` prints every problem (docs/failures.md).
    assert "Validation failed for field 'solve" in err.value.response.text
    with pytest.raises(ConfigError, match=r"solve\.ridge"):
        build_config(bad)


def test_a_custom_runs_job_variables_cannot_change_its_environment_or_command(
    tmp_path: Path, write_cube: Any
) -> None:
    # The pool's job template (gridsolve deploy) fixes the run's environment, command and
    # folder. Were they a run's to set, these would fail the run (its input outside the
    # inputs allowed, a command that exits 1) or lift a worker's confinement ('*').
    cube = write_cube(make_ds())
    run = run_deployment(
        "gridsolve/on-demand",
        parameters=params(tmp_path, cube),
        job_variables={
            "env": {"GRIDSOLVE_ALLOWED_INPUTS": "/nowhere", "GRIDSOLVE_ALLOWED_ROOTS": "/nowhere"},
            "command": "false",
            "working_dir": "/",
        },
        timeout=600,
    )
    assert run.state is not None and run.state.is_completed(), run.state
    assert list(tmp_path.glob("out-*.nc"))
    with get_client(sync_client=True) as client:
        pool = client.read_work_pool("gridsolve-process")
    conf = pool.base_job_template["job_configuration"]
    assert conf["command"] is None and conf["working_dir"] is None and "env" not in conf


def test_the_server_refuses_a_credential_before_the_run_exists(tmp_path: Path) -> None:
    # A credential typed into storage_options (the UI form, the API) is refused by the
    # deployment's parameter schema: no flow run is created, so no stored parameter (the
    # UI's Parameters tab) holds it, and the refusal does not echo it.
    secret = "TOPSECRET-123"
    with get_client(sync_client=True) as client:
        before = {r.id for r in client.read_flow_runs()}
    for options in (
        {"secret": secret},
        {"client_kwargs": {"aws_secret_access_key": secret}},
        {"Key": secret},
    ):
        bad = params(
            tmp_path,
            tmp_path / "cube.nc",
            load={"impl": "netcdf", "path": "s3://bucket/cube.nc", "storage_options": options},
        )
        with pytest.raises(PrefectHTTPStatusError) as err:
            run_deployment("gridsolve/on-demand", parameters=bad, timeout=0)
        assert err.value.response.status_code == 409, err.value.response.text
        assert secret not in err.value.response.text
    with get_client(sync_client=True) as client:
        made = [r for r in client.read_flow_runs() if r.id not in before]
    assert not [r.name for r in made if secret in str(r.parameters)], "a run holds the secret"


def test_a_schedule_fires_without_any_manual_trigger(
    tmp_path: Path, write_cube: Any, deployments: dict[str, str]
) -> None:
    cube = write_cube(make_ds())
    dep_id = deployments["nightly"]
    with get_client(sync_client=True) as client:
        # runs of the nightly deployment from other tests (test_crash_retry's) are not ours
        earlier = {r.id for r in _runs(client, dep_id)}
        (schedule,) = client.create_deployment_schedules(
            dep_id,
            [(IntervalSchedule(interval=timedelta(seconds=5)), True)],
            parameters=params(tmp_path, cube),
        )
        try:
            # The schedule is removed as soon as the worker took one of its runs: a run
            # every 5 s with no concurrency limit piled up on 2 cores, and the runs
            # already taken outlived the test (deleting a schedule deletes only its runs
            # not yet started) and made the next test time out in CI.
            deadline = time.monotonic() + 240
            while time.monotonic() < deadline and not taken(client, dep_id, earlier):
                time.sleep(1)
        finally:
            # A loaded 2-core machine can make the SQLite-backed server answer 503 briefly.
            for attempt in range(5):
                try:
                    client.delete_deployment_schedule(dep_id, schedule.id)
                    break
                except Exception:
                    if attempt == 4:
                        raise
                    time.sleep(3)
        runs = settled(client, dep_id, earlier, wait=300)
    states = {r.name: r.state.name if r.state else "?" for r in runs}
    assert runs and all(r.auto_scheduled for r in runs), states
    assert all(r.state is not None and r.state.is_final() for r in runs), states
    assert any(r.state is not None and r.state.is_completed() for r in runs), states
    assert list(tmp_path.glob("out-*.nc"))


def _runs(client: Any, dep_id: str) -> list[Any]:
    found: list[Any] = client.read_flow_runs(
        deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[dep_id]))
    )
    return found


def taken(client: Any, dep_id: str, earlier: set[Any]) -> bool:
    """Whether a worker took one of the deployment's new runs (pending, running or done)."""
    return any(
        r.state is not None and not r.state.is_scheduled() and r.id not in earlier
        for r in _runs(client, dep_id)
    )


def settled(client: Any, dep_id: str, earlier: set[Any], wait: float) -> list[Any]:
    """The deployment's runs not in ``earlier`` that a worker took, once none is running.

    After ``wait`` seconds, whatever they are. Runs still scheduled (the
    deployment's own nightly cron) are not counted.
    """
    deadline = time.monotonic() + wait
    while True:
        runs = [
            r
            for r in _runs(client, dep_id)
            if r.state and not r.state.is_scheduled() and r.id not in earlier
        ]
        if time.monotonic() > deadline or all(
            r.state is not None and r.state.is_final() for r in runs
        ):
            return runs
        time.sleep(2)


def test_bad_input_is_a_failed_run_with_its_message_and_the_worker_lives_on(
    tmp_path: Path, worker: Any
) -> None:
    bad = params(tmp_path, tmp_path / "no-such-cube.nc")
    run = run_deployment("gridsolve/on-demand", parameters=bad, timeout=600)
    assert run.state is not None and run.state.is_failed(), run.state
    assert "input file not found" in (run.state.message or "")
    assert worker.proc.poll() is None  # a failed run is not a crashed worker
    good = run_deployment(
        "gridsolve/on-demand", parameters=params(tmp_path, write_cube_for(tmp_path)), timeout=600
    )
    assert good.state is not None and good.state.is_completed()


def write_cube_for(tmp_path: Path) -> Path:
    path = tmp_path / "good.nc"
    make_ds().to_netcdf(path)
    return path


def test_the_nightly_deployment_refuses_the_demo_and_on_demand_runs_it(
    tmp_path: Path, worker: Any
) -> None:
    cache = {"root": str(tmp_path / "cache")}
    nightly = run_deployment("gridsolve/nightly", parameters={"cache": cache}, timeout=600)
    assert nightly.state is not None and nightly.state.is_failed(), nightly.state
    message = nightly.state.message or ""
    assert "load.path is not set" in message and "nightly" in message, message
    assert not list(tmp_path.glob("cache/objects/*")), "nothing computed"
    checkout = sorted(p.name for p in REPO.iterdir())
    demo = run_deployment("gridsolve/on-demand", timeout=600)  # every default
    assert demo.state is not None and demo.state.is_completed(), demo.state
    # the defaults' relative paths land under GRIDSOLVE_HOME, not in the code checkout
    out = worker.home / "outputs" / "on-demand" / f"gridsolve-{demo.name}.nc"
    assert out.is_file() and Path(f"{out}.quicklook.png").is_file()
    assert list((worker.home / ".gridsolve-cache").iterdir())
    assert sorted(p.name for p in REPO.iterdir()) == checkout
    with xr.open_dataset(out) as ds:
        assert ds.attrs["gridsolve_input_hash"]
