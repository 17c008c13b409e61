"""Tiles on a real Dask LocalCluster (2 worker processes) give the threads output.

Same keys (the runner is speed-only) and values within the agreement bound:
Dask's workers run BLAS with other thread settings than the threads runner,
which the guarantee covers only within the bound (docs/failures.md, Determinism).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
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


@contextmanager
def dask_cluster(tmp_path: Path, worker_env: list[dict[str, str]] | None = None) -> Iterator[str]:
    """`dask scheduler` and two `dask worker` OS processes on 127.0.0.1; yields the address.

    ``worker_env``: each worker's extra environment (its own folders, credentials).
    """
    dask_bin = str(Path(sys.executable).parent / "dask")
    port = free_port()
    scheduler = [dask_bin, "scheduler", "--host", "127.0.0.1", "--port", str(port)]
    procs = [
        subprocess.Popen(
            [*scheduler, "--dashboard-address", ":0", "--no-show"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
    ]
    try:
        for i in range(2):
            extra = (worker_env or [{}, {}])[i]
            cwd = tmp_path / f"worker-{i}"
            cwd.mkdir(exist_ok=True)
            procs.append(
                subprocess.Popen(
                    [
                        *(dask_bin, "worker", f"tcp://127.0.0.1:{port}", "--nthreads", "1"),
                        *("--host", "127.0.0.1", "--dashboard-address", ":0", "--no-nanny"),
                        *("--local-directory", str(cwd)),
                    ],
                    cwd=cwd,
                    env={**os.environ, **extra},
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                    start_new_session=True,
                )
            )
        from distributed import Client

        with Client(f"tcp://127.0.0.1:{port}", timeout=60) as client:
            client.wait_for_workers(2, timeout=120)
            assert len(client.scheduler_info()["workers"]) == 2
        yield f"tcp://127.0.0.1:{port}"
    finally:
        for p in procs:
            stop_group(p)


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
    with dask_cluster(tmp_path) as address:
        cluster = run_config(
            cfg(tmp_path, cube, "cache-cluster", runner="dask", dask_address=address)
        )
    assert threads.tiles == cluster.tiles > 2
    assert not any(s.hit for s in cluster.stages)
    with xr.open_dataset(cluster.output) as out:
        got = {name: out[name].values for name in out.data_vars}
    assert not disagreements(got, expected)


def test_workers_sharing_no_disk_use_a_bucket_for_input_cache_and_output(
    tmp_path: Path, write_cube: Any, s3: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Input, cache and output in an S3 bucket; each worker its own local folders.

    Each worker process gets its own ``GRIDSOLVE_MIRROR`` and working folder,
    and this process (the flow's client) a third, so nothing one writes
    locally is seen by another: every artifact passes through the bucket.
    The output (Zarr, in the bucket) agrees with a threads run on local disk,
    and a later threads run on a fourth "host" reuses every stage from the bucket.
    """
    ds = make_ds(n_obs=24, ny=10, nx=12, nan_fraction=0.15, dtype="float32")
    for i, (a, b) in enumerate(((0, 12), (12, 24))):
        part = write_cube(ds.isel(time=slice(a, b)), f"part-{i}.nc")
        s3.fs.put_file(str(part), f"{s3.bucket}/in/part-{i}.nc")

    def config(cube: str, cache: str, out: str, **execution: Any) -> Any:
        c = cfg(tmp_path, Path("unused"), "unused", **execution)
        raw = c.model_dump(mode="json", exclude_unset=True)
        raw["load"]["path"] = cube
        raw["cache"]["root"] = cache
        raw["write"] = {"impl": "zarr", "path": out, "chunks": raw["write"]["chunks"]}
        return build_config(raw)

    t0 = time.perf_counter()
    threads = run_config(
        config(str(tmp_path / "part-*.nc"), str(tmp_path / "cache"), str(tmp_path / "t.zarr"))
    )
    threads_s = time.perf_counter() - t0
    with xr.open_zarr(threads.output) as out:
        expected = {name: out[name].values for name in out.data_vars}
    env = [{"GRIDSOLVE_MIRROR": str(tmp_path / f"mirror-worker-{i}")} for i in range(2)]
    with dask_cluster(tmp_path, env) as address:
        t0 = time.perf_counter()
        cluster = run_config(
            config(
                s3.url("in/part-*.nc"),
                s3.url("cache"),
                s3.url("out.zarr"),
                runner="dask",
                dask_address=address,
            )
        )
        cluster_s = time.perf_counter() - t0
    assert threads.tiles == cluster.tiles > 2
    assert not any(s.hit for s in cluster.stages)
    with xr.open_zarr(s3.url("out.zarr"), storage_options={}) as out:
        got = {name: out[name].values for name in out.data_vars}
    assert not disagreements(got, expected)
    # Both workers computed tiles and uploaded them: their copies hold artifacts.
    for i in range(2):
        assert list((tmp_path / f"mirror-worker-{i}" / "cache").rglob("manifest.json"))
    n = len(s3.objects())
    monkeypatch.setenv("GRIDSOLVE_MIRROR", str(tmp_path / "mirror-fourth-host"))
    again = run_config(config(s3.url("in/part-*.nc"), s3.url("cache"), s3.url("out.zarr")))
    assert all(s.hit for s in again.stages), [(s.stage, s.hit) for s in again.stages]
    assert len(s3.objects()) == n
    print(f"threads (local disk) {threads_s:.2f} s, cluster (bucket) {cluster_s:.2f} s")
