"""The Prefect flow end to end, against a real Prefect server: caching, invalidation, outputs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import xarray as xr
from prefect.client.orchestration import get_client

from gridsolve.flows.pipeline import run_config
from gridsolve.flows.reporting import RunSummary, cache_label
from gridsolve.schemas.kinds.write import NetCDFWrite, ZarrWrite
from gridsolve.schemas.pipeline import build_config

from testkit import CONTRACT, make_ds, settled_task_runs

pytestmark = pytest.mark.usefixtures("prefect_server")


def config(tmp_path: Path, cube: Path, **over: Any) -> Any:
    raw = {
        "load": {"path": str(cube)},
        "design": {"impl": "polynomial", "degree": 3},
        "solve": {"dtype": "float64"},
        "model": {"impl": "multidim_linear", "input_dim": 2, "hidden_dim": 2, "output_dim": 3},
        "write": {"path": str(tmp_path / "out.nc"), "chunks": {"y": 3, "x": 5}},
        "cache": {"root": str(tmp_path / "cache")},
        "execution": {"tile_pixels": 40},
    }
    for k, v in over.items():
        raw[k] = {**raw.get(k, {}), **v}
    return build_config(raw)


def cache_states(summary: RunSummary) -> dict[str, str]:
    return {s.stage: s.cache for s in summary.stages}


def task_state_names(flow_run_id: str) -> dict[str, str]:
    runs = settled_task_runs(flow_run_id)
    return {r.name: r.state.name for r in runs if r.state is not None}


@pytest.mark.slow  # ≥ 5 s beside a CPU hog: in CI, not in the fast tier
def test_rerun_hits_every_stage_and_changes_recompute_only_what_they_touch(
    tmp_path: Path, write_cube: Any
) -> None:
    ds = make_ds(n_obs=20, ny=9, nx=10, nan_fraction=0.1)
    cube = write_cube(ds)
    cfg = config(tmp_path, cube)

    first = run_config(cfg)
    assert not any(s.hit for s in first.stages)
    assert first.tiles > 1  # tile_pixels=40 on a 9×10 grid
    out = xr.open_dataset(first.output)
    assert set(out.data_vars) >= CONTRACT
    ref = ds["signal"].values
    A = out["design"].values
    ok = np.isfinite(ref[:, 4, 5])
    np.testing.assert_allclose(
        out["coefficients"].values[:, 4, 5],
        np.linalg.lstsq(A[ok], ref[ok, 4, 5], rcond=None)[0],
        rtol=1e-9,
    )
    out.close()

    second = run_config(cfg)
    assert second.all_hit, second.table()
    states = task_state_names(second.flow_run_id)
    assert states and set(states.values()) == {"Cached"}, states  # the Prefect UI shows Cached

    third = run_config(config(tmp_path, cube, model={"output_dim": 2}))
    assert cache_states(third) == {
        "load": "hit",
        "design": "hit",
        "normal_equations": "hit",
        "solve": "hit",
        "model": "miss",
        "write": "miss",
    }

    ds["signal"][5, 3, 3] += 1.0  # one value of the input file
    ds.to_netcdf(cube)
    fourth = run_config(config(tmp_path, cube, model={"output_dim": 2}))
    assert not any(s.hit for s in fourth.stages), fourth.table()


@pytest.mark.slow  # ≥ 5 s beside a CPU hog: in CI, not in the fast tier
def test_speed_only_fields_keep_the_cache(tmp_path: Path, write_cube: Any) -> None:
    cube = write_cube(make_ds())
    run_config(config(tmp_path, cube))
    again = run_config(
        config(
            tmp_path, cube, solve={"device": "cpu", "chunk_pixels": 7}, model={"chunk_pixels": 3}
        )
    )
    assert again.all_hit, again.table()


@pytest.mark.slow  # ≥ 5 s beside a CPU hog: in CI, not in the fast tier
def test_deleted_artifact_is_recomputed_not_trusted(tmp_path: Path, write_cube: Any) -> None:
    import shutil

    cube = write_cube(make_ds())
    cfg = config(tmp_path, cube)
    first = run_config(cfg)
    solve_key = next(s.key for s in first.stages if s.stage == "normal_equations")
    shutil.rmtree(tmp_path / "cache" / "objects" / solve_key[:2] / solve_key)
    again = run_config(cfg)
    assert cache_states(again)["normal_equations"] == "miss"
    assert cache_states(again)["solve"] == "hit"  # same key: its inputs' keys did not change


def test_plugin_design_is_chosen_by_config_in_the_flow(tmp_path: Path, write_cube: Any) -> None:
    import my_stage

    my_stage.install()
    try:
        cube = write_cube(make_ds())
        summary = run_config(config(tmp_path, cube, design={"impl": "legendre", "degree": 3}))
    finally:
        my_stage.uninstall()
    with xr.open_dataset(summary.output) as out:
        assert list(out["coef_name"].values) == ["P0", "P1", "P2", "P3"]


def test_plugin_tiled_solve_runs_through_the_flow(tmp_path: Path, write_cube: Any) -> None:
    # tests/plugins/my_solve.py follows only docs/extending.md's "a tiled kind" section
    import my_solve

    my_solve.install()
    try:
        cube = write_cube(make_ds(nan_fraction=0.1))
        cfg = config(tmp_path, cube, execution={"tile_pixels": 12})
        summary = run_config(cfg.model_copy(update={"solve": my_solve.NumpyLstsqSolve()}))
    finally:
        my_solve.uninstall()
    assert summary.tiles > 1
    assert summary.counts["solve"]["ok"] == 30
    with xr.open_dataset(summary.output) as out, xr.open_dataset(cube) as src:
        A, coef, data = out["design"].values, out["coefficients"].values, src["signal"].values
    ok = np.isfinite(data[:, 2, 3])
    expected = np.linalg.lstsq(A[ok], data[ok, 2, 3], rcond=None)[0]
    np.testing.assert_allclose(coef[:, 2, 3], expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("fmt", ["netcdf", "zarr"])
def test_a_plugin_describes_the_variables_it_adds_and_both_writers_write_them(
    tmp_path: Path, write_cube: Any, fmt: str
) -> None:
    # my_solve makes a `rank` array the solve kind does not have and declares its output
    # variable (StageDecl.variables); no writer names it
    import my_solve

    my_solve.install()
    try:
        cube = write_cube(make_ds(nan_fraction=0.1))
        out_path = tmp_path / ("out.zarr" if fmt == "zarr" else "out.nc")
        cfg = config(tmp_path, cube, execution={"tile_pixels": 12})
        cfg = cfg.model_copy(
            update={
                "solve": my_solve.NumpyLstsqSolve(),
                "write": (NetCDFWrite if fmt == "netcdf" else ZarrWrite)(
                    path=str(out_path), chunks={"y": 3, "x": 5}
                ),
            }
        )
        summary = run_config(cfg)
    finally:
        my_solve.uninstall()
    opened = xr.open_zarr(summary.output) if fmt == "zarr" else xr.open_dataset(summary.output)
    with opened as out, xr.open_dataset(cube) as src:
        rank, A, data = out["solve_rank"], out["design"].values, src["signal"].values
        assert rank.dims == ("y", "x")
        assert rank.attrs["long_name"] == "numerical rank of the pixel's valid rows of the design"
        assert rank.attrs["units"] == "1"
        expected = [
            [np.linalg.matrix_rank(A[np.isfinite(data[:, j, i])]) for i in range(data.shape[2])]
            for j in range(data.shape[1])
        ]
        np.testing.assert_array_equal(rank.values, expected)
        # the kind's own variables keep the kind's description
        assert out["status"].attrs["long_name"] == "solve status"


def test_servers_listen_on_loopback_only(prefect_server: Any) -> None:
    listening = []
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        addr, port = local.split(":")
        if state == "0A" and int(port, 16) == prefect_server.port:  # 0A: LISTEN
            listening.append(addr)
    assert listening == ["0100007F"], listening  # 127.0.0.1


@pytest.mark.slow  # ≥ 5 s beside a CPU hog: in CI, not in the fast tier
def test_training_through_the_flow_reports_progress_and_the_loss_curve(
    tmp_path: Path, write_cube: Any
) -> None:
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    ds = make_ds(n_obs=20, ny=9, nx=10)
    ds["tgt"] = (("y", "x"), ds["signal"].values.mean(axis=0) - 2.0)
    cube = write_cube(ds)
    cfg = config(
        tmp_path,
        cube,
        load={"target": "tgt"},
        train={"impl": "sgd", "epochs": 3, "batch_pixels": 16, "lr": 0.05},
        model={"output_dim": 1},
    )
    summary = run_config(cfg)
    assert [s.stage for s in summary.stages].index("train") == 4  # between solve and model
    assert cache_states(summary)["train"] == "miss"
    assert Path(f"{summary.output}.loss.png").read_bytes().startswith(b"\x89PNG")
    assert Path(f"{summary.output}.weights.safetensors").is_file()
    with get_client(sync_client=True) as client:
        artifacts = client.read_artifacts(
            artifact_filter=ArtifactFilter(
                flow_run_id=ArtifactFilterFlowRunId(any_=[summary.flow_run_id])
            )
        )
    progress = [
        a for a in artifacts if a.type == "progress" and "train: epoch" in (a.description or "")
    ]
    assert progress and progress[0].data == 100.0  # 3/3 epochs
    # drawn on a thread while the flow run finished, then attached to it (pictures_after_the_run)
    assert {"gridsolve-loss-curve", "gridsolve-quicklook"} <= {a.key for a in artifacts}
    again = run_config(cfg)
    assert cache_states(again)["train"] == "hit"


def test_cache_labels_count_tiles_not_the_prepare_step() -> None:
    assert cache_label([True, True, True], tiled=True) == "hit"
    assert cache_label([False, False], tiled=True) == "miss"
    assert cache_label([True, True, False, False], tiled=True) == "1/3 tiles hit"
    assert cache_label([False, True, True], tiled=True) == "2/2 tiles hit, prepare missed"
    assert cache_label([True, False]) == "1/2 hit"  # a whole stage's parts
