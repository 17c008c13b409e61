"""Seeded demo cubes: a seasonal signal with a trend and noise at every pixel.

``seed`` is the original problem's size (50 observations on a 500×500 grid,
float32); ``small`` is the same on 64×64. The same arguments always give the
same bytes, so the demo's cache keys are stable across machines.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from gridsolve.stages.engine.paths import atomic_file

if TYPE_CHECKING:  # imported to make the cube: finding its path needs neither
    import xarray as xr

SIZES: dict[str, tuple[int, int, int]] = {
    "small": (50, 64, 64),
    "seed": (50, 500, 500),
}


def make_cube(
    n_obs: int,
    ny: int,
    nx: int,
    *,
    seed: int = 0,
    nan_fraction: float = 0.0,
    dtype: str = "float32",
) -> xr.Dataset:
    """A dataset with ``signal (time, y, x)`` and a training target ``seasonal_range (y, x)``.

    ``nan_fraction`` of the signal's values are set to NaN. ``seasonal_range``
    is the peak-to-trough range of each pixel's seasonal cycle (twice its
    amplitude) with a little noise: what the training example teaches the
    model to predict from the fitted coefficients.
    """
    import pandas as pd
    import xarray as xr

    rng = np.random.default_rng(seed)
    time = pd.date_range("2020-01-01", periods=n_obs, freq="7D")
    t = np.linspace(-1.0, 1.0, n_obs, dtype=np.float64)
    phase = 2 * np.pi * np.arange(n_obs) * 7.0 / 365.25
    yy = np.linspace(0.0, 1.0, ny)[:, None]
    xx = np.linspace(0.0, 1.0, nx)[None, :]
    mean = 10.0 + 5.0 * yy + 2.0 * xx
    amp = 3.0 + 2.0 * np.sin(3 * yy) * np.cos(2 * xx)
    trend = 0.5 * (xx - yy)
    data = (
        mean[None]
        + trend[None] * t[:, None, None]
        + amp[None] * np.cos(phase)[:, None, None]
        + 0.3 * rng.standard_normal((n_obs, ny, nx))
    ).astype(dtype)
    if nan_fraction > 0:
        data[rng.random(data.shape) < nan_fraction] = np.nan
    seasonal_range = (2.0 * amp + 0.05 * rng.standard_normal((ny, nx))).astype(dtype)
    return xr.Dataset(
        {
            "signal": (
                ("time", "y", "x"),
                data,
                {"long_name": "synthetic seasonal signal", "units": "1"},
            ),
            "seasonal_range": (
                ("y", "x"),
                seasonal_range,
                {"long_name": "peak-to-trough range of the seasonal cycle", "units": "1"},
            ),
        },
        coords={
            "time": ("time", time),
            "y": ("y", np.arange(ny, dtype=np.float64), {"long_name": "row", "units": "1"}),
            "x": ("x", np.arange(nx, dtype=np.float64), {"long_name": "column", "units": "1"}),
        },
        attrs={
            "title": "gridsolve demo cube",
            "source": f"gridsolve.stages.load.demo.make_cube(seed={seed})",
        },
    )


def write_atomic(ds: xr.Dataset, path: Path) -> Path:
    """Write ``ds`` to ``path`` as NetCDF, atomically."""
    with atomic_file(path) as tmp:
        ds.to_netcdf(tmp, engine="netcdf4")
    return path


def demo_file(root: Path, size: str, seed: int, nan_fraction: float) -> Path:
    """Path of the demo cube under ``root/demo``, written first if absent."""
    n_obs, ny, nx = SIZES[size]
    path = Path(root) / "demo" / f"demo-{size}-s{seed}-nan{nan_fraction:g}.nc"
    if not path.exists():
        write_atomic(make_cube(n_obs, ny, nx, seed=seed, nan_fraction=nan_fraction), path)
    return path
