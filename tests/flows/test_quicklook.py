"""The quick-look picture: maps of the output, and the trend where it is significant."""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

import numpy as np
import xarray as xr

from gridsolve.flows.quicklook import quicklook_png, significant_trend
from gridsolve.schemas.kinds.design import PolynomialDesign
from gridsolve.schemas.kinds.load import NetCDFLoad
from gridsolve.schemas.kinds.model import MultidimLinearModel
from gridsolve.schemas.kinds.normal_equations import SVDNormalEquations
from gridsolve.schemas.kinds.solve import LstsqSolve
from gridsolve.schemas.kinds.write import NetCDFWrite

from testkit import Chain, make_ds


def output(chain: Chain, write_cube: Any, tmp_path: Path, uncertainty: str) -> Path:
    ds = make_ds(n_obs=40, ny=8, nx=9, seed=2)
    # noise everywhere, a trend in the right half only: significant there, mostly not elsewhere
    rng = np.random.default_rng(5)
    ramp = np.linspace(0, 2, 40)[:, None, None] * (np.arange(9)[None, None, :] >= 5)
    ds["signal"][:] = 2.0 + 0.1 * rng.standard_normal((40, 8, 9)) + ramp
    chain.whole("load", NetCDFLoad(path=str(write_cube(ds))))
    chain.whole("design", PolynomialDesign(degree=1))
    chain.whole("normal_equations", SVDNormalEquations())
    chain.tiled("solve", LstsqSolve(uncertainty=uncertainty, dtype="float64"))
    chain.tiled("model", MultidimLinearModel(input_dim=1, hidden_dim=2, output_dim=1))
    out = tmp_path / f"out-{uncertainty}.nc"
    chain.whole("write", NetCDFWrite(path=str(out)))
    return out


def png_width(png: bytes) -> int:
    assert png.startswith(b"\x89PNG")
    return int(struct.unpack(">I", png[16:20])[0])


def test_significance_mask_is_the_trend_where_its_p_value_is_below_5_percent(
    chain: Chain, write_cube: Any, tmp_path: Path
) -> None:
    out = output(chain, write_cube, tmp_path, "stderr")
    with xr.open_dataset(out) as ds:
        got = significant_trend(ds)
        names = [str(n) for n in ds["coef_name"].values]
        p = ds["p_value"].isel(coef=names.index(ds["trend"].attrs["coefficient"])).values
        trend = ds["trend"].values
    assert got is not None
    shown, fraction = got
    significant = p < 0.05
    assert 0 < significant.sum() < significant.size  # both kinds of pixel present
    np.testing.assert_array_equal(np.isfinite(shown), significant)
    np.testing.assert_array_equal(shown[significant], trend[significant])
    assert fraction == significant.mean()
    assert significant[:, 5:].all()  # the pixels with the added trend
    assert png_width(quicklook_png(out)) > png_width(quicklook_png(plain(tmp_path)))


def plain(tmp_path: Path) -> Path:
    """An output without p-values: two panels only."""
    path = tmp_path / "plain.nc"
    xr.Dataset(
        {
            "coefficients": (("coef", "y", "x"), np.ones((2, 4, 4))),
            "residual_rms": (("y", "x"), np.ones((4, 4))),
        }
    ).to_netcdf(path)
    return path


def test_no_mask_without_p_values(chain: Chain, write_cube: Any, tmp_path: Path) -> None:
    out = output(chain, write_cube, tmp_path, "none")
    with xr.open_dataset(out) as ds:
        assert "trend" in ds and significant_trend(ds) is None
