"""gridsolve.fit and gridsolve.config: the Python API on xarray objects (gridsolve/api.py).

Numbers are checked against numpy's lstsq per pixel; "what the CLI writes" against the
flow's own output file of the equivalent config, run through the session's Prefect server.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import dask.array
import numpy as np
import pytest
import xarray as xr
import yaml

import gridsolve
from gridsolve.schemas.errors import ConfigError, GridsolveError, InputError

from testkit import make_ds

TREND = {"impl": "polynomial", "degree": 2}


def lstsq_per_pixel(
    A: np.ndarray, y: np.ndarray, w: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """numpy's (weighted) least squares at every pixel, over its finite observations."""
    n_coef = A.shape[1]
    coef = np.full((n_coef, *y.shape[1:]), np.nan)
    n_valid = np.zeros(y.shape[1:], dtype=int)
    for i in range(y.shape[1]):
        for j in range(y.shape[2]):
            ok = np.isfinite(y[:, i, j])
            sw = np.sqrt(w[ok, i, j]) if w is not None else np.ones(ok.sum())
            coef[:, i, j] = np.linalg.lstsq(A[ok] * sw[:, None], y[ok, i, j] * sw, rcond=None)[0]
            n_valid[i, j] = ok.sum()
    return coef, n_valid


def design_of(out: xr.Dataset) -> np.ndarray:
    return np.asarray(out["design"].transpose(..., "coef").values, dtype=np.float64)


def test_fit_of_a_dataarray_with_gaps_equals_numpy_at_every_pixel() -> None:
    ds = make_ds(n_obs=40, ny=9, nx=11, nan_fraction=0.2, seed=3)
    out = gridsolve.fit(ds["signal"], design=TREND, solve={"dtype": "float64"}, progress=False)
    y = ds["signal"].values
    coef, n_valid = lstsq_per_pixel(design_of(out), y)
    got = out["coefficients"].transpose("coef", "y", "x").values
    np.testing.assert_allclose(got, coef, rtol=1e-9, atol=1e-11)
    np.testing.assert_array_equal(out["n_valid"].values, n_valid)
    assert set(out["status"].values.ravel()) == {0}  # every pixel determined: ok
    # no model asked for, none run
    assert "prediction" not in out and "model_status" not in out
    assert out["y"].attrs == ds["y"].attrs and np.array_equal(out["x"], ds["x"])


def test_weights_given_as_a_dataarray_weight_each_observation() -> None:
    ds = make_ds(n_obs=30, ny=5, nx=6, nan_fraction=0.1, seed=4)
    rng = np.random.default_rng(4)
    w = xr.DataArray(rng.uniform(0.2, 3.0, ds["signal"].shape), dims=ds["signal"].dims)
    out = gridsolve.fit(
        ds["signal"], design=TREND, solve={"dtype": "float64"}, weights=w, progress=False
    )
    coef, _ = lstsq_per_pixel(design_of(out), ds["signal"].values, w.values)
    got = out["coefficients"].transpose("coef", "y", "x").values
    np.testing.assert_allclose(got, coef, rtol=1e-9, atol=1e-11)


def test_a_dask_backed_cube_gives_the_numbers_of_the_same_cube_in_memory(tmp_path: Path) -> None:
    ds = make_ds(n_obs=36, ny=16, nx=20, nan_fraction=0.15, seed=5, dtype="float32")
    lazy = ds.copy()
    lazy["signal"] = lazy["signal"].copy(data=dask.array.from_array(ds["signal"].values, (9, 8, 5)))
    assert lazy["signal"].chunks is not None
    eager = gridsolve.fit(ds, variable="signal", design=TREND, progress=False)
    chunked = gridsolve.fit(
        lazy, variable="signal", design=TREND, execution={"tile_pixels": 64}, progress=False
    )
    for name in ("coefficients", "residual_rms", "n_valid", "status"):
        np.testing.assert_array_equal(chunked[name].values, eager[name].values, err_msg=name)


@pytest.mark.slow  # a Prefect flow run beside the fit: ≥ 5 s
@pytest.mark.usefixtures("prefect_server")
def test_fit_returns_what_the_cli_writes_and_shares_its_cache(tmp_path: Path) -> None:
    from gridsolve.flows.pipeline import run_config
    from gridsolve.schemas.reading import load_config

    cube = tmp_path / "sst.nc"
    make_ds(n_obs=30, ny=12, nx=14, nan_fraction=0.2, seed=6, dtype="float32").to_netcdf(cube)
    cache = tmp_path / "cache"
    design = {"impl": "harmonic", "harmonics": 1}
    with xr.open_dataset(cube) as src:
        fitted = gridsolve.fit(src["signal"], design=design, cache=cache, progress=False)

    # the notebook's call as the file to schedule, read back as `gridsolve run` reads it
    yaml_file = tmp_path / "sst-trend.yaml"
    yaml_file.write_text(
        gridsolve.config(
            load={"impl": "netcdf", "path": str(cube), "variable": "signal"},
            design=design,
            write={"impl": "netcdf", "path": str(tmp_path / "out.nc")},
            cache={"root": str(cache)},
        ).to_yaml()
    )
    summary = run_config(load_config(yaml_file), yaml_file)
    cached = {r.stage: r.cache for r in summary.stages}
    # every stage the notebook ran is reused; the writer writes the CLI's own file
    assert all(v == "hit" for k, v in cached.items() if k != "write"), cached
    with xr.open_dataset(summary.output) as written:
        written_config = str(written.attrs["gridsolve_config"])
        assert set(fitted.variables) == set(written.variables)
        for name in written.variables:
            xr.testing.assert_identical(fitted[name], written[name])
        # what names the files (the config, its hash in the history line, the writer's key)
        provenance = {"gridsolve_config", "gridsolve_keys", "history"}
        for key in set(written.attrs) - provenance:
            assert fitted.attrs[key] == written.attrs[key], key
        stages = [
            h.split(" (config")[0] for h in (fitted.attrs["history"], written.attrs["history"])
        ]
        assert stages[0] == stages[1]
        ran, wrote = (json.loads(d.attrs["gridsolve_keys"]) for d in (fitted, written))
    assert {k: v for k, v in ran.items() if k != "write"} == {
        k: v for k, v in wrote.items() if k != "write"
    }
    said = json.loads(fitted.attrs["gridsolve_config"])
    assert said["load"]["path"] == gridsolve.api.IN_MEMORY_INPUT, said["load"]
    assert said["write"]["path"] == gridsolve.api.IN_MEMORY_OUTPUT, said["write"]
    # the scratch file was written uncompressed; the provenance keeps the user's default
    assert said["write"]["zlib"] is True and said["write"] == {
        **json.loads(written_config)["write"],
        "path": gridsolve.api.IN_MEMORY_OUTPUT,
    }


def test_a_config_built_in_a_notebook_is_the_yaml_file_to_schedule(tmp_path: Path) -> None:
    cfg = gridsolve.config(
        load={"impl": "netcdf", "path": "/data/sst.nc"},
        design={"impl": "harmonic", "harmonics": 2},
        solve={"uncertainty": "stderr"},
    )
    assert isinstance(cfg, gridsolve.Config)
    text = cfg.to_yaml()
    again = gridsolve.Config.model_validate(yaml.safe_load(text))
    assert again == cfg
    assert again.model.impl == "none"  # no model section: no model


def test_bad_arguments_raise_the_clis_one_message_and_leave_no_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    ds = make_ds()
    with pytest.raises(ConfigError) as bad:
        gridsolve.fit(ds["signal"], design={"impl": "polynomial", "degree": -1}, progress=False)
    assert "design.degree" in str(bad.value) and "fix:" in str(bad.value), str(bad.value)
    with pytest.raises(InputError, match="DataArray or Dataset"):
        gridsolve.fit(np.zeros((3, 4, 5)), design=TREND, progress=False)  # type: ignore[arg-type]
    with pytest.raises(GridsolveError) as dims:
        flat = xr.DataArray(np.ones((4, 5)), dims=("a", "b"), name="v")
        gridsolve.fit(flat, design=TREND, progress=False)
    assert "fix:" in str(dims.value), str(dims.value)
    assert list(tmp_path.iterdir()) == []  # the scratch folder is gone after each failure


def _script(body: str) -> str:
    head = [
        "import sys",
        f"sys.path.insert(0, {str(Path(__file__).parent)!r})",
        "import gridsolve",
        "from testkit import make_ds",
        "ds = make_ds(n_obs=20, ny=32, nx=32, nan_fraction=0.1)",
    ]
    return "\n".join([*head, body, ""])


def test_fit_imports_no_prefect_and_says_nothing_when_not_in_a_terminal() -> None:
    body = (
        "out = gridsolve.fit(ds['signal'], design={'impl': 'polynomial', 'degree': 1}, "
        "execution={'tile_pixels': 256})\n"
        "assert 'prefect' not in sys.modules, 'prefect imported'\n"
        "print('fitted', int(out['n_valid'].sum()))"
    )
    res = subprocess.run(
        [sys.executable, "-c", _script(body)], capture_output=True, text=True, timeout=300
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.startswith("fitted ") and res.stderr == "", res.stderr[-2000:]


def test_fit_shows_tile_progress_in_a_terminal(tmp_path: Path) -> None:
    body = (
        "gridsolve.fit(ds['signal'], design={'impl': 'polynomial', 'degree': 1}, "
        "execution={'tile_pixels': 256})"
    )
    script = tmp_path / "fit.py"
    script.write_text(_script(body))
    # util-linux's script(1) gives the child a pseudo-terminal, as a shell would have
    res = subprocess.run(
        ["script", "-qec", f"{sys.executable} {script}", "/dev/null"],
        capture_output=True,
        text=True,
        timeout=300,
        env={"TERM": "xterm", "COLUMNS": "100", "PATH": "/usr/bin:/bin"},
    )
    assert res.returncode == 0, res.stdout[-3000:]
    assert "solve tiles" in res.stdout and "100%" in res.stdout, res.stdout[-2000:]


def test_stage_arguments_may_be_configs_as_well_as_dicts() -> None:
    from gridsolve.schemas.kinds.design import PolynomialDesign
    from gridsolve.schemas.kinds.solve import LstsqSolve

    ds = make_ds(n_obs=16, ny=4, nx=5, seed=8)
    a = gridsolve.fit(
        ds["signal"], design=PolynomialDesign(degree=1), solve=LstsqSolve(), progress=False
    )
    b = gridsolve.fit(
        ds["signal"], design={"impl": "polynomial", "degree": 1}, solve={}, progress=False
    )
    xr.testing.assert_identical(a["coefficients"], b["coefficients"])


def _peak_of_a_lazy_fit(n_obs: int) -> tuple[int, int]:
    """(peak RSS after a small warm-up fit, peak after fitting a lazy n_obs × 500 × 1000 cube)."""
    body = "\n".join(
        [
            "import resource, dask.array as darr, numpy as np, pandas as pd, xarray as xr",
            "trend = {'impl': 'polynomial', 'degree': 1}",
            "gridsolve.fit(ds['signal'], design=trend, progress=False)",
            "def peak(): return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024",
            "warm = peak()",
            f"n = {n_obs}",
            "rng = darr.random.default_rng(0)",
            "data = rng.standard_normal((n, 500, 1000), chunks=(n, 2500 // n, 1000))",
            "cube = xr.DataArray(data.astype('float32'), dims=('time', 'y', 'x'), name='v',",
            "    coords={'time': pd.date_range('2000-01-01', periods=n, freq='MS'),",
            "            'y': np.arange(500.0), 'x': np.arange(1000.0)})",
            "out = gridsolve.fit(cube, design=trend, execution={'memory_budget': '64MiB'},",
            "                    progress=False)",
            "assert int(out['n_valid'].min()) == n",
            "print(warm, peak())",
        ]
    )
    res = subprocess.run(
        [sys.executable, "-c", _script(body)], capture_output=True, text=True, timeout=600
    )
    assert res.returncode == 0, res.stderr[-3000:]
    warm, peak = (int(v) for v in res.stdout.split())
    return warm, peak


@pytest.mark.slow  # writes and fits a 191-MiB and a 763-MiB cube, each in its own process
def test_a_dask_cube_larger_than_the_memory_budget_runs_in_flat_memory() -> None:
    # Cubes made chunk by chunk by dask (20-MB chunks), never whole, fitted with a 64-MiB
    # budget. Flat: four times the observations on the same grid leave the peak where it
    # was (the load stage's 64-MiB read blocks and their temporaries, the per-pixel
    # outputs), far below the larger cube's size.
    mib = 2**20
    warm_small, small = _peak_of_a_lazy_fit(100)
    warm_large, large = _peak_of_a_lazy_fit(400)
    said = f"peak above warm-up: {(small - warm_small) / mib:.0f} MiB for a 191-MiB cube, "
    said += f"{(large - warm_large) / mib:.0f} MiB for a 763-MiB cube"
    assert (large - warm_large) - (small - warm_small) < 32 * mib, said
    assert large - warm_large < 763 * mib / 2, said
