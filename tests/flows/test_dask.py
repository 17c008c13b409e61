"""Tiles on a real Dask LocalCluster (2 worker processes) give the threads output.

Same keys (the runner is speed-only) and values within the agreement bound:
Dask's workers run BLAS with other thread settings than the threads runner,
which the guarantee covers only within the bound (README, Determinism).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import xarray as xr

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
