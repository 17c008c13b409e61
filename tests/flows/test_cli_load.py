"""The load stage's edges through the command: dims never guessed, masking said aloud, file sets.

Real subprocesses of `gridsolve run` / `gridsolve validate` on real NetCDF files.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import xarray as xr
import yaml

from tests.flows.test_cli import assert_clean_failure, gridsolve


def _config(tmp_path: Path, load: dict[str, Any], name: str = "gridsolve.yaml") -> Path:
    raw = {
        "load": load,
        "design": {"impl": "polynomial", "degree": 1},
        "model": {"input_dim": 2, "hidden_dim": 1},
        "write": {"path": "out.nc"},
        "cache": {"root": "cache"},
    }
    p = tmp_path / name
    p.write_text(yaml.safe_dump(raw))
    return p


def _swath(tmp_path: Path) -> tuple[Path, np.ndarray]:
    """``bt (nj, ni, nt)`` without coordinate variables: a line in nt at every pixel, plus noise."""
    rng = np.random.default_rng(3)
    t = np.arange(9.0)
    slope = rng.normal(size=(7, 5))
    data = 2.0 + slope[:, :, None] * t + 0.01 * rng.standard_normal((7, 5, 9))
    path = tmp_path / "swath.nc"
    xr.Dataset({"bt": (("nj", "ni", "nt"), data)}).to_netcdf(path)
    return path, data


def test_validate_refuses_dims_it_cannot_identify(tmp_path: Path) -> None:
    path, _ = _swath(tmp_path)
    res = gridsolve("validate", str(_config(tmp_path, {"path": str(path)})))
    assert_clean_failure(res, "(nj=7, ni=5, nt=9)", "`obs_dim: nt`")
    assert "config is valid" not in res.stdout
    ok = gridsolve("validate", str(_config(tmp_path, {"path": str(path), "obs_dim": "nt"})))
    assert ok.returncode == 0, ok.stderr
    assert "config is valid" in ok.stdout


@pytest.mark.slow  # ≥ 5 s beside a CPU hog: in CI, not in the fast tier
@pytest.mark.server
@pytest.mark.usefixtures("prefect_server")
def test_run_refuses_dims_it_cannot_identify_and_fits_along_obs_dim(tmp_path: Path) -> None:
    path, data = _swath(tmp_path)
    res = gridsolve("run", str(_config(tmp_path, {"path": str(path)})))
    assert_clean_failure(res, "cannot tell which dim is the observation dim", "`obs_dim: nt`")
    assert not (tmp_path / "out.nc").exists()
    ok = gridsolve("run", str(_config(tmp_path, {"path": str(path), "obs_dim": "nt"})))
    assert ok.returncode == 0, ok.stderr[-3000:]
    with xr.open_dataset(tmp_path / "out.nc") as out:
        coef = out["coefficients"].transpose("coef", "nj", "ni").values
        design = out["design"].values
    assert design.shape == (9, 2) and coef.shape == (2, 7, 5)
    # every pixel's series along nt, fitted with the design actually used
    want = np.linalg.lstsq(design, data.reshape(35, 9).T, rcond=None)[0].reshape(2, 7, 5)
    np.testing.assert_allclose(coef, want, rtol=1e-4, atol=1e-4)


@pytest.mark.slow  # ≥ 5 s beside a CPU hog: in CI, not in the fast tier
@pytest.mark.server
@pytest.mark.usefixtures("prefect_server")
def test_run_says_what_a_valid_range_masked_once(tmp_path: Path) -> None:
    """valid_range 15., 25. (float32) on packed int16 °C: physical units, and said aloud once."""
    rng = np.random.default_rng(5)
    celsius = 20 + 6 * rng.standard_normal((10, 6, 8))
    stored = np.round((celsius - 20) / 0.01).astype(np.int16)
    attrs = {
        "scale_factor": np.float32(0.01),
        "add_offset": np.float32(20.0),
        "valid_range": np.array([15.0, 25.0], np.float32),
    }
    path = tmp_path / "sst.nc"
    xr.Dataset(
        {"sst": (("time", "lat", "lon"), stored, attrs)}, coords={"time": np.arange(10.0)}
    ).to_netcdf(path)
    unpacked = stored * np.float64(np.float32(0.01)) + np.float64(np.float32(20.0))
    outside = (unpacked < 15) | (unpacked > 25)
    cfg = _config(tmp_path, {"path": str(path), "obs_dim": "time"})
    res = gridsolve("run", str(cfg), "--set", "execution.memory_budget=64KiB")
    assert res.returncode == 0, res.stderr[-3000:]
    text = res.stdout + res.stderr
    share = f"marks {100 * outside.mean():.1f}% of its values missing ({outside.sum()} of 480)"
    assert text.count(share) == 1, text[-3000:]
    assert "valid_range = [15.0, 25.0] (float32)" in text
    with xr.open_dataset(tmp_path / "out.nc") as out:
        n_valid = out["n_valid"].transpose("lat", "lon").values
    np.testing.assert_array_equal(n_valid, (~outside).sum(axis=0))


def test_validate_names_months_since_instead_of_calling_the_file_corrupt(tmp_path: Path) -> None:
    ds = xr.Dataset(
        {"sst": (("time", "lat", "lon"), np.zeros((6, 2, 3)))},
        coords={"time": ("time", np.arange(6), {"units": "months since 1981-01-01"})},
    )
    path = tmp_path / "monthly.nc"
    ds.to_netcdf(path)
    res = gridsolve("validate", str(_config(tmp_path, {"path": str(path)})))
    assert_clean_failure(
        res, "'time' is in 'months since 1981-01-01'", "a unit of variable length", "days since"
    )
    assert "re-download" not in res.stderr


@pytest.mark.slow  # ≥ 5 s beside a CPU hog: in CI, not in the fast tier
@pytest.mark.server
@pytest.mark.usefixtures("prefect_server")
def test_run_combines_interleaved_files_in_time_order(tmp_path: Path) -> None:
    """Odd months in one file, even months in the other, given as a list: one series."""
    rng = np.random.default_rng(6)
    time = np.array([f"2001-{m:02d}-15" for m in range(1, 13)], dtype="datetime64[ns]")
    data = 10 + 0.1 * np.arange(12)[:, None, None] + rng.normal(size=(12, 3, 4))
    ds = xr.Dataset(
        {"sst": (("time", "lat", "lon"), data)},
        coords={"time": time, "lat": [0.0, 1.0, 2.0], "lon": [0.0, 1.0, 2.0, 3.0]},
    )
    odd, even = tmp_path / "odd.nc", tmp_path / "even.nc"
    ds.isel(time=slice(0, None, 2)).to_netcdf(odd)
    ds.isel(time=slice(1, None, 2)).to_netcdf(even)
    res = gridsolve("run", str(_config(tmp_path, {"path": [str(even), str(odd)]})))
    assert res.returncode == 0, res.stderr[-3000:]
    with xr.open_dataset(tmp_path / "out.nc") as out:
        np.testing.assert_array_equal(out["time"].values, time)
        coef = out["coefficients"].transpose("coef", "lat", "lon").values
        design = out["design"].values
    want = np.linalg.lstsq(design, data.reshape(12, 12), rcond=None)[0].reshape(2, 3, 4)
    np.testing.assert_allclose(coef, want, rtol=1e-4, atol=1e-4)
