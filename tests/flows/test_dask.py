"""Tiles on a real Dask LocalCluster (2 worker processes) give the threads output.

Same keys (the runner is speed-only) and values within the agreement bound:
Dask's workers run BLAS with other thread settings than the threads runner,
which the guarantee covers only within the bound (README, Determinism).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import xarray as xr

from gridsolve.flows.localserver import free_port, stop_group
from gridsolve.flows.pipeline import run_config
from gridsolve.schemas.pipeline import build_config
from gridsolve.stages.engine.agreement import disagreements

from testkit import make_ds

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("prefect_server")]


def cfg(tmp_path: Path, cube: Path, cache: str, **execution: Any) -> Any:
    return build_config(
        {
            "load": {"path": str(cube)},
            "design": {"impl": "harmonic", "harmonics": 1},  # 4 coefficients
            "model": {"impl": "multidim_linear", "input_dim": 2, "hidden_dim": 2, "output_dim": 3},
            "write": {"path": str(tmp_path / "out.nc"), "chunks": {"y": 4, "x": 8}},
            "cache": {"root": str(tmp_path / cache)},
            "execution": {"tile_pixels": 64, **execution},
        }
    )


def test_local_cluster_output_agrees_with_threads(tmp_path: Path, write_cube: Any) -> None:
    cube = write_cube(make_ds(n_obs=30, ny=16, nx=24, nan_fraction=0.15, dtype="float32"))
    threads = run_config(cfg(tmp_path, cube, "cache-threads"))
    with xr.open_dataset(threads.output) as ds:
        expected = {name: ds[name].values for name in ds.data_vars}
        first_keys = ds.attrs["gridsolve_keys"]
    Path(threads.output).unlink()
    # Same output path, its own cache: every stage really computed on the cluster.
    dask = run_config(cfg(tmp_path, cube, "cache-dask", runner="dask", dask_workers=2))
    assert threads.tiles == dask.tiles > 2
    assert not any(s.hit for s in dask.stages)
    with xr.open_dataset(dask.output) as ds:
        got = {name: ds[name].values for name in ds.data_vars}
        keys = ds.attrs["gridsolve_keys"]
    assert not disagreements(got, expected)
    assert keys == first_keys


def test_a_cluster_of_separate_processes_gives_the_threads_output(
    tmp_path: Path, write_cube: Any
) -> None:
    """`dask scheduler` and two `dask worker` OS processes, as on several machines.

    The input is a 4-D cube split over 3 files (a glob), read by the workers
    themselves; the cache and output are on the disk they share here.
    """
    ds = make_ds(n_obs=24, ny=10, nx=12, nan_fraction=0.15, dtype="float32")
    ds = xr.concat([ds, ds * 0.5], dim="member").transpose("time", "member", "y", "x")
    for i, (a, b) in enumerate(((0, 8), (8, 16), (16, 24))):
        write_cube(ds.isel(time=slice(a, b)), f"part-{i}.nc")
    cube = tmp_path / "part-*.nc"
    threads = run_config(cfg(tmp_path, cube, "cache-threads"))
    with xr.open_dataset(threads.output) as out:
        expected = {name: out[name].values for name in out.data_vars}
        assert out["coefficients"].dims == ("coef", "member", "y", "x")
    Path(threads.output).unlink()
    dask_bin = str(Path(sys.executable).parent / "dask")
    port = free_port()
    procs = [
        subprocess.Popen(
            [
                dask_bin,
                "scheduler",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--dashboard-address",
                ":0",
                "--no-show",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
    ]
    try:
        for _ in range(2):
            procs.append(
                subprocess.Popen(
                    [
                        dask_bin,
                        "worker",
                        f"tcp://127.0.0.1:{port}",
                        "--nthreads",
                        "1",
                        "--host",
                        "127.0.0.1",
                        "--dashboard-address",
                        ":0",
                        "--no-nanny",
                    ],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                    start_new_session=True,
                )
            )
        from distributed import Client

        with Client(f"tcp://127.0.0.1:{port}", timeout=60) as client:
            client.wait_for_workers(2, timeout=120)
            workers = client.scheduler_info()["workers"]
            assert len(workers) == 2
        cluster = run_config(
            cfg(
                tmp_path,
                cube,
                "cache-cluster",
                runner="dask",
                dask_address=f"tcp://127.0.0.1:{port}",
            )
        )
    finally:
        for p in procs:
            stop_group(p)
    assert threads.tiles == cluster.tiles > 2
    assert not any(s.hit for s in cluster.stages)
    with xr.open_dataset(cluster.output) as out:
        got = {name: out[name].values for name in out.data_vars}
    assert not disagreements(got, expected)
