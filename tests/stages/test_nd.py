"""N-D cubes in the load stage: batch dims fitted like pixels, ``load.isel`` / ``load.select``.

Every number is checked against an independent oracle computed here from the
cube written to disk (``numpy.linalg.lstsq`` per series on its valid rows,
``xarray``'s ``polyfit``/``polyval``, the closed-form MSE gradient), never
against another gridsolve run alone.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
import xarray as xr

from gridsolve.schemas.errors import ContractError
from gridsolve.schemas.kinds.load import NetCDFLoad
from gridsolve.schemas.metadata import LoadMeta
from gridsolve.schemas.pipeline import build_config
from gridsolve.stages.engine.agreement import disagreements
from gridsolve.stages.engine.tiles import plan_tiles
from gridsolve.stages.load.netcdf import run as load_run

from testkit import run_plan

N_T, N_M, N_Y, N_X = 24, 3, 5, 7
MEMBERS = np.array([10, 20, 30])
MEMBER_ATTRS = {"long_name": "ensemble member", "units": "1"}
#: series forced gap-free (member, lat, lon) and the one left all-missing
GAP_FREE = [(0, 1, 1), (1, 2, 3), (2, 4, 6), (2, 0, 5)]
ALL_MISSING = (1, 0, 0)
DEGREE = 1


# ---------------------------------------------------------------- cubes
def cube4(seed: int = 0, nan_fraction: float = 0.1) -> xr.Dataset:
    """A seeded ``sig (time, member, lat, lon)``: line + curvature + noise, ~10% gaps."""
    rng = np.random.default_rng(seed)
    t = np.linspace(-1, 1, N_T)[:, None, None, None]
    shape = (1, N_M, N_Y, N_X)
    data = (
        rng.normal(size=shape)
        + rng.normal(size=shape) * t
        + 0.5 * rng.normal(size=shape) * t**2
        + 0.2 * rng.standard_normal((N_T, N_M, N_Y, N_X))
        + 5.0 * np.arange(N_M)[None, :, None, None]  # members clearly apart
    )
    data[rng.random(data.shape) < nan_fraction] = np.nan
    for m, y, x in GAP_FREE:
        data[:, m, y, x] = np.nan_to_num(data[:, m, y, x], nan=1.5)
    data[:, ALL_MISSING[0], ALL_MISSING[1], ALL_MISSING[2]] = np.nan
    return xr.Dataset(
        {"sig": (("time", "member", "lat", "lon"), data, {"units": "K", "long_name": "signal"})},
        coords={
            "time": ("time", pd.date_range("2020-01-01", periods=N_T, freq="D")),
            "member": ("member", MEMBERS, MEMBER_ATTRS),
            "lat": ("lat", np.arange(N_Y) * 1.5, {"units": "degrees_north"}),
            "lon": ("lon", np.arange(N_X) * 2.0, {"units": "degrees_east"}),
        },
    )


def cube5(pressures: list[int], seed: int = 0) -> xr.Dataset:
    """``sig (time, pressure, member, lat, lon)``: level 0 is :func:`cube4`, others differ."""
    base = cube4(seed)
    levels = [
        base["sig"] + 100.0 * i + (0 if i == 0 else cube4(seed + i)["sig"])
        for i in range(len(pressures))
    ]
    sig = xr.concat(levels, dim="pressure").transpose("time", "pressure", "member", "lat", "lon")
    sig = sig.assign_coords(pressure=("pressure", np.asarray(pressures), {"units": "hPa"}))
    sig.attrs = {"units": "K", "long_name": "signal"}
    return xr.Dataset({"sig": sig})


def write(ds: xr.Dataset, tmp_path: Path, name: str = "cube.nc") -> Path:
    path = tmp_path / name
    ds.to_netcdf(path)
    return path


def pipeline(
    ctx: Any,
    tmp_path: Path,
    cube: Path,
    *,
    load: Mapping[str, Any] | None = None,
    model: Mapping[str, Any] | None = None,
    train: Mapping[str, Any] | None = None,
    design: Mapping[str, Any] | None = None,
    solve: Mapping[str, Any] | None = None,
    write_extra: Mapping[str, Any] | None = None,
    tile_pixels: int | None = None,
    name: str = "out.nc",
) -> xr.Dataset:
    """Run the whole pipeline in-process (the flow's plan, no Prefect); the output, loaded."""
    out = tmp_path / name
    sections: dict[str, Any] = {
        "load": {"path": str(cube), "variable": "sig", **(load or {})},
        "design": dict(design or {"impl": "polynomial", "degree": DEGREE}),
        "solve": {"dtype": "float64", **(solve or {})},
        "model": {"input_dim": 2, "hidden_dim": 1, "output_dim": 1, **(model or {})},
        "write": {"path": str(out), **(write_extra or {})},
        "cache": {"root": str(tmp_path / "cache")},
    }
    if train is not None:
        sections["train"] = dict(train)
    run_plan(build_config(sections).stage_configs(), ctx, tile_pixels=tile_pixels)
    with xr.open_dataset(out) as ds:
        return ds.load()


# ---------------------------------------------------------------- oracles
def design_oracle(n: int) -> np.ndarray:
    """Polynomial degree 1 on evenly spaced obs scaled to [-1, 1] (stages/design/builtin.py)."""
    t = np.linspace(-1.0, 1.0, n)
    return np.stack([t**k for k in range(DEGREE + 1)], axis=1)


def lstsq_oracle(
    A: np.ndarray, b: np.ndarray, w: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Per-series weighted least squares on valid rows: (coef (k, *batch), n_valid (*batch)).

    ``b`` and ``w`` are (obs, *batch); a row is valid where b is finite and w > 0.
    """
    n_obs, k = A.shape
    batch = b.shape[1:]
    B = b.reshape(n_obs, -1)
    W = np.ones_like(B) if w is None else w.reshape(n_obs, -1)
    coef = np.full((k, B.shape[1]), np.nan)
    n_valid = np.zeros(B.shape[1], dtype=int)
    for j in range(B.shape[1]):
        m = np.isfinite(B[:, j]) & (W[:, j] > 0)
        n_valid[j] = int(m.sum())
        if n_valid[j] >= k:
            sw = np.sqrt(W[m, j])
            coef[:, j] = np.linalg.lstsq(A[m] * sw[:, None], B[m, j] * sw, rcond=None)[0]
    return coef.reshape(k, *batch), n_valid.reshape(batch)


def check_against_lstsq(
    out: xr.Dataset, sub: xr.DataArray, dims: tuple[str, ...], w: np.ndarray | None = None
) -> None:
    """``out``'s coefficients and n_valid equal the oracle on ``sub`` (obs first, then ``dims``)."""
    A = np.asarray(out["design"].values, dtype=np.float64)
    np.testing.assert_allclose(A, design_oracle(sub.sizes["time"]), rtol=0, atol=1e-12)
    b = sub.transpose("time", *dims).values
    coef, n_valid = lstsq_oracle(A, b, w)
    got = out["coefficients"].transpose("coef", *dims).values
    np.testing.assert_allclose(got, coef, rtol=1e-9, atol=1e-9, equal_nan=True)
    np.testing.assert_array_equal(out["n_valid"].transpose(*dims).values, n_valid)


# ---------------------------------------------------------------- 1. a 4-D cube
@pytest.fixture
def out4(ctx: Any, tmp_path: Path) -> xr.Dataset:
    return pipeline(ctx, tmp_path, write(cube4(), tmp_path))


def test_4d_coefficients_match_lstsq_per_series(out4: xr.Dataset) -> None:
    check_against_lstsq(out4, cube4()["sig"], ("member", "lat", "lon"))


def test_4d_outputs_keep_the_batch_dim_its_coord_and_attrs(out4: xr.Dataset) -> None:
    batch = ("member", "lat", "lon")
    assert out4["coefficients"].dims == ("coef", *batch)
    assert out4["prediction"].dims == ("output", *batch)
    assert out4["grad_bias"].dims == ("output", *batch)
    assert out4["grad_weight"].dims[-3:] == batch
    for name in ("status", "residual_rms", "n_valid", "model_status"):
        assert out4[name].dims == batch, name
    assert out4["design"].dims == ("time", "coef")
    np.testing.assert_array_equal(out4["member"].values, MEMBERS)
    assert out4["member"].attrs == MEMBER_ATTRS
    np.testing.assert_array_equal(out4["lat"].values, np.arange(N_Y) * 1.5)
    assert out4.sizes["time"] == N_T


def test_4d_all_missing_series_is_flagged_and_only_it(out4: xr.Dataset) -> None:
    meanings = out4["status"].attrs["flag_meanings"].split()
    codes = dict(zip(meanings, out4["status"].attrs["flag_values"].tolist(), strict=True))
    status = out4["status"].transpose("member", "lat", "lon").values
    assert status[ALL_MISSING] == codes["all_missing"]
    rest = np.ones(status.shape, bool)
    rest[ALL_MISSING] = False
    assert (status[rest] == codes["ok"]).all()
    assert np.isnan(
        out4["coefficients"]
        .transpose("coef", "member", "lat", "lon")
        .values[(slice(None), *ALL_MISSING)]
    ).all()


def test_4d_matches_xarray_polyfit(out4: xr.Dataset) -> None:
    sig = cube4()["sig"]
    gap_free = sig.notnull().all("time")
    assert int(gap_free.sum()) >= len(GAP_FREE)
    # Fitted values A @ coef against polyfit/polyval along the datetime axis (scale-free).
    fit = sig.polyfit("time", deg=DEGREE, skipna=True).polyfit_coefficients
    fitted = xr.polyval(sig["time"], fit).transpose("time", "member", "lat", "lon")
    ours = xr.dot(out4["design"], out4["coefficients"], dim="coef").transpose(
        "time", "member", "lat", "lon"
    )
    mask = np.broadcast_to(gap_free.values, ours.shape)
    np.testing.assert_allclose(ours.values[mask], fitted.values[mask], rtol=1e-8, atol=1e-8)
    # Coefficients themselves against polyfit on the design's own axis, t ∈ [-1, 1].
    on_t = sig.assign_coords(t=("time", np.linspace(-1, 1, N_T))).swap_dims(time="t")
    pf = on_t.polyfit("t", deg=DEGREE).polyfit_coefficients
    for k in range(DEGREE + 1):
        want = pf.sel(degree=k).transpose("member", "lat", "lon").values[gap_free.values]
        got = out4["coefficients"].isel(coef=k).transpose("member", "lat", "lon").values
        np.testing.assert_allclose(got[gap_free.values], want, rtol=1e-9, atol=1e-9)
    # The trend per day: polyfit's slope on a day-number axis.
    days = sig.assign_coords(d=("time", np.arange(N_T, dtype=float))).swap_dims(time="d")
    slope = days.polyfit("d", deg=1).polyfit_coefficients.sel(degree=1)
    got_trend = out4["trend"].transpose("member", "lat", "lon").values[gap_free.values]
    want_trend = slope.transpose("member", "lat", "lon").values[gap_free.values]
    np.testing.assert_allclose(got_trend, want_trend, rtol=1e-9, atol=1e-12)
    assert out4["trend"].attrs["units"] == "K day-1"


def test_4d_residual_rms_matches_oracle(out4: xr.Dataset) -> None:
    sig = cube4()["sig"].transpose("time", "member", "lat", "lon").values
    A = design_oracle(N_T)
    coef, _ = lstsq_oracle(A, sig)
    resid = sig - np.einsum("tk,k...->t...", A, coef)
    valid = np.isfinite(resid)
    with np.errstate(invalid="ignore", divide="ignore"):
        rms = np.sqrt(np.where(valid, resid**2, 0.0).sum(axis=0) / valid.sum(axis=0))
    got = out4["residual_rms"].transpose("member", "lat", "lon").values
    ok = np.isfinite(coef[0])
    np.testing.assert_allclose(got[ok], rms[ok], rtol=1e-6, atol=1e-9)


def test_cube_dims_in_any_order(ctx: Any, tmp_path: Path) -> None:
    ds = cube4()
    ds["sig"] = ds["sig"].transpose("lat", "member", "time", "lon")
    out = pipeline(ctx, tmp_path, write(ds, tmp_path))
    assert out["coefficients"].dims == ("coef", "member", "lat", "lon")
    check_against_lstsq(out, cube4()["sig"], ("member", "lat", "lon"))


def test_batch_dim_without_coordinate_and_obs_dim_from_config(ctx: Any, tmp_path: Path) -> None:
    ds = cube4().rename(time="epoch").drop_vars("member")
    out = pipeline(ctx, tmp_path, write(ds, tmp_path), load={"obs_dim": "epoch"})
    assert out["coefficients"].dims == ("coef", "member", "lat", "lon")
    assert out.sizes["member"] == N_M
    check_against_lstsq(out, cube4()["sig"], ("member", "lat", "lon"))


# ---------------------------------------------------------------- 2. a 5-D cube
def test_5d_select_one_label_drops_the_dim(ctx: Any, tmp_path: Path) -> None:
    path = write(cube5([500]), tmp_path)
    out = pipeline(ctx, tmp_path, path, load={"select": {"pressure": 500}})
    assert "pressure" not in out["coefficients"].dims
    assert out["coefficients"].dims == ("coef", "member", "lat", "lon")
    check_against_lstsq(out, cube4()["sig"], ("member", "lat", "lon"))


def test_5d_select_one_element_list_keeps_the_dim(ctx: Any, tmp_path: Path) -> None:
    path = write(cube5([500]), tmp_path)
    out = pipeline(ctx, tmp_path, path, load={"select": {"pressure": [500]}})
    dims = ("pressure", "member", "lat", "lon")
    assert out["coefficients"].dims == ("coef", *dims)
    assert out["status"].dims == dims and out["prediction"].dims == ("output", *dims)
    np.testing.assert_array_equal(out["pressure"].values, [500])
    assert out["pressure"].attrs["units"] == "hPa"
    check_against_lstsq(out, cube5([500])["sig"], dims)
    squeezed = out["coefficients"].isel(pressure=0).transpose("coef", "member", "lat", "lon")
    coef, _ = lstsq_oracle(design_oracle(N_T), cube4()["sig"].values)
    np.testing.assert_allclose(squeezed.values, coef, rtol=1e-9, atol=1e-9, equal_nan=True)


@pytest.mark.parametrize("tile_pixels", [None, 4])
def test_5d_two_batch_dims_fold_in_c_order(
    ctx: Any, tmp_path: Path, tile_pixels: int | None
) -> None:
    cube = cube5([500, 850])
    out = pipeline(ctx, tmp_path, write(cube, tmp_path), tile_pixels=tile_pixels)
    dims = ("pressure", "member", "lat", "lon")
    assert out["coefficients"].dims == ("coef", *dims)
    check_against_lstsq(out, cube["sig"], dims)


def test_5d_select_the_second_level(ctx: Any, tmp_path: Path) -> None:
    cube = cube5([500, 850])
    out = pipeline(ctx, tmp_path, write(cube, tmp_path), load={"select": {"pressure": 850}})
    check_against_lstsq(out, cube["sig"].sel(pressure=850), ("member", "lat", "lon"))


# ---------------------------------------------------------------- 3. isel and select
SELECTIONS: list[tuple[dict[str, Any], dict[str, Any], dict[str, Any]]] = [
    (  # isel list + uneven list + stepped range, then a date range
        {"member": [2, 0], "lat": [0, 1, 3], "lon": {"start": 1, "stop": 7, "step": 2}},
        {"time": {"start": "2020-01-03", "stop": "2020-01-20"}},
        {
            "isel": {"member": [2, 0], "lat": [0, 1, 3], "lon": slice(1, 7, 2)},
            "sel": {"time": slice("2020-01-03", "2020-01-20")},
        },
    ),
    (  # isel then select on the same dim; a one-element label list keeps member
        {"time": {"start": 2, "step": 2}},
        {"time": {"stop": "2020-01-19"}, "member": [30]},
        {
            "isel": {"time": slice(2, None, 2)},
            "sel": {"time": slice(None, "2020-01-19"), "member": [30]},
        },
    ),
    (  # negative position drops member; open-ended label range on lon
        {"member": -1},
        {"lon": {"start": 4.0}, "lat": [1.5, 4.5]},
        {"isel": {"member": -1}, "sel": {"lon": slice(4.0, None), "lat": [1.5, 4.5]}},
    ),
]


@pytest.mark.parametrize(("isel", "select", "xr_sel"), SELECTIONS)
def test_isel_and_select_match_lstsq_on_the_sub_cube(
    ctx: Any,
    tmp_path: Path,
    isel: dict[str, Any],
    select: dict[str, Any],
    xr_sel: dict[str, Any],
) -> None:
    sub = cube4()["sig"].isel(xr_sel["isel"]).sel(xr_sel["sel"])
    out = pipeline(ctx, tmp_path, write(cube4(), tmp_path), load={"isel": isel, "select": select})
    dims = tuple(d for d in ("member", "lat", "lon") if d in sub.dims)
    assert out["coefficients"].dims == ("coef", *dims)
    assert out.sizes["time"] == sub.sizes["time"]
    np.testing.assert_array_equal(out["time"].values, sub["time"].values)
    for d in dims:
        np.testing.assert_array_equal(out[d].values, sub[d].values, err_msg=d)
    check_against_lstsq(out, sub, dims)


def test_select_date_range_counts_n_obs(ctx: Any, tmp_path: Path) -> None:
    out = pipeline(
        ctx,
        tmp_path,
        write(cube4(), tmp_path),
        load={"select": {"time": {"start": "2020-01-05", "stop": "2020-01-14"}}},
    )
    assert out.sizes["time"] == 10  # stop is inclusive
    assert str(out["time"].values[0])[:10] == "2020-01-05"
    assert str(out["time"].values[-1])[:10] == "2020-01-14"


# ---------------------------------------------------------------- 4. weights and target
def _weights(seed: int = 7) -> np.ndarray:
    rng = np.random.default_rng(seed)
    w = rng.uniform(0.2, 3.0, size=(N_T, N_M, N_Y, N_X))
    w[rng.random(w.shape) < 0.1] = 0.0
    return w


def test_per_pixel_weights_with_every_cube_dim(ctx: Any, tmp_path: Path) -> None:
    ds = cube4()
    w = _weights()
    # stored in another dim order than the cube's
    ds["w"] = xr.DataArray(w, dims=("time", "member", "lat", "lon")).transpose(
        "member", "lat", "time", "lon"
    )
    out = pipeline(ctx, tmp_path, write(ds, tmp_path), load={"weights": "w"})
    A = np.asarray(out["design"].values)
    coef, _ = lstsq_oracle(A, ds["sig"].values, w)
    got = out["coefficients"].transpose("coef", "member", "lat", "lon").values
    np.testing.assert_allclose(got, coef, rtol=1e-9, atol=1e-9, equal_nan=True)
    unweighted, _ = lstsq_oracle(A, ds["sig"].values)
    assert not np.allclose(got, unweighted, equal_nan=True)  # the weights did something


@pytest.mark.parametrize(
    "target_dims", [("member", "lat", "lon"), ("lat", "member", "lon"), ("lat", "lon")]
)
def test_target_with_batch_dims_feeds_the_mse_gradient(
    ctx: Any, tmp_path: Path, target_dims: tuple[str, ...]
) -> None:
    ds = cube4()
    rng = np.random.default_rng(3)
    shape = tuple({"member": N_M, "lat": N_Y, "lon": N_X}[d] for d in target_dims)
    ds["tgt"] = (target_dims, rng.normal(size=shape))
    out = pipeline(
        ctx, tmp_path, write(ds, tmp_path), load={"target": "tgt"}, model={"objective": "mse"}
    )
    # mse over one output: d/d bias of (y - t)² is 2 (y - t), for every series.
    pred = out["prediction"].isel(output=0)
    want = 2.0 * (pred - ds["tgt"])
    got = out["grad_bias"].isel(output=0)
    got, want = xr.align(got, want.transpose(*got.dims), join="exact")
    ok = np.isfinite(pred.values)
    assert ok.sum() == N_M * N_Y * N_X - 1  # all but the all-missing series
    np.testing.assert_allclose(got.values[ok], want.values[ok], rtol=1e-4, atol=1e-5)


def test_train_with_a_batch_dim_target(ctx: Any, tmp_path: Path) -> None:
    ds = cube4()
    ds["tgt"] = (("member", "lat", "lon"), np.random.default_rng(4).normal(size=(N_M, N_Y, N_X)))
    out = pipeline(
        ctx,
        tmp_path,
        write(ds, tmp_path),
        load={"target": "tgt"},
        model={"objective": "mse"},
        train={
            "impl": "sgd",
            "epochs": 3,
            "batch_pixels": 16,
            "lr": 0.01,
            "validation_fraction": 0.0,
        },
    )
    assert out["grad_norm"].dims == ("member", "lat", "lon")
    assert out["prediction"].dims == ("output", "member", "lat", "lon")
    gn = out["grad_norm"].values
    assert np.isfinite(gn).sum() == N_M * N_Y * N_X - 1
    assert np.isnan(gn[ALL_MISSING])
    assert out.sizes["epoch"] == 3
    # The per-pixel gradient norm is the norm of the MSE gradient at the trained weights:
    # with one output, |d/d bias| = |2 (y - t)| is one of its parts, so a lower bound.
    bias_part = abs(2.0 * (out["prediction"].isel(output=0) - ds["tgt"])).transpose(
        "member", "lat", "lon"
    )
    ok = np.isfinite(gn)
    assert (gn[ok] >= bias_part.values[ok] * (1 - 1e-4) - 1e-6).all()


# ---------------------------------------------------------------- 5. errors
def _load(path: Path, ctx: Any, **fields: Any) -> Any:
    return load_run(NetCDFLoad.model_validate({"path": str(path), **fields}), {}, ctx)


def test_selection_naming_a_missing_dim_suggests_one(ctx: Any, tmp_path: Path) -> None:
    path = write(cube4(), tmp_path)
    with pytest.raises(ContractError, match="the selection names dims the cube does not have") as e:
        _load(path, ctx, select={"membr": 20})
    assert "Did you mean 'member'?" in str(e.value)
    assert "load.select" in str(e.value)
    with pytest.raises(ContractError, match="the selection names dims the cube does not have") as e:
        _load(path, ctx, isel={"tme": 0})
    assert "Did you mean 'time'?" in str(e.value)


@pytest.mark.parametrize(
    ("fields", "dim"),
    [
        ({"select": {"pressure": 850}}, "pressure"),
        ({"select": {"pressure": [500, 850]}}, "pressure"),
        ({"isel": {"member": 7}}, "member"),
        ({"isel": {"member": [0, 3]}}, "member"),
        ({"select": {"time": "2021-05-01"}}, "time"),
        ({"select": {"member": 15}}, "member"),
    ],
)
def test_selection_that_matches_nothing(
    ctx: Any, tmp_path: Path, fields: dict[str, Any], dim: str
) -> None:
    path = write(cube5([500]), tmp_path)
    with pytest.raises(
        ContractError, match=f"the selection along '{dim}' matches nothing in the file"
    ):
        _load(path, ctx, **fields)


def test_select_on_a_dim_without_coordinate_matches_nothing(ctx: Any, tmp_path: Path) -> None:
    path = write(cube4().drop_vars("member"), tmp_path)
    with pytest.raises(ContractError, match="the selection along 'member' matches nothing"):
        _load(path, ctx, select={"member": 10})


def test_empty_range_keeps_no_values(ctx: Any, tmp_path: Path) -> None:
    path = write(cube4(), tmp_path)
    with pytest.raises(ContractError, match="the selection along 'time' keeps no values"):
        _load(path, ctx, select={"time": {"start": "2030-01-01"}})


def test_too_few_dims_left(ctx: Any, tmp_path: Path) -> None:
    path = write(cube4(), tmp_path)
    with pytest.raises(ContractError, match="drops a dim the fit needs") as e:
        _load(path, ctx, isel={"member": 0}, select={"lat": 3.0})
    assert "single value of the y dim 'lat'" in str(e.value)


def test_selection_error_surfaces_from_a_whole_run(ctx: Any, tmp_path: Path) -> None:
    path = write(cube5([500]), tmp_path)
    with pytest.raises(ContractError, match="the selection along 'pressure' matches nothing"):
        pipeline(ctx, tmp_path, path, load={"select": {"pressure": 1000}})


# ---------------------------------------------------------------- 6. tiles and planes
@pytest.mark.parametrize(
    ("planes", "plane_rows", "nx", "max_pixels", "align"),
    [
        (3, 5, 7, 4, (1, 1)),
        (6, 5, 7, 13, (2, 3)),
        (2, 4, 3, 1000, (1, 1)),
        (4, 3, 9, 1, (128, 256)),
        (1, 6, 5, 7, (1, 1)),
        (5, 1, 11, 3, (1, 1)),
        (2, 7, 4, 28, (4, 4)),
    ],
)
def test_plan_tiles_cover_once_and_never_span_planes(
    planes: int, plane_rows: int, nx: int, max_pixels: int, align: tuple[int, int]
) -> None:
    ny = planes * plane_rows
    tiles = plan_tiles(ny, nx, max_pixels, *align, plane_rows=plane_rows)
    seen = np.zeros((ny, nx), int)
    for i, t in enumerate(tiles):
        assert t.index == i
        assert 0 <= t.y0 < t.y1 <= ny and 0 <= t.x0 < t.x1 <= nx
        assert t.y0 // plane_rows == (t.y1 - 1) // plane_rows, t
        assert t.pixels <= max(max_pixels, 1), t
        seen[t.y0 : t.y1, t.x0 : t.x1] += 1
    assert (seen == 1).all()


def test_plane_window_and_pixel_name_follow_c_order() -> None:
    from gridsolve.schemas.artifacts import Tile

    meta = LoadMeta(
        variable="t",
        dims=["pressure", "member", "time", "lat", "lon"],
        obs_dim="time",
        n_obs=4,
        dtype="<f4",
        aux={},
        content_hash="0",
        ny=5,
        nx=7,
        y_dim="lat",
        x_dim="lon",
        lead_dims=["pressure", "member"],
        lead_shape=[2, 3],
    )
    assert meta.grid_shape() == (30, 7)
    # row 17 = plane 3 (pressure 1, member 0), lat 2
    assert meta.pixel_name(17, 4) == "pressure=1, member=0, lat=2, lon=4"
    win = meta.plane_window(Tile(index=0, y0=16, y1=19, x0=2, x1=5))
    assert win == {"pressure": 1, "member": 0, "lat": slice(1, 4), "lon": slice(2, 5)}


@pytest.mark.slow  # ≥ 5 s beside a CPU hog: in CI, not in the fast tier
def test_many_tiles_give_the_numbers_of_one(ctx: Any, tmp_path: Path) -> None:
    path = write(cube5([500, 850]), tmp_path)
    one = pipeline(ctx, tmp_path, path, tile_pixels=10**6, name="one.nc")
    many = pipeline(ctx, tmp_path, path, tile_pixels=3, name="many.nc")
    # Across tilings the guarantee is the agreement bound, not equal bits: batched BLAS
    # kernels round by batch size on some CPU paths (docs/failures.md, Determinism).
    assert set(many.data_vars) == set(one.data_vars)
    got = {name: many[name].values for name in many.data_vars}
    assert not disagreements(got, {name: one[name].values for name in one.data_vars})
    check_against_lstsq(many, cube5([500, 850])["sig"], ("pressure", "member", "lat", "lon"))


# ---------------------------------------------------------------- 7. quick look
def test_quicklook_names_the_batch_dims(ctx: Any, tmp_path: Path) -> None:
    from gridsolve.report.drawing import quicklook_png
    from gridsolve.report.maps import first_plane

    path = write(cube5([500]), tmp_path)
    pipeline(ctx, tmp_path, path, load={"select": {"pressure": [500]}}, name="five.nc")
    with xr.open_dataset(tmp_path / "five.nc") as ds:
        plane, where = first_plane(ds)
        assert where == "pressure=500, member=10"
        assert plane["residual_rms"].dims == ("lat", "lon")
        np.testing.assert_array_equal(
            plane["coefficients"].values,
            ds["coefficients"].values[:, 0, 0],
        )
    assert quicklook_png(tmp_path / "five.nc")[:8] == b"\x89PNG\r\n\x1a\n"
    with xr.open_dataset(tmp_path / "five.nc") as ds:
        _, where3 = first_plane(ds.isel(pressure=0, member=0))
        assert where3 == ""


# ---------------------------------------------------------------- more edges
def test_shared_weights_and_file_design_follow_a_time_selection(ctx: Any, tmp_path: Path) -> None:
    ds = cube4()
    rng = np.random.default_rng(11)
    w = rng.uniform(0.5, 2.0, N_T)
    t = np.linspace(0, 1, N_T)
    own = np.stack([np.ones(N_T), t, np.cos(4 * t)], axis=1)
    ds["w"] = ("time", w)
    ds["A"] = (("time", "col"), own)
    out = pipeline(
        ctx,
        tmp_path,
        write(ds, tmp_path),
        load={
            "weights": "w",
            "design": "A",
            "isel": {"time": {"start": 1}},
            "select": {"time": {"stop": "2020-01-21"}, "member": [20, 30]},
        },
        design={"impl": "variable"},
        model={"input_dim": 3},
    )
    rows = slice(1, 21)  # 2020-01-02 … 2020-01-21
    assert out.sizes["time"] == 20
    np.testing.assert_allclose(out["design"].values, own[rows], rtol=0, atol=0)
    sub = ds["sig"].isel(time=rows).sel(member=[20, 30]).values
    coef, n_valid = lstsq_oracle(
        own[rows], sub, np.broadcast_to(w[rows, None, None, None], sub.shape)
    )
    got = out["coefficients"].transpose("coef", "member", "lat", "lon").values
    np.testing.assert_allclose(got, coef, rtol=1e-9, atol=1e-9, equal_nan=True)
    np.testing.assert_array_equal(out["n_valid"].transpose("member", "lat", "lon").values, n_valid)


def test_time_bounds_follow_the_selection(ctx: Any, tmp_path: Path) -> None:
    ds = cube4()
    start = ds["time"].values
    ds["time_bnds"] = (("time", "nv"), np.stack([start, start + np.timedelta64(1, "D")], axis=1))
    ds["time"].attrs["bounds"] = "time_bnds"
    ds["time"].encoding["units"] = "days since 2020-01-01"
    path = write(ds, tmp_path)
    out = pipeline(
        ctx,
        tmp_path,
        path,
        load={"select": {"time": {"start": "2020-01-04", "stop": "2020-01-09"}}},
    )
    assert out.sizes["time"] == 6
    assert "time_bnds" in out, list(out.variables)
    with xr.open_dataset(path) as raw:
        want = raw["time_bnds"].sel(time=slice("2020-01-04", "2020-01-09")).values
    np.testing.assert_array_equal(out["time_bnds"].values, want)


def test_select_dates_on_a_noleap_calendar(ctx: Any, tmp_path: Path) -> None:
    ds = cube4()
    ds = ds.assign_coords(time=("time", np.arange(N_T) + 58.0))  # 2000-02-28 … in noleap days
    ds["time"].attrs.update(units="days since 2000-01-01", calendar="noleap")
    path = tmp_path / "noleap.nc"
    ds.to_netcdf(path)
    # noleap: 2000-02-28 is followed by 2000-03-01, so Feb 27 … Mar 3 holds 5 days
    out = pipeline(
        ctx,
        tmp_path,
        path,
        load={"select": {"time": {"start": "2000-02-27", "stop": "2000-03-03"}}},
    )
    assert out.sizes["time"] == 4  # Feb 28, Mar 1, Mar 2, Mar 3
    check_against_lstsq(out, ds["sig"].isel(time=slice(0, 4)), ("member", "lat", "lon"))


def test_target_with_an_output_dim_and_a_batch_dim(ctx: Any, tmp_path: Path) -> None:
    ds = cube4()
    rng = np.random.default_rng(5)
    ds["tgt"] = (("member", "out", "lat", "lon"), rng.normal(size=(N_M, 2, N_Y, N_X)))
    out = pipeline(
        ctx,
        tmp_path,
        write(ds, tmp_path),
        load={"target": "tgt"},
        model={"objective": "mse", "output_dim": 2},
    )
    # mse = mean over the 2 outputs of (y - t)²: d/d bias_o = (y_o - t_o)
    pred = out["prediction"].transpose("output", "member", "lat", "lon").values
    tgt = ds["tgt"].transpose("out", "member", "lat", "lon").values
    got = out["grad_bias"].transpose("output", "member", "lat", "lon").values
    ok = np.isfinite(pred)
    np.testing.assert_allclose(got[ok], (pred - tgt)[ok], rtol=1e-4, atol=1e-5)


def test_train_grad_norm_is_the_model_gradient_norm_per_series(ctx: Any, tmp_path: Path) -> None:
    ds = cube4()
    ds["tgt"] = (("member", "lat", "lon"), np.random.default_rng(4).normal(size=(N_M, N_Y, N_X)))
    out = pipeline(
        ctx,
        tmp_path,
        write(ds, tmp_path),
        load={"target": "tgt"},
        model={"objective": "mse"},
        train={"impl": "adam", "epochs": 2, "batch_pixels": 8, "validation_fraction": 0.0},
    )
    dims = ("member", "lat", "lon")
    gb = out["grad_bias"].transpose(..., *dims).values.reshape(-1, N_M, N_Y, N_X)
    gw = out["grad_weight"].transpose(..., *dims).values.reshape(-1, N_M, N_Y, N_X)
    norm = np.sqrt((gb.astype(float) ** 2).sum(0) + (gw.astype(float) ** 2).sum(0))
    gn = out["grad_norm"].transpose(*dims).values
    ok = np.isfinite(gn)
    np.testing.assert_allclose(gn[ok], norm[ok], rtol=1e-4, atol=1e-6)


def test_selection_is_part_of_the_cache_key(ctx: Any, tmp_path: Path) -> None:
    path = write(cube5([500]), tmp_path)
    dropped = pipeline(ctx, tmp_path, path, load={"select": {"pressure": 500}}, name="a.nc")
    kept = pipeline(ctx, tmp_path, path, load={"select": {"pressure": [500]}}, name="b.nc")
    assert "pressure" not in dropped["coefficients"].dims
    assert kept["coefficients"].dims == ("coef", "pressure", "member", "lat", "lon")
    again = pipeline(ctx, tmp_path, path, load={"isel": {"pressure": 0}}, name="c.nc")
    assert again["coefficients"].dims == ("coef", "member", "lat", "lon")
    np.testing.assert_array_equal(again["coefficients"].values, dropped["coefficients"].values)


def test_uncertainty_and_jacobians_keep_the_batch_dims(ctx: Any, tmp_path: Path) -> None:
    cube = cube5([500, 850])
    out = pipeline(
        ctx,
        tmp_path,
        write(cube, tmp_path),
        load={"select": {"member": [10, 30]}},
        model={"output_dim": 2, "jacobian": True},
        tile_pixels=5,
        solve={"uncertainty": "cov"},
        write_extra={"chunks": {"member": 2, "lat": 2}},
    )
    dims = ("pressure", "member", "lat", "lon")
    sub = cube["sig"].sel(member=[10, 30]).transpose("time", *dims).values
    A = design_oracle(N_T)
    coef, n_valid = lstsq_oracle(A, sub)
    k = A.shape[1]
    cov = np.full((k, k, *n_valid.shape), np.nan)
    r2 = np.full(n_valid.shape, np.nan)
    for idx in np.ndindex(*n_valid.shape):
        b = sub[(slice(None), *idx)]
        m = np.isfinite(b)
        if m.sum() <= k:
            continue
        r = b[m] - A[m] @ coef[(slice(None), *idx)]
        sigma2 = (r @ r) / (m.sum() - k)
        cov[(slice(None), slice(None), *idx)] = sigma2 * np.linalg.inv(A[m].T @ A[m])
        r2[idx] = 1 - (r @ r) / ((b[m] - b[m].mean()) ** 2).sum()
    got_cov = out["coef_cov"].transpose("coef", "coef2", *dims).values
    np.testing.assert_allclose(got_cov, cov, rtol=1e-8, atol=1e-12, equal_nan=True)
    stderr = np.sqrt(np.einsum("ii...->i...", cov))
    got_se = out["coef_stderr"].transpose("coef", *dims).values
    np.testing.assert_allclose(got_se, stderr, rtol=1e-8, atol=1e-12, equal_nan=True)
    # R² = 1 − rss/tss: near 0 it keeps its absolute precision (≈ ε), not its relative one
    np.testing.assert_allclose(
        out["r2"].transpose(*dims).values, r2, rtol=1e-8, atol=1e-13, equal_nan=True
    )
    dof = out["dof"].transpose(*dims).values
    ok = np.isfinite(coef[0])
    np.testing.assert_array_equal(dof[ok], (n_valid - k)[ok])
    # d(outputs)/d(bias) of a linear layer is the identity at every valid series.
    assert out["jac_bias"].dims == ("output", "output_wrt", *dims)  # one name per dim
    jac = out["jac_bias"].values
    assert jac.shape[2:] == tuple(out.sizes[d] for d in dims)
    valid = np.isfinite(out["prediction"].transpose("output", *dims).values[0])
    eye = np.broadcast_to(np.eye(2)[:, :, None], (2, 2, int(valid.sum())))
    np.testing.assert_allclose(jac[:, :, valid], eye, rtol=0, atol=1e-6)


def test_gap_pattern_shared_across_planes(ctx: Any, tmp_path: Path) -> None:
    cube = cube5([500, 850])
    sig = cube["sig"].values  # (time, pressure, member, lat, lon)
    sig[:, :, 1] = np.nan_to_num(sig[:, :, 1], nan=2.0)
    sig[[3, 7, 8], :, 1] = np.nan  # 2 levels × 35 series with one gap pattern (≥ GROUP_MIN)
    sig[:, 1, 1, 2, 3] = np.nan  # and one all-missing series among them
    cube["sig"].values = sig
    path = write(cube, tmp_path)
    dims = ("pressure", "member", "lat", "lon")
    for tile_pixels in (None, 6):
        out = pipeline(ctx, tmp_path, path, tile_pixels=tile_pixels, name=f"o{tile_pixels}.nc")
        check_against_lstsq(out, cube["sig"], dims)


def test_yaml_config_with_unquoted_dates(tmp_path: Path) -> None:
    """YAML reads ``2020-01-03`` as a date: the config must take it, or refuse it clearly."""
    from gridsolve.schemas.errors import GridsolveError
    from gridsolve.schemas.reading import load_config

    path = write(cube4(), tmp_path)
    cfg = tmp_path / "gridsolve.yaml"
    cfg.write_text(
        f"load:\n  path: {path}\n  select:\n    time: {{start: 2020-01-03, stop: 2020-01-10}}\n"
        "design: {impl: polynomial, degree: 1}\n"
    )
    try:
        conf = load_config(cfg)
    except GridsolveError as exc:  # a clear refusal is fine
        assert "time" in str(exc)
        return
    assert isinstance(conf.load, NetCDFLoad)
    rng = conf.load.select["time"]
    assert str(getattr(rng, "start", ""))[:10] == "2020-01-03"


def test_too_few_dims_left_when_the_variable_is_inferred(ctx: Any, tmp_path: Path) -> None:
    ds = cube4()
    ds["mask"] = (("lat", "lon"), np.ones((N_Y, N_X)))  # a second, 2-D variable
    path = tmp_path / "two.nc"
    ds.to_netcdf(path)
    with pytest.raises(ContractError, match="single value of the obs dim 'time'"):
        load_run(
            NetCDFLoad.model_validate({"path": str(path), "isel": {"member": 0, "time": 0}}),
            {},
            ctx,
        )


def test_selecting_one_date_does_not_make_a_batch_dim_the_obs(ctx: Any, tmp_path: Path) -> None:
    """One date drops time; the cube is then (member, lat, lon) and must not be fitted over
    members as if they were observations."""
    path = write(cube4(), tmp_path)
    with pytest.raises(ContractError, match="single value of the obs dim 'time'"):
        _load(path, ctx, select={"time": "2020-01-05"})


def test_same_selected_values_at_other_positions_get_their_own_key(
    ctx: Any, tmp_path: Path
) -> None:
    """A file extended backwards: the selected values are equal, their positions are not."""
    short = cube4()
    longer = xr.concat(
        [
            cube4(seed=9)
            .isel(time=slice(0, 4))
            .assign_coords(time=pd.date_range("2019-12-28", periods=4, freq="D")),
            short,
        ],
        dim="time",
    )
    a, b = write(short, tmp_path, "a.nc"), write(longer, tmp_path, "b.nc")
    window = {"time": {"start": "2020-01-03", "stop": "2020-01-20"}}
    from gridsolve.stages.load.netcdf import fingerprint

    fa = fingerprint(NetCDFLoad.model_validate({"path": str(a), "select": window}), ctx)
    fb = fingerprint(NetCDFLoad.model_validate({"path": str(b), "select": window}), ctx)
    assert fa != fb  # tiles of one must never read the other at the stored positions
    ra, rb = _load(a, ctx, select=window), _load(b, ctx, select=window)
    assert ra.meta["selection"] != rb.meta["selection"]


def test_two_obs_like_dims_are_never_guessed(ctx: Any, tmp_path: Path) -> None:
    # (time, step, lat, lon), both numbered 0, 1, …: which one is obs?
    ds = cube4().rename(member="step").assign_coords(time=np.arange(N_T))
    path = write(ds, tmp_path)
    with pytest.raises(ContractError, match="cannot tell which dim is the observation") as e:
        _load(path, ctx)
    assert "load.obs_dim" in str(e.value)
    assert _load(path, ctx, obs_dim="time").meta["lead_dims"] == ["step"]


def test_a_time_coordinate_tells_obs_from_another_obs_like_name(ctx: Any, tmp_path: Path) -> None:
    # the same names, but time holds dates (CF 4.4): time is obs, step a batch dim
    path = write(cube4().rename(member="step"), tmp_path)
    assert _load(path, ctx).meta["lead_dims"] == ["step"]
