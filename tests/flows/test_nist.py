"""NIST StRD linear regressions through ``gridsolve run``, on every solve path.

Each dataset (tests/nist_strd.py: data and certified values from NIST's pages)
is written as a cube whose every pixel holds NIST's response, with the design
as a variable (``design: variable``), and ``K`` extra observations of weight 0
(so every pixel's valid rows are exactly NIST's). Which of the extra rows a
pixel has decides its path: all of them, the shared operator; none (32 pixels,
a gap pattern common in the grid), the pattern's operator; a subset of its own,
the per-pixel normal equations. Every path must reach Householder QR's float64
accuracy within one digit (LRE, capped at 15) for the coefficients, the
standard errors and R², with every pixel ``ok``.
"""

from __future__ import annotations

from pathlib import Path

import nist_strd
import numpy as np
import pytest
import xarray as xr

from gridsolve.schemas.contracts import STATUS_CODES

from testkit import run_yaml

K = 6  # extra rows of weight 0
NY, NX = 6, 8  # 8 shared pixels, 32 pattern pixels, 8 per-pixel pixels

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("prefect_server")]


def qr_lre(ds: nist_strd.Dataset) -> tuple[float, float, float]:
    """Householder QR's (float64) LRE of the coefficients, the standard errors and R².

    R² as NIST certifies it: about the mean with an intercept, about 0 without.
    """
    A, y = ds.design(), ds.response()
    Q, R = np.linalg.qr(A)
    c = np.linalg.solve(R, Q.T @ y)
    r = y - A @ c
    Ri = np.linalg.inv(R)
    se = np.sqrt(r @ r / (len(y) - A.shape[1]) * (Ri * Ri).sum(axis=1))
    about = y - y.mean() if ds.intercept else y
    r2 = 1.0 - (r @ r) / (about @ about)
    return (
        float(nist_strd.lre(c, ds.beta).min()),
        float(nist_strd.lre(se, ds.sd).min()),
        float(nist_strd.lre(r2, ds.r2)),
    )


def cube(ds: nist_strd.Dataset) -> tuple[xr.Dataset, np.ndarray]:
    """The cube (obs + K, NY, NX) and each pixel's path: 0 shared, 1 pattern, 2 per-pixel."""
    A, y = ds.design(), ds.response()
    n = len(y)
    A = np.vstack([A, np.repeat(A[:1], K, axis=0)])
    data = np.repeat(np.append(y, np.full(K, 7.0))[:, None], NY * NX, axis=1)
    path = np.zeros(NY * NX, dtype=int)
    path[8:40] = 1
    path[40:] = 2
    data[n:, path == 1] = np.nan  # no extra row: one common gap pattern
    for i, p in enumerate(np.flatnonzero(path == 2)):
        data[n + (i % K), p] = np.nan  # a gap of its own
        data[n + ((i + 1) % K), p] = np.nan if i >= K else data[n + ((i + 1) % K), p]
    weights = np.append(np.ones(n), np.zeros(K))
    out = xr.Dataset(
        {
            "signal": (("time", "y", "x"), data.reshape(-1, NY, NX)),
            "A": (("time", "coef"), A),
            "w": (("time",), weights),
        },
        coords={
            "time": np.arange(n + K, dtype=float),
            "y": np.arange(NY) * 1.0,
            "x": np.arange(NX) * 1.0,
        },
    )
    return out, path.reshape(NY, NX)


@pytest.mark.parametrize("ds", nist_strd.DATASETS, ids=lambda d: d.name)
def test_nist_certified_values_on_every_path(ds: nist_strd.Dataset, tmp_path: Path) -> None:
    data, path = cube(ds)
    data.to_netcdf(tmp_path / "cube.nc")
    coef = ds.design().shape[1]
    raw = {
        "load": {
            "path": str(tmp_path / "cube.nc"),
            "variable": "signal",
            "design": "A",
            "weights": "w",
        },
        "design": {"impl": "variable"},
        "solve": {"dtype": "float64", "uncertainty": "stderr"},
        "model": {"input_dim": coef, "hidden_dim": 1},
        "write": {"path": "out.nc"},
        "cache": {"root": "cache"},
    }
    res = run_yaml(tmp_path / "run.yaml", raw)
    assert res.returncode == 0, res.stderr[-3000:]
    with xr.open_dataset(tmp_path / "out.nc") as out:
        status = out["status"].values
        C = out["coefficients"].values
        se = out["coef_stderr"].values
        r2 = out["r2"].values
    assert (status == STATUS_CODES["ok"]).all(), np.unique(status)
    q_coef, q_se, q_r2 = qr_lre(ds)
    beta = np.array(ds.beta)[:, None, None]
    sd = np.array(ds.sd)[:, None, None]
    for p, name in enumerate(("shared", "pattern", "per-pixel")):
        on = path == p
        got_c = float(nist_strd.lre(C[:, on], beta[:, :, 0]).min())
        got_se = float(nist_strd.lre(se[:, on], sd[:, :, 0]).min())
        got_r2 = float(nist_strd.lre(r2[on], ds.r2).min())
        assert got_c >= q_coef - 1, (name, "coef", got_c, q_coef)
        assert got_se >= q_se - 1, (name, "stderr", got_se, q_se)
        assert got_r2 >= q_r2 - 1, (name, "r2", got_r2, q_r2)
