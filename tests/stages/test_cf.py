"""The output as the field's tools read it: CF conventions, encodings kept, CDO/NCO, the checkers.

The tool tests run the real programs: IOOS ``compliance-checker`` and ``cfchecks``
(Python, the ``test`` extra; cfchecks needs Debian ``libudunits2-0``) and CDO and
NCO (Debian ``cdo``, ``nco``; ``.ci/run`` installs them). A missing tool fails the
test in CI and skips it, saying why, elsewhere.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import netCDF4
import numpy as np
import pandas as pd
import pytest
import xarray as xr

from gridsolve.schemas.kinds.design import HarmonicDesign, PolynomialDesign
from gridsolve.schemas.kinds.load import NetCDFLoad
from gridsolve.schemas.kinds.model import MultidimLinearModel
from gridsolve.schemas.kinds.normal_equations import SVDNormalEquations
from gridsolve.schemas.kinds.solve import LstsqSolve
from gridsolve.schemas.kinds.write import NetCDFWrite
from gridsolve.stages.engine.outputs import per_unit

from testkit import Chain

BIN = Path(sys.executable).parent
INPUT_HISTORY = "2024-01-01: made by the gridsolve tests"


# ---------------------------------------------------------------- a realistic CF input
def cf_input(
    path: Path,
    n_obs: int = 24,
    ny: int = 6,
    nx: int = 8,
    *,
    calendar: str = "gregorian",
    units: str = "days since 1800-1-1 00:00:00",
    time: np.ndarray | None = None,
) -> Path:
    """SST anomalies as CF files have them: lat/lon with bounds, float64 gregorian time."""
    rng = np.random.default_rng(0)
    with netCDF4.Dataset(path, "w", format="NETCDF4") as nc:
        nc.Conventions = "CF-1.8"
        nc.title = "sea surface temperature anomalies"
        nc.history = INPUT_HISTORY
        for dim, n in (("time", None), ("lat", ny), ("lon", nx), ("nv", 2)):
            nc.createDimension(dim, n)
        if time is None:
            time = 58804.0 + 30.4375 * np.arange(n_obs)  # mid-month, 1961 on
        lat = (np.arange(ny) * 2.0 - 5).astype("f4")
        lon = (np.arange(nx) * 2.0 + 1).astype("f4")
        for name, dtype, values, attrs in (
            (
                "time",
                "f8",
                time,
                {
                    "units": units,
                    "calendar": calendar,
                    "long_name": "Time",
                    "standard_name": "time",
                    "axis": "T",
                },
            ),
            (
                "lat",
                "f4",
                lat,
                {
                    "units": "degrees_north",
                    "long_name": "Latitude",
                    "standard_name": "latitude",
                    "axis": "Y",
                },
            ),
            (
                "lon",
                "f4",
                lon,
                {
                    "units": "degrees_east",
                    "long_name": "Longitude",
                    "standard_name": "longitude",
                    "axis": "X",
                },
            ),
        ):
            v = nc.createVariable(name, dtype, (name,))
            v.setncatts({**attrs, "bounds": f"{name}_bnds"})
            v[:] = values
            half = 15.0 if name == "time" else 1.0
            b = nc.createVariable(f"{name}_bnds", dtype, (name, "nv"))
            b[:] = np.stack([values - half, values + half], axis=1)
        sst = nc.createVariable("sst", "f4", ("time", "lat", "lon"), fill_value=np.float32(-1e30))
        sst.setncatts(
            {
                "units": "K",
                "long_name": "sea surface temperature",
                "standard_name": "sea_surface_temperature",
            }
        )
        k = np.arange(n_obs)[:, None, None]
        data = 0.01 * k + np.sin(2 * np.pi * k / 12) + 0.1 * rng.standard_normal((n_obs, ny, nx))
        data[:, 0, 0] = np.nan  # a land pixel
        sst[:] = np.ma.masked_invalid(data.astype("f4"))
    return path


def run_chain(
    chain: Chain, path: Path, out: Path, design: Any = None, solve: Any = None, **write: Any
) -> Path:
    """Every stage on ``path``, the output written to ``out``."""
    chain.whole("load", NetCDFLoad(path=str(path)))
    chain.whole("design", design or HarmonicDesign(trend=True, harmonics=1))
    chain.whole("normal_equations", SVDNormalEquations())
    chain.tiled("solve", solve or LstsqSolve())
    chain.tiled("model", MultidimLinearModel(input_dim=2, hidden_dim=2, output_dim=3))
    chain.whole("write", NetCDFWrite(path=str(out), **write))
    return out


@pytest.fixture
def cf_in(tmp_path: Path) -> Path:
    return cf_input(tmp_path / "sst.nc")


@pytest.fixture
def nested(chain: Chain, cf_in: Path, tmp_path: Path) -> Path:
    return run_chain(chain, cf_in, tmp_path / "nested.nc")


@pytest.fixture
def flat(chain: Chain, cf_in: Path, tmp_path: Path) -> Path:
    return run_chain(chain, cf_in, tmp_path / "flat.nc", layout="flat")


# ---------------------------------------------------------------- encodings and metadata
def test_obs_encoding_bounds_and_coordinate_attrs_round_trip(cf_in: Path, nested: Path) -> None:
    with netCDF4.Dataset(cf_in) as src, netCDF4.Dataset(nested) as out:
        t_in, t_out = src.variables["time"], out.variables["time"]
        assert t_out.dtype == t_in.dtype == np.float64
        assert (t_out.units, t_out.calendar) == (t_in.units, t_in.calendar)
        np.testing.assert_array_equal(t_out[:], t_in[:])
        for name in ("time", "lat", "lon"):
            v = out.variables[name]
            assert "_FillValue" not in v.ncattrs(), name  # CF 2.5.1
            for att in src.variables[name].ncattrs():
                assert v.getncattr(att) == src.variables[name].getncattr(att), (name, att)
            bounds = out.variables[f"{name}_bnds"]
            assert bounds.dimensions == (name, "nv") and "_FillValue" not in bounds.ncattrs()
            np.testing.assert_array_equal(bounds[:], src.variables[f"{name}_bnds"][:])
        assert out.Conventions == "CF-1.8"
        lines = out.history.splitlines()
        assert lines[0] == INPUT_HISTORY and lines[-1].startswith("gridsolve ")
        assert "design/harmonic" in lines[-1] and "config xxh3 " in lines[-1]
    a, b = xr.open_dataset(cf_in), xr.open_dataset(nested)
    np.testing.assert_array_equal(a["time"].values, b["time"].values)


def test_coef_is_numeric_with_a_char_label_variable(nested: Path) -> None:
    with netCDF4.Dataset(nested) as nc:
        assert nc.variables["coef"].dtype == np.int32
        assert list(nc.variables["coef"][:]) == [0, 1, 2, 3]
        label = nc.variables["coef_name"]
        assert label.dtype == np.dtype("S1") and label.dimensions == ("coef", "coef_name_strlen")
        assert nc.variables["coefficients"].coordinates == "coef_name"
    with xr.open_dataset(nested) as ds:
        assert list(ds["coef_name"].values) == ["1", "t", "cos1", "sin1"]
        assert "coef_name" in ds.coords


def test_units_of_coefficients_trend_and_outputs(nested: Path) -> None:
    with xr.open_dataset(nested) as ds:
        # Harmonic columns are pure numbers (t scaled to [-1, 1], cos, sin): data units.
        assert ds["coefficients"].attrs["units"] == "K"
        assert ds["design"].attrs["units"] == "1"
        assert ds["trend"].attrs["units"] == "K day-1"
        scale = ds["design"].attrs["t_scale"]
        expected = (ds["coefficients"].sel(coef=1).values.astype(np.float64) / scale).astype(
            np.float32
        )
        np.testing.assert_array_equal(ds["trend"].values, expected)
        # The fit recovers the input's 0.01 K per step of 30.4375 days.
        assert abs(float(ds["trend"].median()) - 0.01 / 30.4375) < 1e-4
        assert ds["residual_rms"].attrs["units"] == "K"
        for name in ("prediction", "grad_weight", "grad_bias", "n_valid"):
            assert ds[name].attrs["units"] == "1", name
        for name in ("status", "model_status"):
            assert "units" not in ds[name].attrs  # flags carry none


def test_raw_polynomial_gives_per_column_units(chain: Chain, cf_in: Path, tmp_path: Path) -> None:
    out = run_chain(
        chain,
        cf_in,
        tmp_path / "poly.nc",
        design=PolynomialDesign(degree=3, scale=False),
        solve=LstsqSolve(dtype="float64"),  # raw days since 1970: badly conditioned
    )
    with xr.open_dataset(out) as ds:
        assert "units" not in ds["coefficients"].attrs  # one per column instead
        assert list(ds["coef_units"].values) == ["K", "K day-1", "K day-2", "K day-3"]
        assert ds["trend"].attrs["units"] == "K day-1"
        np.testing.assert_array_equal(ds["trend"].values, ds["coefficients"].sel(coef=1).values)


def test_per_unit() -> None:
    assert per_unit("K", "1") == "K"
    assert per_unit("K", "day") == "K day-1"
    assert per_unit("K", "day2") == "K day-2"
    assert per_unit("1", "s") == "s-1"
    assert per_unit("m/s", "day") == "(m/s) day-1"
    assert per_unit("K", "m s-1") == "K (m s-1)-1"
    assert per_unit(None, "day") is None and per_unit("K", None) is None
    assert per_unit("days since 2000-01-01", "day") is None


def test_flat_layout_holds_the_nested_values(nested: Path, flat: Path) -> None:
    a, b = xr.open_dataset(nested), xr.open_dataset(flat)
    assert b["grad_weight"].dims == ("grad_weight_index", "lat", "lon")
    n = a["grad_weight"].shape
    np.testing.assert_array_equal(
        b["grad_weight"].values, a["grad_weight"].values.reshape(-1, *n[-2:])
    )
    labels = list(b["grad_weight_label"].values)
    assert labels[0] == "input_dim=0 hidden_dim=0 output=0" and len(labels) == np.prod(n[:-2])
    for name in a.data_vars:
        if name != "grad_weight":
            np.testing.assert_array_equal(a[name].values, b[name].values, err_msg=name)
    for v in b.data_vars.values():
        if {"lat", "lon"} <= set(v.dims):  # per pixel: at most one more dim
            assert len(v.dims) <= 3, v.name


# ---------------------------------------------------------------- the real tools
def tool(name: str) -> str:
    """Path of ``name`` (the venv's bin first); fails in CI and skips elsewhere when missing."""
    found = str(BIN / name) if (BIN / name).exists() else shutil.which(name)
    if found is None:
        how = (
            f"{name} is not installed "
            "(.ci/run installs it: Debian cdo, nco, libudunits2-0; pip install -e '.[test]')"
        )
        if os.environ.get("CI"):
            pytest.fail(how)
        pytest.skip(how)
    return found


def run(*cmd: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)


def compliance_errors(path: Path, tmp_path: Path) -> tuple[set[str], str]:
    """The IOOS checker's cf:1.8 "Errors" (high-priority failures), and its console text."""
    report = tmp_path / f"{path.stem}.cc.json"
    res = run(
        tool("compliance-checker"),
        "--test=cf:1.8",
        "-f",
        "json",
        "-o",
        str(report),
        str(path),
    )
    assert report.exists(), res.stdout + res.stderr
    got = json.loads(report.read_text())["cf:1.8"]
    errors = {f"{r['name']}: {m}" for r in got["high_priorities"] for m in r["msgs"]}
    return errors, res.stdout + res.stderr


def cfchecks_errors(path: Path, tmp_path: Path) -> tuple[set[str], str]:
    """cfchecks' ERROR lines (CF 1.8, local tables: nothing is downloaded), and its output."""
    exe = tool("cfchecks")
    import compliance_checker

    names = Path(compliance_checker.__file__).parent / "data" / "cf-standard-name-table.xml"
    tables = {}
    for kind, root in (("area", "area_type_table"), ("region", "standardized_region_list")):
        tables[kind] = tmp_path / f"{kind}.xml"
        tables[kind].write_text(
            f'<?xml version="1.0"?><{root}><version_number>local</version_number>'
            f'<date>local</date><entry id="sea"/><entry id="global"/></{root}>'
        )
    res = run(
        exe,
        "-v",
        "1.8",
        "-s",
        str(names),
        "-a",
        str(tables["area"]),
        "-r",
        str(tables["region"]),
        str(path),
    )
    text = res.stdout + res.stderr
    if "UDUNITS" in text and "udunits2" in text:
        msg = f"cfchecks cannot load libudunits2 (Debian libudunits2-0): {text[-300:]}"
        if os.environ.get("CI"):
            pytest.fail(msg)
        pytest.skip(msg)
    assert "ERRORS detected" in text, text  # it ran to the end
    # Locations differ between files; the message names the variable only in the block header.
    return {line.strip() for line in text.splitlines() if line.startswith("ERROR")}, text


@pytest.mark.parametrize("layout", ["nested", "flat"])
def test_compliance_checker_finds_no_new_errors(
    request: pytest.FixtureRequest, cf_in: Path, tmp_path: Path, layout: str
) -> None:
    out = request.getfixturevalue(layout)
    before, _ = compliance_errors(cf_in, tmp_path)
    after, text = compliance_errors(out, tmp_path)
    assert after - before == set(), text
    assert "exceptions occurred" not in text, text


@pytest.mark.parametrize("layout", ["nested", "flat"])
def test_cfchecks_finds_no_new_errors(
    request: pytest.FixtureRequest, cf_in: Path, tmp_path: Path, layout: str
) -> None:
    out = request.getfixturevalue(layout)
    before, _ = cfchecks_errors(cf_in, tmp_path)
    after, text = cfchecks_errors(out, tmp_path)
    assert after - before == set(), text
    assert "Traceback" not in text, text


def test_cdo_reads_every_per_pixel_variable_of_the_flat_layout(flat: Path) -> None:
    cdo = tool("cdo")
    names = {
        str(n) for n, v in xr.open_dataset(flat).data_vars.items() if {"lat", "lon"} <= set(v.dims)
    }
    for op in ("sinfo", "infon"):
        res = run(cdo, op, str(flat))
        text = res.stdout + res.stderr
        assert res.returncode == 0, text
        assert not [ln for ln in text.splitlines() if "Error" in ln], text
    listed = run(cdo, "showname", str(flat)).stdout.split()
    assert names <= set(listed), (names, listed)


@pytest.mark.parametrize("layout", ["nested", "flat"])
def test_ncks_reads_both_layouts(request: pytest.FixtureRequest, layout: str) -> None:
    out = request.getfixturevalue(layout)
    res = run(tool("ncks"), "-m", str(out))
    assert res.returncode == 0, res.stderr
    assert "coefficients" in res.stdout and "coef_name" in res.stdout


# ---------------------------------------------------------------- calendars numpy cannot hold
CALENDARS = [
    # (calendar, units, stored times, days per stored unit, days in a year)
    ("noleap", "days since 1600-01-01", 15.5 + 365 / 12 * np.arange(24), 1.0, 365.0),
    ("360_day", "hours since 2000-01-01", 24 * (15.0 + 30 * np.arange(24)), 1 / 24, 360.0),
    ("gregorian", "days since 1500-1-1", 15.0 + 30.4375 * np.arange(24), 1.0, 365.25),
]


@pytest.mark.parametrize(("calendar", "units", "stored", "per_day", "year"), CALENDARS)
def test_times_in_other_calendars_round_trip_and_feed_the_design(
    chain: Chain,
    tmp_path: Path,
    calendar: str,
    units: str,
    stored: np.ndarray,
    per_day: float,
    year: float,
) -> None:
    src = cf_input(tmp_path / "in.nc", calendar=calendar, units=units, time=stored)
    out = run_chain(chain, src, tmp_path / "out.nc")
    with netCDF4.Dataset(src) as a, netCDF4.Dataset(out) as b:
        ta, tb = a["time"], b["time"]
        assert tb.dtype == ta.dtype and tb.units == ta.units and tb.calendar == ta.calendar
        np.testing.assert_array_equal(tb[:], ta[:])
        np.testing.assert_array_equal(b["time_bnds"][:], a["time_bnds"][:])
        design = b["design"][:]
        trend_units = b["trend"].units
    # the harmonic design from the stored numbers, independently: days, centred, one year
    days = stored * per_day
    centre, half = (days.min() + days.max()) / 2, (days.max() - days.min()) / 2
    w = 2 * np.pi * (days - centre) / year
    expected = np.stack([np.ones_like(days), (days - centre) / half, np.cos(w), np.sin(w)], 1)
    np.testing.assert_allclose(design, expected, rtol=1e-12, atol=1e-12)
    assert trend_units == "K day-1"
    with xr.open_dataset(src, use_cftime=True) as a, xr.open_dataset(out, use_cftime=True) as b:
        assert list(b["time"].values) == list(a["time"].values)  # the same dates


def test_a_time_in_months_is_refused_for_generated_designs(chain: Chain, tmp_path: Path) -> None:
    from gridsolve.schemas.errors import ContractError

    src = cf_input(
        tmp_path / "in.nc",
        calendar="360_day",
        units="months since 2000-01-01",
        time=np.arange(24.0),
    )
    with pytest.raises(ContractError, match="months and years have no fixed length"):
        run_chain(chain, src, tmp_path / "out.nc")


def test_compliance_checker_finds_no_new_errors_in_a_noleap_file(
    chain: Chain, tmp_path: Path
) -> None:
    calendar, units, stored, _, _ = CALENDARS[0]
    src = cf_input(tmp_path / "in.nc", calendar=calendar, units=units, time=stored)
    out = run_chain(chain, src, tmp_path / "out.nc")
    before, _ = compliance_errors(src, tmp_path)
    after, text = compliance_errors(out, tmp_path)
    assert after - before == set(), text


def test_harmonic_amplitude_and_peak_time(nested: Path) -> None:
    # the input's seasonal part is sin(2πk/12) on a monthly axis: amplitude 1 K, peak at month 3
    with xr.open_dataset(nested, decode_times=False) as ds:
        amp = ds["amplitude"].sel(harmonic=1).values
        peak = ds["peak_offset"].sel(harmonic=1).values
        coef = ds["coefficients"].values
        design = ds["design"].values
        names = [str(n) for n in ds["coef_name"].values]
        centre, period = ds["design"].attrs["t_centre"], ds["design"].attrs["period"]
        time = ds["time"].values
        assert ds["amplitude"].attrs["units"] == "K" and ds["peak_offset"].attrs["units"] == "day"
        assert list(ds["harmonic"].values) == [1]
    # the design's axis is days since 1970-01-01 (t_units); the file's, days since 1800-1-1
    assert ds["design"].attrs["t_units"] == "days since 1970-01-01"
    time = time - (np.datetime64("1970-01-01") - np.datetime64("1800-01-01")).astype(int)
    ok = np.isfinite(amp)
    np.testing.assert_allclose(amp[ok], 1.0, atol=0.15)
    expected_peak = np.mod(time[3] - centre, period)
    gap = np.abs(np.mod(peak[ok] - expected_peak + period / 2, period) - period / 2)
    assert gap.max() < 10.0, gap.max()  # days
    # A cos(w - φ) is the fitted c cos w + s sin w at every observation
    c, s = coef[names.index("cos1")], coef[names.index("sin1")]
    fitted = (
        design[:, names.index("cos1"), None, None] * c
        + design[:, names.index("sin1"), None, None] * s
    )
    w = 2 * np.pi * (time - centre) / period
    phi = 2 * np.pi * peak / period
    again = amp[None] * np.cos(w[:, None, None] - phi[None])
    np.testing.assert_allclose(again[:, ok], fitted[:, ok], atol=1e-4)


def curvilinear_levels(path: Path) -> Path:
    """A CF cube on a rotated (curvilinear) grid with 2-D lat/lon and three pressure levels."""
    rng = np.random.default_rng(5)
    t = pd.date_range("2000-01-01", periods=24, freq="MS")
    yy, xx = np.meshgrid(np.arange(6.0), np.arange(7.0), indexing="ij")
    xr.Dataset(
        {
            "zg": (
                ("time", "plev", "rlat", "rlon"),
                rng.normal(5500, 5, (24, 3, 6, 7)).astype("f4"),
                {"units": "m", "standard_name": "geopotential_height", "coordinates": "lat lon"},
            )
        },
        coords={
            "time": ("time", t, {"standard_name": "time", "axis": "T"}),
            "plev": (
                "plev",
                [85000.0, 50000.0, 25000.0],
                {"units": "Pa", "standard_name": "air_pressure", "positive": "down", "axis": "Z"},
            ),
            "rlat": ("rlat", yy[:, 0], {"standard_name": "grid_latitude", "units": "degrees"}),
            "rlon": ("rlon", xx[0], {"standard_name": "grid_longitude", "units": "degrees"}),
            "lat": (
                ("rlat", "rlon"),
                40 + 0.5 * yy + 0.1 * xx,
                {"standard_name": "latitude", "units": "degrees_north"},
            ),
            "lon": (
                ("rlat", "rlon"),
                -10 + 0.5 * xx - 0.1 * yy,
                {"standard_name": "longitude", "units": "degrees_east"},
            ),
        },
        attrs={"Conventions": "CF-1.8"},
    ).to_netcdf(path)
    return path


def test_a_selected_level_and_2d_lat_lon_are_carried_to_the_output(
    chain: Chain, tmp_path: Path
) -> None:
    src = curvilinear_levels(tmp_path / "zg.nc")
    chain.whole("load", NetCDFLoad(path=str(src), select={"plev": 50000}))
    chain.whole("design", PolynomialDesign(degree=1))
    chain.whole("normal_equations", SVDNormalEquations())
    chain.tiled("solve", LstsqSolve())
    out = tmp_path / "out.nc"
    chain.whole("write", NetCDFWrite(path=str(out)))
    with xr.open_dataset(out) as ds, xr.open_dataset(src) as inp:
        assert float(ds["plev"]) == 50000.0 and ds["plev"].ndim == 0
        assert ds["plev"].attrs["standard_name"] == "air_pressure"
        for name in ("lat", "lon"):
            np.testing.assert_array_equal(ds[name].values, inp[name].values)
            assert ds[name].dims == ("rlat", "rlon")
            assert ds[name].attrs == inp[name].attrs
        for name in ("coefficients", "trend", "status"):
            coords = ds[name].encoding.get("coordinates", "").split()
            assert {"lat", "lon", "plev"} <= set(coords), (name, coords)
    before, _ = cfchecks_errors(src, tmp_path)
    after, text = cfchecks_errors(out, tmp_path)
    assert after - before == set(), text
    before_cc, _ = compliance_errors(src, tmp_path)
    after_cc, text_cc = compliance_errors(out, tmp_path)
    assert after_cc - before_cc == set(), text_cc


NAMES = ["base", "amp", "up_rate", "sos", "down_rate", "eos"]
NONLINEAR = {
    "impl": "curvefit",
    "target": "my_curves:season",
    "params": NAMES,
    "p0": dict(zip(NAMES, [0.2, 0.5, 0.08, 120.0, 0.07, 275.0], strict=True)),
}


@pytest.mark.slow
def test_cf_checkers_find_no_errors_in_a_nonlinear_fit(tmp_path: Path) -> None:
    import gridsolve as api

    from testkit import ndvi_cube

    cube = ndvi_cube(3, 4)
    src = tmp_path / "ndvi.nc"
    cube.to_dataset().to_netcdf(src)
    out = tmp_path / "fit.nc"
    cfg = api.config(
        load={"path": str(src), "variable": "ndvi"},
        solve={**NONLINEAR, "covariance": True},
        write={"path": str(out)},
        cache={"root": str(tmp_path / "cache")},
    )
    from gridsolve.stages.engine.context import StageContext
    from gridsolve.stages.engine.plan import build_plan, run_locally
    from gridsolve.stages.engine.store import open_store

    ctx = StageContext(store=open_store(cfg.cache.root))
    run_locally(build_plan(cfg.stage_configs()), ctx)
    before, _ = compliance_errors(src, tmp_path)
    after, text = compliance_errors(out, tmp_path)
    assert after - before == set(), text
    cf_before, _ = cfchecks_errors(src, tmp_path)
    cf_after, cf_text = cfchecks_errors(out, tmp_path)
    assert cf_after - cf_before == set(), cf_text
