"""`gridsolve run` with ``solve: {impl: curvefit}``: NetCDF and Zarr out, CF-clean, cached."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import xarray as xr
import yaml

from testkit import ndvi_cube

GRIDSOLVE = str(Path(sys.executable).parent / "gridsolve")
PLUGINS = str(Path(__file__).resolve().parent.parent / "plugins")
NAMES = ["base", "amp", "up_rate", "sos", "down_rate", "eos"]
SOLVE = {
    "impl": "curvefit",
    "target": "my_curves:season",
    "params": NAMES,
    "p0": dict(zip(NAMES, [0.2, 0.5, 0.08, 120.0, 0.07, 275.0], strict=True)),
}


def gridsolve(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": PLUGINS}  # where the user's function lives
    return subprocess.run(
        [GRIDSOLVE, *args], cwd=cwd, capture_output=True, text=True, timeout=900, env=env
    )


def stage_rows(stdout: str) -> dict[str, str]:
    """Stage → hit/miss from the run summary."""
    rows = [line.split() for line in stdout.splitlines()]
    return {r[0]: r[3] for r in rows if len(r) > 3 and r[0] in ("load", "solve", "write")}


@pytest.mark.slow  # three CLI runs
@pytest.mark.usefixtures("prefect_server")
def test_a_nonlinear_fit_through_the_cli(tmp_path: Path) -> None:
    cube = ndvi_cube()
    cube.to_dataset().to_netcdf(tmp_path / "ndvi.nc")
    raw = {
        "load": {"path": "ndvi.nc", "variable": "ndvi"},
        "solve": SOLVE,
        "write": {"path": "fit.nc"},
        "cache": {"root": "cache"},
    }
    cfg = tmp_path / "fit.yaml"
    cfg.write_text(yaml.safe_dump(raw))
    valid = gridsolve("validate", str(cfg), cwd=tmp_path)
    assert valid.returncode == 0, valid.stderr[-3000:]
    assert "design:\n  impl: none" in valid.stdout  # what the run does, every field explicit

    first = gridsolve("run", str(cfg), cwd=tmp_path)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    assert stage_rows(first.stdout) == {"load": "miss", "solve": "miss", "write": "miss"}
    import gridsolve as api

    with xr.open_dataset(tmp_path / "fit.nc") as ds:
        assert list(ds["param_name"].values) == NAMES
        assert "design" not in ds and "coefficients" not in ds
        same = api.fit(cube, solve=SOLVE, progress=False)
        np.testing.assert_array_equal(ds["status"].values, same["status"].values)
        np.testing.assert_allclose(ds["params"].values, same["params"].values, rtol=1e-12)

    again = gridsolve("run", str(cfg), cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert stage_rows(again.stdout) == {"load": "hit", "solve": "hit", "write": "hit"}

    zarr_cfg = tmp_path / "zarr.yaml"
    zarr_cfg.write_text(yaml.safe_dump({**raw, "write": {"impl": "zarr", "path": "fit.zarr"}}))
    z = gridsolve("run", str(zarr_cfg), cwd=tmp_path)
    assert z.returncode == 0, z.stderr[-3000:]
    assert stage_rows(z.stdout)["solve"] == "hit"  # the writer is a speed-free choice
    with xr.open_zarr(tmp_path / "fit.zarr") as zs, xr.open_dataset(tmp_path / "fit.nc") as ds:
        assert list(zs["param_name"].values) == NAMES
        np.testing.assert_array_equal(zs["params"].values, ds["params"].values)
