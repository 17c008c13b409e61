"""A failed run's log on the real server: a user error once, as its message, no traceback.

The logs are read back from the session's Prefect server, as the UI shows them
(every record of the flow run, its task runs' included).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any
from uuid import UUID

import numpy as np
import pytest
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import (
    LogFilter,
    LogFilterFlowRunId,
)
from prefect.client.schemas.sorting import LogSort
from prefect.deployments import run_deployment
from prefect.logging.handlers import APILogWorker

import gridsolve.flows.pipeline as pipeline_module
from gridsolve.flows.pipeline import pipeline
from gridsolve.schemas.errors import StageError
from gridsolve.schemas.pipeline import PipelineConfig, build_config

from testkit import make_ds, settled_task_runs

pytestmark = [pytest.mark.server, pytest.mark.usefixtures("prefect_server")]


def config(tmp_path: Path, **over: Any) -> dict[str, Any]:
    cube = tmp_path / "cube.nc"
    make_ds(n_obs=12, ny=4, nx=5).to_netcdf(cube)
    raw: dict[str, Any] = {
        "load": {"impl": "netcdf", "path": str(cube)},
        "design": {"impl": "polynomial", "degree": 3},
        "model": {"impl": "multidim_linear", "input_dim": 2, "hidden_dim": 2, "output_dim": 2},
        "write": {"impl": "netcdf", "path": str(tmp_path / "out.nc")},
        "cache": {"root": str(tmp_path / "cache")},
    }
    raw.update(over)
    return raw


def run_flow(raw: dict[str, Any]) -> Any:
    """Run the flow in this process; its final state."""
    cfg = build_config(raw)
    params = {k: getattr(cfg, k) for k in PipelineConfig.model_fields}
    return pipeline(**params, return_state=True)


def run_logs(flow_run_id: UUID | str, until: str, timeout: float = 60) -> list[str]:
    """Every log message of the flow run, oldest first, once one holds ``until``."""
    APILogWorker.drain_all(timeout=5)  # records of runs in this process are sent in batches
    log_filter = LogFilter(flow_run_id=LogFilterFlowRunId(any_=[UUID(str(flow_run_id))]))
    deadline = time.monotonic() + timeout
    with get_client(sync_client=True) as client:
        while True:
            logs = client.read_logs(log_filter=log_filter, sort=LogSort.TIMESTAMP_ASC)
            if any(until in log.message for log in logs):
                break
            assert time.monotonic() < deadline, [log.message for log in logs]
            time.sleep(0.5)
        time.sleep(2)  # and any record that would repeat it
        logs = client.read_logs(log_filter=log_filter, sort=LogSort.TIMESTAMP_ASC)
    return [log.message for log in logs]


def task_messages(flow_run_id: UUID | str) -> dict[str, str]:
    runs = settled_task_runs(flow_run_id)
    return {r.name: (r.state.message or "") for r in runs if r.state and r.state.is_failed()}


def assert_reported_once(logs: list[str], needle: str) -> None:
    text = "\n".join(logs)
    assert "Traceback" not in text, text
    assert text.count(needle) == 1, text
    (record,) = [m for m in logs if needle in m]
    # The record is the error's own message: kind, stage, problem and fix, nothing around it.
    assert record.startswith(("input error: ", "numerical error: ")), record
    assert "fix:" in record, record


def _rank_deficient(tmp_path: Path) -> dict[str, Any]:
    ds = make_ds(n_obs=12, ny=4, nx=5)
    A = np.random.default_rng(0).standard_normal((12, 4))
    A[:, 3] = A[:, 0] - A[:, 2]
    ds["A"] = (("time", "coef"), A)
    ds.to_netcdf(tmp_path / "design.nc")
    return config(
        tmp_path,
        load={"impl": "netcdf", "path": str(tmp_path / "design.nc"), "design": "A"},
        design={"impl": "variable"},
        solve={"impl": "lstsq", "policy": "cholesky"},
    )


CASES = {
    # a whole stage's task (load)
    "missing file": (
        lambda t: config(t, load={"impl": "netcdf", "path": str(t / "nowhere.nc")}),
        "input file not found",
        "load",
    ),
    # the once-per-stage part of a tiled stage (solve-prepare)
    "singular design under cholesky": (_rank_deficient, "cannot solve this design", "solve"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_user_error_is_logged_once_without_traceback(case: str, tmp_path: Path) -> None:
    make, needle, stage = CASES[case]
    state = run_flow(make(tmp_path))
    assert state.is_failed(), state
    assert needle in (state.message or "")  # the flow run's state keeps the message
    flow_run_id = state.state_details.flow_run_id
    assert_reported_once(run_logs(flow_run_id, needle), needle)
    failed = task_messages(flow_run_id)
    assert [n for n in failed if n.startswith(stage)], failed
    assert all(needle in m for m in failed.values()), failed  # so do the task runs' states


def test_a_bug_keeps_its_traceback(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*args: Any, **kwargs: Any) -> Any:
        try:
            return 1 / 0
        except ZeroDivisionError as exc:  # what stages.runner makes of an unexpected error
            raise StageError(
                f"failed unexpectedly: {type(exc).__name__}: {exc}", stage="load/netcdf"
            ) from exc

    monkeypatch.setattr(pipeline_module, "run_stage", broken)
    state = run_flow(config(tmp_path))
    assert state.is_failed() and "failed unexpectedly" in (state.message or "")
    text = "\n".join(run_logs(state.state_details.flow_run_id, "Traceback"))
    assert "Traceback" in text and "ZeroDivisionError" in text, text


@pytest.mark.slow
def test_deployment_run_by_a_worker_logs_a_user_error_once(tmp_path: Path, worker: Any) -> None:
    """In the worker's engine subprocess Prefect logs a failure once more, with a traceback."""
    # a relative path in a deployment's parameters: under the worker's GRIDSOLVE_HOME
    raw = config(tmp_path, load={"impl": "netcdf", "path": "nowhere-relative.nc"})
    run = run_deployment("gridsolve/on-demand", parameters=raw, timeout=600)
    assert run.state is not None and run.state.is_failed(), run.state
    message = run.state.message or ""
    assert "input file not found" in message
    assert str(worker.home / "nowhere-relative.nc") in message, message
    assert f"GRIDSOLVE_HOME, here {worker.home}" in message, message
    assert_reported_once(run_logs(run.id, "input file not found"), "input file not found")
