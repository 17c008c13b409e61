"""The load stage: dims inference, every contract violation, content hashing, tile reads."""

from __future__ import annotations

import logging
import os
import shutil
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import xarray as xr

from gridsolve.schemas.artifacts import Tile
from gridsolve.schemas.errors import ContractError, InputError
from gridsolve.schemas.kinds.load import NetCDFLoad
from gridsolve.stages.load.blocks import read_block
from gridsolve.stages.load.dims import infer_dims
from gridsolve.stages.load.netcdf import fingerprint, locate, run

from testkit import Chain, make_ds


@pytest.mark.parametrize(
    ("dims", "roles", "config", "expected"),
    [
        (("time", "y", "x"), {}, {}, ("time", "y", "x")),
        (("time", "lat", "lon"), {}, {}, ("time", "lat", "lon")),
        (("lat", "lon", "band"), {}, {}, ("band", "lat", "lon")),
        (("row", "time", "col"), {}, {}, ("time", "row", "col")),
        # y and x by name: the one dim left is obs (elimination, not position)
        (("nlat", "nlon", "nt"), {}, {}, ("nt", "nlat", "nlon")),
        # CF attributes of coordinate variables (axis, standard_name, units)
        (("a", "b", "c"), {"c": "obs", "a": "y", "b": "x"}, {}, ("c", "a", "b")),
        (("a", "b", "c"), {"a": "obs"}, {}, ("a", "b", "c")),
        # the same with an obs-like name left over, once obs is configured
        (("time", "t2", "x"), {"t2": "obs"}, {"obs": "t2"}, ("t2", "time", "x")),
        # obs configured: the two dims left are y then x, in the variable's order
        (("nj", "ni", "nt"), {}, {"obs": "nt"}, ("nt", "nj", "ni")),
        (("ni", "nt", "nj"), {}, {"obs": "nt"}, ("nt", "ni", "nj")),
        # a vertical (CF axis Z) dim is a batch dim, never obs
        (("lev", "lat", "lon", "time"), {"lev": "z"}, {}, ("time", "lat", "lon")),
    ],
)
def test_infer_dims(
    dims: tuple[str, ...],
    roles: dict[str, str],
    config: dict[str, str],
    expected: tuple[str, str, str],
) -> None:
    obs, y, x, problems = infer_dims(
        dims, config.get("obs"), config.get("y"), config.get("x"), roles
    )
    assert problems == []
    assert (obs, y, x) == expected


@pytest.mark.parametrize(
    ("dims", "roles", "config", "hint"),
    [
        # no names, no coordinates: never (obs, y, x) by position
        (("nj", "ni", "nt"), {}, {}, "`obs_dim: nt`"),
        (("a", "b", "c"), {}, {}, "`obs_dim: c`"),
        # two obs-like names: never a choice between them
        (("time", "step", "lat", "lon"), {}, {}, "load.obs_dim"),
        # two CF time axes and no names
        (("t1", "t2", "lat", "lon"), {"t1": "obs", "t2": "obs"}, {}, "load.obs_dim"),
        # obs known, but three dims left for the map: never a guess
        (("nt", "member", "nj", "ni"), {}, {"obs": "nt"}, "`y_dim: nj` and `x_dim: ni`"),
        (("nt", "lev", "nj", "ni"), {"lev": "z"}, {}, "load.obs_dim"),
        # t2 is time by its units, but 'time' (no coordinate) would become the map's y
        (("time", "t2", "x"), {"t2": "obs"}, {}, "`obs_dim: t2` (or `obs_dim: time`)"),
    ],
)
def test_dims_that_cannot_be_told_are_refused_with_a_hint(
    dims: tuple[str, ...], roles: dict[str, str], config: dict[str, str], hint: str
) -> None:
    sizes = {d: 3 + i for i, d in enumerate(dims)}
    *found, problems = infer_dims(
        dims, config.get("obs"), config.get("y"), config.get("x"), roles, sizes
    )
    assert found == ["", "", ""]
    assert len(problems) == 1 and hint in problems[0], problems
    shape = ", ".join(f"{d}={n}" for d, n in sizes.items())
    assert f"the variable's dims are ({shape})" in problems[0]


def test_cf_attributes_of_coordinate_variables_name_the_dims(ctx: Any, write_cube: Any) -> None:
    """Coordinate variables that say what they are (CF 4) identify dims with any name."""
    ds = make_ds(n_obs=7, ny=4, nx=3, dims=("d0", "d1", "d2"), datetime_obs=False)
    ds = ds.transpose("d1", "d2", "d0")
    ds["d0"].attrs.update(units="days since 2000-01-01")
    ds["d1"].attrs.update(units="degrees_north")
    ds["d2"].attrs.update(standard_name="longitude")
    meta = run(NetCDFLoad(path=str(write_cube(ds, "cf.nc"))), {}, ctx).meta
    assert (meta["obs_dim"], meta["y_dim"], meta["x_dim"]) == ("d0", "d1", "d2")


def test_swath_without_coordinates_is_refused_then_runs_along_obs_dim(
    ctx: Any, write_cube: Any
) -> None:
    """(nj, ni, nt), no coordinate variables: never nj as obs; with obs_dim: nt, fits along nt."""
    rng = np.random.default_rng(1)
    data = rng.random((8, 6, 5))
    path = write_cube(xr.Dataset({"bt": (("nj", "ni", "nt"), data)}), "swath.nc")
    with pytest.raises(ContractError) as err:
        run(NetCDFLoad(path=str(path)), {}, ctx)
    assert "(nj=8, ni=6, nt=5)" in str(err.value) and "`obs_dim: nt`" in str(err.value)
    cfg = NetCDFLoad(path=str(path), obs_dim="nt")
    meta = {**run(cfg, {}, ctx).meta, "source": locate(cfg, ctx)}
    assert (meta["obs_dim"], meta["y_dim"], meta["x_dim"]) == ("nt", "nj", "ni")
    assert (meta["n_obs"], meta["ny"], meta["nx"]) == (5, 8, 6)
    block = read_block(meta, "cube", Tile(index=0, y0=0, y1=8, x0=0, x1=6))
    np.testing.assert_array_equal(block, data.transpose(2, 0, 1))


def test_configured_dim_that_does_not_exist_is_named_with_suggestion() -> None:
    *_, problems = infer_dims(("time", "y", "x"), "tme", None, "xx")
    assert len(problems) == 2
    assert "load.obs_dim 'tme'" in problems[0] and "Did you mean 'time'?" in problems[0]


def test_load_reads_coords_attrs_and_hash(ctx: Any, cube_path: Path) -> None:
    out = run(NetCDFLoad(path=str(cube_path)), {}, ctx)
    m = out.meta
    assert (m["obs_dim"], m["y_dim"], m["x_dim"]) == ("time", "y", "x")
    assert (m["n_obs"], m["ny"], m["nx"]) == (12, 6, 5)
    assert m["attrs"]["units"] == "K"
    assert np.issubdtype(out.arrays["obs"].dtype, np.datetime64)
    np.testing.assert_array_equal(out.arrays["y"], np.arange(6) * 10.0)
    assert len(m["content_hash"]) == 32


def test_content_hash_ignores_path_and_mtime_but_sees_one_value(
    ctx: Any, tmp_path: Path, cube_path: Path
) -> None:
    key = fingerprint(NetCDFLoad(path=str(cube_path)), ctx)["content"]
    copy = tmp_path / "elsewhere.nc"
    shutil.copy(cube_path, copy)
    os.utime(copy, (1_000_000, 1_000_000))
    assert fingerprint(NetCDFLoad(path=str(copy)), ctx)["content"] == key
    ds = make_ds()
    ds["signal"][3, 2, 1] += 1e-9
    changed = tmp_path / "changed.nc"
    ds.to_netcdf(changed)
    assert fingerprint(NetCDFLoad(path=str(changed)), ctx)["content"] != key


def test_tile_read_transposes_to_obs_y_x(ctx: Any, write_cube: Any) -> None:
    ds = make_ds(n_obs=7, ny=4, nx=3)
    path = write_cube(ds.transpose("y", "x", "time"), "yxt.nc")
    cfg = NetCDFLoad(path=str(path))
    meta = {**run(cfg, {}, ctx).meta, "source": locate(cfg, ctx)}  # as the runner opens it
    assert meta["dims"] == ["y", "x", "time"] and meta["obs_dim"] == "time"
    block = read_block(meta, "cube", Tile(index=0, y0=1, y1=3, x0=0, x1=2))
    np.testing.assert_array_equal(block, ds["signal"].values[:, 1:3, 0:2])


def test_tile_read_refuses_a_file_changed_after_hashing(ctx: Any, write_cube: Any) -> None:
    path = write_cube(make_ds(), "c.nc")
    cfg = NetCDFLoad(path=str(path))
    meta = {**run(cfg, {}, ctx).meta, "source": locate(cfg, ctx)}  # as the runner opens it
    make_ds(seed=5).to_netcdf(path)
    with pytest.raises(InputError, match="changed or vanished"):
        read_block(meta, "cube", Tile(index=0, y0=0, y1=1, x0=0, x1=1))


def test_missing_variable_has_did_you_mean(ctx: Any, cube_path: Path) -> None:
    with pytest.raises(ContractError) as err:
        run(NetCDFLoad(path=str(cube_path), variable="signl", weights="w"), {}, ctx)
    text = str(err.value)
    assert "'signl' is not in the file (variables: signal). Did you mean 'signal'?" in text
    assert "load.weights: variable 'w'" in text


def test_wrong_number_of_dims(ctx: Any, write_cube: Any) -> None:
    ds = make_ds().isel(x=0)
    path = write_cube(ds, "2d.nc")
    with pytest.raises(ContractError, match="must have at least 3 dims"):
        run(NetCDFLoad(path=str(path), variable="signal"), {}, ctx)


def test_non_numeric_variable(ctx: Any, write_cube: Any) -> None:
    ds = make_ds()
    ds["signal"] = ds["signal"].astype(str)
    path = write_cube(ds, "str.nc")
    with pytest.raises(ContractError, match="expected numbers"):
        run(NetCDFLoad(path=str(path), variable="signal"), {}, ctx)


def test_inf_is_refused_with_position(ctx: Any, write_cube: Any) -> None:
    ds = make_ds()
    ds["signal"][2, 3, 4] = np.inf
    ds["signal"][5, 0, 0] = -np.inf
    path = write_cube(ds, "inf.nc")
    with pytest.raises(ContractError) as err:
        run(NetCDFLoad(path=str(path)), {}, ctx)
    assert "2 infinite value(s) (first at time=2, y=3, x=4)" in str(err.value)
    assert "replace infinite" in str(err.value)


def test_all_nan_cube_is_refused(ctx: Any, write_cube: Any) -> None:
    ds = make_ds()
    ds["signal"][:] = np.nan
    path = write_cube(ds, "nan.nc")
    with pytest.raises(ContractError, match="entirely NaN"):
        run(NetCDFLoad(path=str(path)), {}, ctx)


def test_design_variable_with_wrong_rows(ctx: Any, write_cube: Any) -> None:
    ds = make_ds()
    ds["A"] = (("t2", "coef"), np.ones((5, 3)))
    path = write_cube(ds, "d.nc")
    with pytest.raises(ContractError, match=r"expected dims \(time, coef\) with 12 rows"):
        run(NetCDFLoad(path=str(path), variable="signal", design="A"), {}, ctx)


def test_negative_weights_are_refused(ctx: Any, write_cube: Any) -> None:
    ds = make_ds()
    ds["w"] = ("time", -np.ones(12))
    path = write_cube(ds, "w.nc")
    with pytest.raises(ContractError, match="must be finite and ≥ 0"):
        run(NetCDFLoad(path=str(path), variable="signal", weights="w"), {}, ctx)


def test_missing_file_not_netcdf_and_truncated(ctx: Any, tmp_path: Path, cube_path: Path) -> None:
    with pytest.raises(InputError, match="input file not found"):
        run(NetCDFLoad(path=str(tmp_path / "nope.nc")), {}, ctx)
    text = tmp_path / "notes.nc"
    text.write_text("hello, I am not NetCDF")
    with pytest.raises(InputError, match="is not NetCDF") as err:
        run(NetCDFLoad(path=str(text)), {}, ctx)
    assert "b'hello, I'" in str(err.value)
    cut = tmp_path / "cut.nc"
    cut.write_bytes(cube_path.read_bytes()[: cube_path.stat().st_size // 2])
    with pytest.raises(InputError, match="corrupt or truncated"):
        run(NetCDFLoad(path=str(cut)), {}, ctx)


@pytest.mark.parametrize(
    ("bad", "what"),
    [
        (np.datetime64("NaT"), "1 NaT value(s) (first at time=3)"),
        (np.nan, "1 non-finite (NaN or infinite) value(s) (first at time=3)"),
        (np.inf, "1 non-finite (NaN or infinite) value(s) (first at time=3)"),
    ],
)
def test_non_finite_obs_coordinate_is_refused(
    ctx: Any, write_cube: Any, bad: Any, what: str
) -> None:
    ds = make_ds(datetime_obs=isinstance(bad, np.datetime64))
    time = ds["time"].values.copy()
    time[3] = bad
    path = write_cube(ds.assign_coords(time=time), "badtime.nc")
    with pytest.raises(ContractError) as err:
        run(NetCDFLoad(path=str(path)), {}, ctx)
    text = str(err.value)
    assert f"obs coordinate 'time' holds {what}" in text
    assert "give every observation a finite 'time' value" in text


def _packed(ds: Any, sentinel: int, **valid: Any) -> Any:
    """``signal`` packed as int16 (scale 0.001, offset 2), ``sentinel`` stored at (3, 1, 2)."""
    raw = np.round((ds["signal"].values - 2.0) / 0.001).astype(np.int16)
    raw[3, 1, 2] = sentinel
    attrs = {"scale_factor": np.float32(0.001), "add_offset": np.float32(2.0), "units": "K"}
    return ds.assign(signal=(ds["signal"].dims, raw, {**attrs, **valid}))


def _netcdf4_masked(path: Path) -> np.ndarray:
    """The oracle: netCDF4's own auto-masking and scaling, masked values as NaN."""
    import netCDF4

    with netCDF4.Dataset(path) as nc, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "valid_range not used since it cannot be safely cast"
        return np.ma.filled(nc["signal"][:].astype(np.float64), np.nan)


@pytest.mark.parametrize(
    ("valid", "masked"),
    [
        ({"valid_min": np.int16(-32767)}, True),
        ({"valid_range": np.array([-32767, 32767], np.int16)}, True),
        ({"valid_max": np.int16(30000)}, False),  # the sentinel is below it: valid
    ],
)
def test_cf_valid_range_masks_packed_values(
    chain: Chain,
    write_cube: Any,
    caplog: pytest.LogCaptureFixture,
    valid: dict[str, Any],
    masked: bool,
) -> None:
    path = write_cube(_packed(make_ds(), -32768, **valid), "packed.nc")
    oracle = _netcdf4_masked(path)
    assert np.isnan(oracle[3, 1, 2]) == masked and np.isnan(oracle).sum() == int(masked)
    with caplog.at_level(logging.WARNING, logger="gridsolve.load"):
        chain.whole("load", NetCDFLoad(path=str(path)))
    assert "marks" not in caplog.text  # one value of 360 masked: below 1 %, not worth a word
    meta = chain.refs["load"].meta
    assert meta["nan_count"] == int(masked)  # the stats see the mask
    block = read_block(meta, "cube", Tile(index=0, y0=0, y1=6, x0=0, x1=5))
    np.testing.assert_array_equal(np.isnan(block), np.isnan(oracle))
    np.testing.assert_allclose(block, oracle, rtol=1e-6, equal_nan=True)


def _temperature(vr: np.ndarray) -> tuple[xr.Dataset, np.ndarray]:
    """Packed int16 temperature (°C, scale 0.01 float32, offset 20) with ``valid_range = vr``.

    Also the unpacked values, as float64.
    """
    rng = np.random.default_rng(4)
    celsius = 20 + 6 * rng.standard_normal((12, 6, 5))
    stored = np.round((celsius - 20) / 0.01).astype(np.int16)
    attrs = {"scale_factor": np.float32(0.01), "add_offset": np.float32(20.0), "valid_range": vr}
    ds = make_ds().assign(signal=(("time", "y", "x"), stored, attrs))
    return ds, stored * np.float64(np.float32(0.01)) + np.float64(np.float32(20.0))


def test_valid_range_of_the_unpacked_type_compares_unpacked_values(
    chain: Chain, write_cube: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """valid_range 15., 25. (float32, scale_factor's type) on int16 data: physical units."""
    ds, celsius = _temperature(np.array([15.0, 25.0], np.float32))
    path = write_cube(ds, "unpacked-range.nc")
    with caplog.at_level(logging.WARNING, logger="gridsolve.load"):
        chain.whole("load", NetCDFLoad(path=str(path)))
        meta = chain.refs["load"].meta
        for y0 in range(6):  # tile reads never repeat the warning
            block = read_block(meta, "cube", Tile(index=y0, y0=y0, y1=y0 + 1, x0=0, x1=5))
            outside = (celsius[:, y0 : y0 + 1] < 15) | (celsius[:, y0 : y0 + 1] > 25)
            np.testing.assert_array_equal(np.isnan(block), outside)
    outside = (celsius < 15) | (celsius > 25)
    assert meta["nan_count"] == int(outside.sum()) and 0.2 < outside.mean() < 0.5
    warned = [r.getMessage() for r in caplog.records if "marks" in r.getMessage()]
    assert len(warned) == 1, warned
    share = f"{100 * outside.mean():.1f}% of its values missing ({outside.sum()} of 360)"
    assert "valid_range = [15.0, 25.0] (float32)" in warned[0] and share in warned[0]
    assert "compared with the unpacked values" in warned[0]


def test_valid_range_of_another_type_compares_stored_values_and_says_so(
    chain: Chain, write_cube: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """float64 on int16 packed to float32: CF 8.1 is broken; CF 2.5.1 decides, aloud."""
    ds, celsius = _temperature(np.array([15.0, 25.0], np.float64))
    path = write_cube(ds, "odd-range.nc")
    stored = np.round((celsius - 20) / 0.01)
    with caplog.at_level(logging.WARNING, logger="gridsolve.load"):
        chain.whole("load", NetCDFLoad(path=str(path)))
    outside = (stored < 15) | (stored > 25)
    assert chain.refs["load"].meta["nan_count"] == int(outside.sum())
    warned = [r.getMessage() for r in caplog.records if "marks" in r.getMessage()]
    assert len(warned) == 1, warned
    assert "valid_range = [15.0, 25.0] (float64)" in warned[0]
    assert "neither the packed int16 nor the unpacked float32" in warned[0]


def test_odd_typed_valid_range_is_reported_even_when_it_masks_little(
    chain: Chain, write_cube: Any, caplog: pytest.LogCaptureFixture
) -> None:
    ds, _ = _temperature(np.array([-32000, 32000], np.int32))
    with caplog.at_level(logging.WARNING, logger="gridsolve.load"):
        chain.whole("load", NetCDFLoad(path=str(write_cube(ds, "i4-range.nc"))))
    assert "marks 0.0% of its values missing (0 of 360)" in caplog.text
    assert "neither the packed int16 nor the unpacked float32" in caplog.text


def test_content_hash_sees_masked_values(ctx: Any, write_cube: Any) -> None:
    def key(sentinel: int, **valid: Any) -> str:
        path = write_cube(_packed(make_ds(), sentinel, **valid), f"p{sentinel}{len(valid)}.nc")
        return str(fingerprint(NetCDFLoad(path=str(path)), ctx)["content"])

    vmin = {"valid_min": np.int16(-32766)}
    # two invalid stored values decode to the same content: missing
    assert key(-32768, **vmin) == key(-32767, **vmin)
    # without valid_min the sentinel is data, and different sentinels differ
    assert key(-32768) != key(-32768, **vmin) and key(-32768) != key(-32767)


def test_unpacked_integer_cube_with_valid_range(chain: Chain, write_cube: Any) -> None:
    ds = make_ds()
    raw = np.round(ds["signal"].values * 100).astype(np.int32)
    raw[0, 0, 0] = -999
    ds = ds.assign(signal=(ds["signal"].dims, raw, {"valid_range": np.array([0, 10_000], "i4")}))
    chain.whole("load", NetCDFLoad(path=str(write_cube(ds, "int.nc"))))
    block = read_block(chain.refs["load"].meta, "cube", Tile(index=0, y0=0, y1=2, x0=0, x1=2))
    assert block.dtype == np.float64 and np.isnan(block[0, 0, 0])
    np.testing.assert_array_equal(block[1:], raw[1:, :2, :2])


def test_all_zero_shared_weights_are_refused_clearly(ctx: Any, write_cube: Any) -> None:
    ds = make_ds()
    ds["w"] = ("time", np.zeros(12))
    path = write_cube(ds, "w0.nc")
    with pytest.raises(ContractError) as err:
        run(NetCDFLoad(path=str(path), variable="signal", weights="w"), {}, ctx)
    text = str(err.value)
    assert "weights 'w' are all zero: no observation has weight > 0" in text
    assert "check load.weights" in text and "float32" not in text


def test_bad_weights_fix_line_does_not_suggest_nan(ctx: Any, write_cube: Any) -> None:
    ds = make_ds()
    w = np.ones(12)
    w[2], w[5] = np.nan, -1.0
    ds["w"] = ("time", w)
    path = write_cube(ds, "wbad.nc")
    with pytest.raises(ContractError) as err:
        run(NetCDFLoad(path=str(path), variable="signal", weights="w"), {}, ctx)
    fix = next(line for line in str(err.value).splitlines() if line.strip().startswith("fix:"))
    assert "a weight of 0 drops its observation" in fix
    assert "by NaN" not in fix


def test_design_labels_are_part_of_the_content(ctx: Any, write_cube: Any) -> None:
    ds = make_ds()
    ds["A"] = (("time", "coef"), np.random.default_rng(1).standard_normal((12, 3)))

    def load(labels: list[str], name: str) -> tuple[str, Any]:
        path = write_cube(ds.assign_coords(coef=labels), name)
        cfg = NetCDFLoad(path=str(path), variable="signal", design="A")
        return str(fingerprint(cfg, ctx)["content"]), run(cfg, {}, ctx).meta["design_columns"]

    key_abc, cols_abc = load(["a", "b", "c"], "abc.nc")
    key_xyz, cols_xyz = load(["x", "y", "z"], "xyz.nc")
    assert (cols_abc, cols_xyz) == (["a", "b", "c"], ["x", "y", "z"])
    assert key_abc != key_xyz
    assert load(["a", "b", "c"], "abc-again.nc")[0] == key_abc


@pytest.mark.parametrize("units", ["months since 2000-01-01", "years since 1990-1-1"])
def test_calendar_time_units_are_named_not_called_corrupt(
    ctx: Any, write_cube: Any, units: str
) -> None:
    ds = make_ds(datetime_obs=False).assign_coords(time=np.arange(12.0))
    ds["time"].attrs.update(units=units)
    path = write_cube(ds, "months.nc")
    with pytest.raises(InputError) as err:
        run(NetCDFLoad(path=str(path)), {}, ctx)
    text = str(err.value)
    assert f"'time' is in {units!r} (calendar 'standard'), a unit of variable length" in text
    assert "rewrite 'time' in days since a date" in text
    assert "corrupt" not in text and "re-download" not in text


def test_months_in_the_360_day_calendar_are_read(ctx: Any, write_cube: Any) -> None:
    """cftime decodes months in the 360_day calendar (each month 30 days): those run."""
    ds = make_ds(datetime_obs=False).assign_coords(time=np.arange(12.0))
    ds["time"].attrs.update(units="months since 2000-01-01", calendar="360_day")
    meta = run(NetCDFLoad(path=str(write_cube(ds, "m360.nc"))), {}, ctx).meta
    assert meta["obs_dim"] == "time" and meta["n_obs"] == 12


def test_a_truncated_file_is_still_called_corrupt(ctx: Any, cube_path: Path) -> None:
    data = cube_path.read_bytes()
    cube_path.write_bytes(data[: len(data) // 2])
    with pytest.raises(InputError, match="corrupt or truncated"):
        run(NetCDFLoad(path=str(cube_path)), {}, ctx)


def test_unsigned_bytes_compare_their_valid_max_as_unsigned(chain: Chain, write_cube: Any) -> None:
    """_Unsigned int8: valid_max stored as int8 -56 means 200; 250 (stored -6) is masked."""
    ds = make_ds()
    stored = np.full(ds["signal"].shape, 100, np.uint8)
    stored[2, 1, 1] = 250
    attrs = {"_Unsigned": "true", "valid_max": np.int8(-56)}
    ds = ds.assign(signal=(ds["signal"].dims, stored.view(np.int8), attrs))
    chain.whole("load", NetCDFLoad(path=str(write_cube(ds, "u8.nc"))))
    meta = chain.refs["load"].meta
    block = read_block(meta, "cube", Tile(index=0, y0=0, y1=6, x0=0, x1=5))
    assert meta["nan_count"] == 1 and np.isnan(block[2, 1, 1])
    assert np.nansum(block) == 100 * (block.size - 1)


def _ranged(write_cube: Any, valid_range: list[float], name: str) -> NetCDFLoad:
    """The seeded cube written with ``signal``'s valid_range set, as a load config."""
    ds = make_ds()
    ds["signal"].attrs["valid_range"] = np.array(valid_range)
    return NetCDFLoad(path=str(write_cube(ds, name)))


def test_a_reversed_valid_range_is_refused_once(
    ctx: Any, write_cube: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """valid_range = 25, 15 would mask every value: one error naming it, no warning."""
    cfg = _ranged(write_cube, [25.0, 15.0], "reversed.nc")
    with caplog.at_level(logging.WARNING, logger="gridsolve.load"):
        # as a run does: the fingerprint, then the stage (each must refuse)
        for step in (lambda: fingerprint(cfg, ctx), lambda: run(cfg, {}, ctx)):
            with pytest.raises(ContractError) as err:
                step()
            text = str(err.value)
            assert (
                "variable 'signal': valid_range = [25.0, 15.0] (float64) puts its minimum" in text
            )
            assert "every value would be marked missing" in text and "ncatted" in text
    assert "marks" not in caplog.text


def test_a_range_that_masks_everything_warns_once_before_the_refusal(
    ctx: Any, write_cube: Any, caplog: pytest.LogCaptureFixture
) -> None:
    cfg = _ranged(write_cube, [1e6, 2e6], "masked.nc")
    with caplog.at_level(logging.WARNING, logger="gridsolve.load"):
        with pytest.raises(ContractError, match="entirely NaN"):
            fingerprint(cfg, ctx)
        with pytest.raises(ContractError, match="entirely NaN"):
            run(cfg, {}, ctx)  # the refusal is remembered: the file is not read again
    assert caplog.text.count("marks 100.0% of its values missing") == 1, caplog.text


def test_the_unsigned_bounds_are_said_as_read(
    chain: Chain, write_cube: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """_Unsigned int8 valid_max -56 (200 as unsigned): the warning says 200, not only -56."""
    ds = make_ds()
    stored = np.full(ds["signal"].shape, 250, np.uint8)
    stored[0] = 100
    attrs = {"_Unsigned": "true", "valid_max": np.int8(-56)}
    ds = ds.assign(signal=(ds["signal"].dims, stored.view(np.int8), attrs))
    with caplog.at_level(logging.WARNING, logger="gridsolve.load"):
        chain.whole("load", NetCDFLoad(path=str(write_cube(ds, "u8.nc"))))
    assert "valid_max = -56 (int8), read as unsigned (_Unsigned = true): max 200" in caplog.text


def test_a_reversed_range_on_a_variable_the_run_does_not_read_is_left_alone(
    ctx: Any, write_cube: Any, tmp_path: Path
) -> None:
    """A file set whose QC flag declares valid_range = 1, 0: the cube still loads."""
    for i in range(2):
        ds = make_ds(seed=i).isel(time=slice(6 * i, 6 * i + 6))
        ds["qc"] = (("time",), np.zeros(6, np.int8), {"valid_range": np.array([1, 0], "i1")})
        write_cube(ds, f"part-{i}.nc")
    paths = sorted(str(p) for p in tmp_path.rglob("part-*.nc"))
    meta = run(NetCDFLoad(path=paths, variable="signal"), {}, ctx).meta
    assert meta["n_obs"] == 12


def test_a_remembered_refusal_is_raised_afresh_each_time(ctx: Any, write_cube: Any) -> None:
    cfg = _ranged(write_cube, [25.0, 15.0], "reversed-again.nc")
    seen = []
    for _ in range(3):
        with pytest.raises(ContractError) as err:
            fingerprint(cfg, ctx)
        seen.append(err.value)
    assert len({id(e) for e in seen}) == 3  # no object shared between runs
    assert len({str(e) for e in seen}) == 1


def test_xarrays_warning_about_a_file_is_said_once_per_run_however_often_it_is_opened(
    tmp_path: Path, ctx: Any
) -> None:
    import warnings

    import netCDF4

    import gridsolve

    from testkit import run_plan

    path = tmp_path / "two-fills.nc"
    with netCDF4.Dataset(path, "w") as nc:
        for name, n in (("time", 12), ("lat", 6), ("lon", 8)):
            nc.createDimension(name, n)
        t = nc.createVariable("time", "f8", ("time",))
        t.units, t[:] = "days since 2000-01-01", np.arange(12) * 30.0
        z = nc.createVariable("zg", "i2", ("time", "lat", "lon"), fill_value=-32767)
        z.missing_value = np.int16(-32766)  # a second fill value: xarray warns
        z.scale_factor, z.units = 0.5, "m"
        z[:] = np.random.default_rng(0).normal(100, 5, (12, 6, 8))
    cfg = gridsolve.config(
        load={"path": str(path)},
        design={"impl": "polynomial", "degree": 1},
        write={"path": str(tmp_path / "out.nc")},
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run_plan(cfg.stage_configs(), ctx, tile_pixels=8)  # 6 tiles, each reads the file
    said = [w for w in caught if "multiple fill values" in str(w.message)]
    assert len(said) == 1, [str(w.message) for w in caught]


@pytest.mark.parametrize("n_obs", [1, 7, 50])
def test_gap_pattern_hashes_are_the_running_hash_they_define(n_obs: int) -> None:
    """``h = h·M + valid + 1`` per observation (mod 2⁶⁴), in blocks along any dim."""
    from gridsolve.stages.load.patterns import _MULT, _SEED, GridPatterns, pattern_hash

    rng = np.random.default_rng(n_obs)
    valid = rng.random((n_obs, 9, 4)) < 0.7
    want = np.full((9, 4), int(_SEED), dtype=object)
    for row in valid:
        want = (want * int(_MULT) + row.astype(int) + 1) % 2**64
    assert np.array_equal(pattern_hash(valid), want.astype(np.uint64))
    cube = np.where(valid, 1.0, np.nan)
    whole = GridPatterns(("t", "y", "x"), "t", {"t": n_obs, "y": 9, "x": 4})
    for start in range(0, n_obs, 3):  # streamed along the observations
        whole.update(cube[start : start + 3], start)
    assert np.array_equal(whole.h, want.astype(np.uint64))
    # a file whose first dim is y, streamed along it
    by_rows = GridPatterns(("y", "t", "x"), "t", {"t": n_obs, "y": 9, "x": 4})
    for start in range(0, 9, 4):
        by_rows.update(np.moveaxis(cube[:, start : start + 4], 1, 0), start)
    assert np.array_equal(by_rows.h, want.astype(np.uint64))
