"""Whether a pixel's valid rows determine its coefficients is said in ``status``.

Through the CLI on real NetCDF files (issue 27, item 2): a pixel with one valid
observation, a cube of one time step, and more coefficients than observations
with standard errors. Where the valid rows do not determine a coefficient, the
status is ``underdetermined`` and nothing derived from that coefficient is
finite; the other pixels are ``ok`` and equal numpy's lstsq.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import xarray as xr

from gridsolve.schemas.contracts import STATUS_CODES

from testkit import make_ds, run_yaml

UNDERDETERMINED = STATUS_CODES["underdetermined"]
OK = STATUS_CODES["ok"]


pytestmark = pytest.mark.usefixtures("prefect_server")


def run(
    tmp_path: Path, ds: xr.Dataset, design: dict[str, Any], coef: int = 2, **solve: Any
) -> xr.Dataset:
    """``gridsolve run`` of ``ds`` (variable ``signal``) with ``design``; the output, loaded."""
    cube = tmp_path / "cube.nc"
    ds.to_netcdf(cube)
    load: dict[str, Any] = {"path": str(cube), "variable": "signal"}
    if design["impl"] == "variable":
        load["design"] = "A"
    raw = {
        "load": load,
        "design": design,
        "solve": {"dtype": "float64", "uncertainty": "stderr", **solve},
        "model": {"input_dim": coef, "hidden_dim": 1},
        "write": {"path": "out.nc"},
        "cache": {"root": "cache"},
    }
    res = run_yaml(tmp_path / "gridsolve.yaml", raw)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "underdetermined" in res.stdout  # the run summary counts them
    with xr.open_dataset(tmp_path / "out.nc") as out:
        return out.load()


def assert_nothing_derived_is_finite(out: xr.Dataset, undetermined: np.ndarray) -> None:
    """No stderr, t or p of an undetermined coefficient is finite (mask: (coef, y, x))."""
    for name in ("coef_stderr", "t_value", "p_value"):
        assert not np.isfinite(out[name].values[undetermined]).any(), name


@pytest.mark.slow  # ≥ 5 s beside a CPU hog: in CI, not in the fast tier
def test_one_valid_observation_is_underdetermined_and_its_trend_nan(tmp_path: Path) -> None:
    ds = make_ds(n_obs=12, ny=2, nx=3, seed=1)
    ds["signal"][1:, 0, 0] = np.nan  # pixel (0, 0): one valid observation for [1, t]
    out = run(tmp_path, ds, {"impl": "polynomial", "degree": 1})
    status = out["status"].values
    assert status[0, 0] == UNDERDETERMINED
    assert not np.isfinite(out["trend"].values[0, 0])
    assert_nothing_derived_is_finite(out, np.ones((2, 2, 3), bool) & (status == UNDERDETERMINED))
    # the others: ok, and the least-squares fit
    A = out["design"].values
    B = ds["signal"].values.reshape(12, -1)
    C = out["coefficients"].values.reshape(2, -1)
    for p in range(1, 6):
        assert status.ravel()[p] == OK
        want = np.linalg.lstsq(A, B[:, p], rcond=None)[0]
        np.testing.assert_allclose(C[:, p], want, rtol=1e-10)
    assert np.isfinite(out["trend"].values.ravel()[1:]).all()


@pytest.mark.slow  # ≥ 5 s beside a CPU hog: in CI, not in the fast tier
def test_a_single_time_step_determines_no_trend(tmp_path: Path) -> None:
    ds = make_ds(n_obs=1, ny=2, nx=3, seed=2)
    out = run(tmp_path, ds, {"impl": "polynomial", "degree": 1})
    assert (out["status"].values == UNDERDETERMINED).all()
    assert not np.isfinite(out["trend"].values).any()
    assert not np.isfinite(out["coef_stderr"].values[1]).any()
    assert not np.isfinite(out["p_value"].values[1]).any()


@pytest.mark.slow  # ≥ 5 s beside a CPU hog: in CI, not in the fast tier
def test_more_coefficients_than_observations_with_stderr(tmp_path: Path) -> None:
    ds = make_ds(n_obs=6, ny=2, nx=3, seed=3)
    A = np.random.default_rng(3).standard_normal((6, 8))
    ds["A"] = (("time", "coef"), A)
    out = run(tmp_path, ds, {"impl": "variable"}, coef=8)
    assert (out["status"].values == UNDERDETERMINED).all()
    assert_nothing_derived_is_finite(out, np.ones((8, 2, 3), bool))
    # the minimum-norm coefficients stay (the policy's), as lstsq gives them
    want = np.linalg.lstsq(A, ds["signal"].values.reshape(6, -1), rcond=None)[0]
    np.testing.assert_allclose(out["coefficients"].values.reshape(8, -1), want, rtol=1e-9)
