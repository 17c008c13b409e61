"""The quick-look picture: maps of the output, and the trend where it is significant.

The figure is inspected as matplotlib objects: titles, axis labels, the
caption's text and each map's colour scale.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any
from uuid import UUID

import numpy as np
import pytest
import xarray as xr
from matplotlib.axes import Axes
from matplotlib.collections import QuadMesh
from matplotlib.figure import Figure

from gridsolve.report.drawing import quicklook_figure, quicklook_png
from gridsolve.report.maps import colour_scale, significant_trend, status_counts
from gridsolve.report.pictures import (
    LOSS_VARIABLE,
    Caption,
    _may_hold,
    config_summary,
    drawn_from,
    write_loss_curve,
    write_quicklook,
)
from gridsolve.schemas.kinds.design import PolynomialDesign, RandomDesign
from gridsolve.schemas.kinds.load import NetCDFLoad
from gridsolve.schemas.kinds.model import MultidimLinearModel
from gridsolve.schemas.kinds.normal_equations import SVDNormalEquations
from gridsolve.schemas.kinds.solve import LstsqSolve
from gridsolve.schemas.kinds.write import NetCDFWrite
from gridsolve.schemas.pipeline import build_config
from gridsolve.stages.engine.provenance import STAMP_KEY, png_text

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


# ---------------------------------------------------------------- what the figure says
def solved(
    chain: Chain,
    write_cube: Any,
    tmp_path: Path,
    ds: xr.Dataset,
    design: Any,
    solve: Any,
    name: str,
    model: Any = None,
) -> Path:
    """``ds`` through the stages (load … write) into ``tmp_path / name``."""
    chain.whole("load", NetCDFLoad(path=str(write_cube(ds, f"{name}-cube.nc"))))
    chain.whole("design", design)
    chain.whole("normal_equations", SVDNormalEquations())
    chain.tiled("solve", solve)
    chain.tiled("model", model or MultidimLinearModel(input_dim=1, hidden_dim=2, output_dim=1))
    chain.whole("write", NetCDFWrite(path=str(tmp_path / name)))
    return tmp_path / name


def panels(fig: Figure) -> list[Axes]:
    """The map axes of a quick look (its colour bars left out)."""
    return [ax for ax in fig.axes if ax.get_label() != "<colorbar>"]


def mesh(ax: Axes) -> QuadMesh:
    (found,) = [c for c in ax.collections if isinstance(c, QuadMesh)]
    return found


def flat(text: str) -> str:
    """``text`` with its line breaks (titles are wrapped) as single spaces."""
    return " ".join(text.split())


def described(var: xr.DataArray) -> str:
    return f"{var.attrs['long_name']} ({var.attrs['units']})"


def caption_of(fig: Figure) -> str:
    return flat(" ".join(t.get_text() for t in fig.texts))


def test_titles_axes_and_caption_name_what_is_shown(
    chain: Chain, write_cube: Any, tmp_path: Path
) -> None:
    out = output(chain, write_cube, tmp_path, "stderr")
    caption = Caption(
        run="nightly-otter", deployment="gridsolve/nightly", config="solve.uncertainty=stderr"
    )
    fig = quicklook_figure(out, caption=caption)
    with xr.open_dataset(out) as ds:
        expected = [described(ds[v]) for v in ("coefficients", "residual_rms", "trend")]
        coords = {d: (ds[d].attrs.get("units"), ds[d].values) for d in ("y", "x")}
        counts = status_counts(ds)
        first = str(ds["coef_name"].values[0])
        flags = dict(
            zip(
                ds["status"].attrs["flag_values"].tolist(),
                ds["status"].attrs["flag_meanings"].split(),
                strict=True,
            )
        )
        codes, n = np.unique(ds["status"].values, return_counts=True)
    assert counts == [(flags[int(c)], int(k)) for c, k in zip(codes, n, strict=True)]
    axes = panels(fig)
    assert len(axes) == 3
    for ax, text in zip(axes, expected, strict=True):
        assert text in flat(ax.get_title())
    assert f"coefficients of column '{first}'" in flat(axes[0].get_title())
    assert "trend where p < 0.05" in flat(axes[2].get_title())
    for ax in axes:
        for label, dim, lim in (
            (ax.get_xlabel(), "x", ax.get_xlim()),
            (ax.get_ylabel(), "y", ax.get_ylim()),
        ):
            units, values = coords[dim]
            assert units == "m" and label.startswith(dim) and f"({units})" in label
            # the coordinate's values on the axis (cells of 10 m), not pixel indices
            assert lim == (values[0] - 5.0, values[-1] + 5.0)
    text = caption_of(fig)
    assert "run nightly-otter" in text and "deployment gridsolve/nightly" in text
    assert "config: solve.uncertainty=stderr" in text
    assert f"{8 * 9} pixels" in text
    for meaning, k in counts:
        assert f"{meaning} {k}" in text
    local = caption_of(quicklook_figure(out, caption=Caption(run="calm-heron")))
    assert "run calm-heron" in local and "no deployment" in local


#: a model whose input holds the 20 coefficients of the exact fit below
TWENTY_INPUTS = MultidimLinearModel(input_dim=4, hidden_dim=5, output_dim=1)


def test_an_exact_fit_shows_what_varies_and_says_why(
    chain: Chain, write_cube: Any, tmp_path: Path
) -> None:
    # minimum norm with more coefficients (20) than observations (12): residuals 0 everywhere
    ds = make_ds(n_obs=12, ny=6, nx=5, seed=3)
    out = solved(
        chain,
        write_cube,
        tmp_path,
        ds,
        RandomDesign(coef=20, seed=1),
        LstsqSolve(policy="minnorm", dtype="float64"),
        "exact.nc",
        TWENTY_INPUTS,
    )
    with xr.open_dataset(out) as got:
        assert (got["residual_rms"].values == 0).all()
        assert (got["n_valid"].values == 12).all()  # constant: no use as a map
        without_design = got.drop_vars("design").load()
        n_valid = described(got["n_valid"])
    fig = quicklook_figure(out)
    title = flat(panels(fig)[1].get_title())
    assert "residual RMS is 0 everywhere (exact fit: 20 coef ≥ 12 obs)" in title
    assert "showing the fitted-value RMS" in title
    # an exact fit: the fitted values are the data, so their RMS is the data's
    data_rms = np.sqrt((ds["signal"].values ** 2).mean(axis=0))
    np.testing.assert_allclose(mesh(panels(fig)[1]).get_array().reshape(6, 5), data_rms, rtol=1e-6)

    # with gaps each pixel is solved on its own: the residuals are round-off, not 0
    gappy = make_ds(n_obs=12, ny=6, nx=5, seed=3, nan_fraction=0.2)
    other = solved(
        Chain(chain.ctx),
        write_cube,
        tmp_path,
        gappy,
        RandomDesign(coef=20, seed=1),
        LstsqSolve(policy="minnorm", uncertainty="stderr", dtype="float64"),
        "gappy.nc",
        TWENTY_INPUTS,
    )
    with xr.open_dataset(other) as got:
        assert got["residual_rms"].max() < 1e-12
        assert (got["dof"].values == 0).all()
        n = got["n_valid"].values
        got.drop_vars("design").to_netcdf(tmp_path / "gappy-no-design.nc")
    assert n.min() < n.max()
    title = flat(panels(quicklook_figure(other))[1].get_title())
    assert "residual RMS is ≈ 0 everywhere" in title and "round-off" in title
    assert f"(exact fit: 20 coef ≥ {n.max()} obs) — showing the fitted-value RMS" in title

    # without the design (no fitted values): n_valid, which varies where there are gaps
    ax = panels(quicklook_figure(tmp_path / "gappy-no-design.nc"))[1]
    title = flat(ax.get_title())
    assert f"(exact fit: 20 coef ≥ {n.max()} obs) — showing n_valid" in title
    assert n_valid in title
    np.testing.assert_array_equal(mesh(ax).get_array().reshape(n.shape), n)

    # without the design and with n_valid constant: n_valid, its title says it is constant
    without_design.to_netcdf(tmp_path / "exact-no-design.nc")
    ax = panels(quicklook_figure(tmp_path / "exact-no-design.nc"))[1]
    title = flat(ax.get_title())
    assert "showing n_valid" in title and "constant = 12" in title


def field(values: np.ndarray, long_name: str, units: str) -> tuple[tuple[str, ...], Any, Any]:
    dims = ("coef", "y", "x") if values.ndim == 3 else ("y", "x")
    return dims, values, {"long_name": long_name, "units": units}


def test_a_constant_or_empty_panel_says_so(tmp_path: Path) -> None:
    ones = tmp_path / "ones.nc"
    xr.Dataset(
        {
            "coefficients": field(np.full((2, 4, 4), 3.25), "coefficients", "K"),
            "residual_rms": field(np.full((4, 4), np.nan), "residual RMS", "K"),
        }
    ).to_netcdf(ones)
    first, second = panels(quicklook_figure(ones))
    assert "constant = 3.25" in flat(first.get_title())
    assert "coefficients (K)" in flat(first.get_title())
    assert "residual RMS has no finite values" in flat(second.get_title())
    assert "no finite values" in [t.get_text() for t in second.texts]  # on the map too
    # without coordinates: pixel indices, named so
    assert first.get_xlabel() == "x (index)" and first.get_ylabel() == "y (index)"
    assert first.get_xlim() == (-0.5, 3.5)


def test_signed_maps_get_a_symmetric_diverging_scale(
    chain: Chain, write_cube: Any, tmp_path: Path
) -> None:
    ds = make_ds(n_obs=40, ny=8, nx=9, seed=4)
    rng = np.random.default_rng(6)
    yy, xx = np.meshgrid(np.arange(8), np.arange(9), indexing="ij")
    offset = np.where((yy + xx) % 2 == 0, 3.0, -3.0)  # intercepts of both signs
    slope = np.where(xx < 4, -1.0, 1.0)  # trends of both signs, all significant
    ramp = np.linspace(-1, 1, 40)[:, None, None] * slope
    ds["signal"][:] = offset + ramp + 0.1 * rng.standard_normal((40, 8, 9))
    out = solved(
        chain,
        write_cube,
        tmp_path,
        ds,
        PolynomialDesign(degree=1),
        LstsqSolve(uncertainty="stderr", dtype="float64"),
        "signed.nc",
    )
    coef, rms, trend = panels(quicklook_figure(out))
    for ax in (coef, trend):
        vmin, vmax = mesh(ax).get_clim()
        assert vmin == -vmax and vmax > 0
        assert mesh(ax).get_cmap().name == "RdBu_r"
    vmin, vmax = mesh(rms).get_clim()
    assert mesh(rms).get_cmap().name == "viridis" and 0 <= vmin < vmax
    assert "100% of pixels" in flat(trend.get_title())


def test_the_colour_scale_is_robust_to_outliers() -> None:
    data = np.concatenate([np.linspace(1.0, 2.0, 99), [1e6], [np.nan]])
    scale = colour_scale(data)
    assert scale.cmap == "viridis" and scale.extend == "both"
    assert scale.vmin == np.percentile(data[:100], 2) and scale.vmax < 3.0  # not 1e6
    signed = colour_scale(np.array([-1.0, 0.5, 4.0, np.nan]))
    assert signed.cmap == "RdBu_r" and signed.vmin == -signed.vmax
    assert signed.vmax == max(abs(p) for p in np.percentile([-1.0, 0.5, 4.0], [2, 98]))
    assert colour_scale(np.full(3, np.nan)).note == "no finite values"
    assert colour_scale(np.full(3, 3.2)).note == "constant = 3.2"


def test_the_config_summary_lists_the_keys_set(tmp_path: Path) -> None:
    long_path = str(tmp_path / ("a-very-long-folder-name" * 3) / "cube.nc")
    cfg = build_config(
        {
            "load": {"impl": "netcdf", "path": long_path, "variable": "signal"},
            "design": {"impl": "random", "coef": 100},
            "solve": {"policy": "minnorm"},
        }
    )
    text = config_summary(cfg)
    assert "load.impl=netcdf, load.path=…" in text and "/cube.nc, load.variable=signal" in text
    assert long_path not in text  # cut, keeping the file name
    assert "design.impl=random, design.coef=100" in text
    assert "solve.impl=lstsq, solve.policy=minnorm" in text  # impl named with a key set
    assert "design.seed" not in text and "solve.ridge" not in text and "write." not in text
    assert len(config_summary(cfg, width=40)) == 40


@pytest.mark.usefixtures("prefect_server")
def test_the_flow_captions_its_quick_look_with_the_run_and_config(
    tmp_path: Path, write_cube: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from prefect.client.orchestration import get_client

    from gridsolve.flows import pipeline, reporting

    captions: list[Caption] = []
    reused: list[bool] = []

    def recording(output: Any, options: Any = None, caption: Caption | None = None) -> Any:
        assert caption is not None
        captions.append(caption)
        got = write_quicklook(output, options, caption)
        reused.append(got[2])
        return got

    monkeypatch.setattr(reporting, "write_quicklook", recording)
    cfg = build_config(
        {
            "load": {"path": str(write_cube(make_ds()))},
            "design": {"impl": "polynomial", "degree": 1},
            "model": {"impl": "multidim_linear", "input_dim": 1, "hidden_dim": 2},
            "write": {"path": str(tmp_path / "out.nc")},
            "cache": {"root": str(tmp_path / "cache")},
        }
    )
    summary = pipeline.run_config(cfg)
    assert summary.flow_run_id is not None
    with get_client(sync_client=True) as client:
        name = client.read_flow_run(UUID(summary.flow_run_id)).name
    (caption,) = captions
    assert caption.run == name and caption.deployment is None  # a local run
    assert "design.impl=polynomial, design.degree=1" in caption.config
    assert "solve." not in caption.config  # nothing of solve was set
    picture = Path(f"{tmp_path / 'out.nc'}.quicklook.png")
    drawn = picture.read_bytes()
    assert drawn.startswith(b"\x89PNG") and reused == [False]
    # a fully cached rerun leaves the output file as it is: its picture is reused, not redrawn
    again = pipeline.run_config(cfg)
    assert {row.cache for row in again.stages} == {"hit"}
    assert reused == [False, True] and picture.read_bytes() == drawn


def test_the_caption_counts_the_status_of_the_whole_file_by_its_flags(tmp_path: Path) -> None:
    status = np.array([0] * 13 + [2] * 2 + [7], dtype=np.int8).reshape(2, 2, 4)  # (member, y, x)
    path = tmp_path / "flags.nc"
    xr.Dataset(
        {
            "coefficients": (("coef", "member", "y", "x"), np.arange(64.0).reshape(2, 2, 4, 4)),
            "residual_rms": (("member", "y", "x"), np.arange(32.0).reshape(2, 4, 4)),
            "status": (
                ("member", "y", "x"),
                status.repeat(2, axis=1)[:, :4],
                {
                    "long_name": "solve status",
                    "flag_values": np.array([0, 1, 2], dtype=np.int8),
                    "flag_meanings": "ok all_missing too_few_observations",
                },
            ),
        }
    ).to_netcdf(path)
    with xr.open_dataset(path) as ds:
        values = ds["status"].values
    counts = {c: int((values == c).sum()) for c in (0, 2, 7)}
    assert sum(counts.values()) == values.size == 32 and all(counts.values())
    fig = quicklook_figure(path)
    text = caption_of(fig)
    assert (
        f"solve status of 32 pixels: ok {counts[0]}, too_few_observations {counts[2]}, "
        f"code 7 {counts[7]}"
    ) in text
    assert "all_missing" not in text  # no pixel has it
    assert "member=0" in flat(panels(fig)[0].get_title())  # the maps: the first member


def test_a_picture_is_drawn_again_when_its_output_or_caption_changed(
    chain: Chain, write_cube: Any, tmp_path: Path
) -> None:
    out = output(chain, write_cube, tmp_path, "none")
    caption = Caption(run="first", config="design.impl=polynomial")
    path, png, reused = write_quicklook(out, None, caption)
    assert not reused and png_text(png)[STAMP_KEY] == drawn_from(out, caption)
    # another run of the same config over the same file: reused, caption of the first run kept
    assert write_quicklook(out, None, Caption(run="second", config=caption.config))[1:] == (
        png,
        True,
    )
    # another config summary, or the output rewritten: drawn again
    assert not write_quicklook(out, None, Caption(run="third", config="x=1"))[2]
    stamp = png_text(Path(path).read_bytes())[STAMP_KEY]
    st = out.stat()
    import os

    os.utime(out, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    assert drawn_from(out, Caption(run="fourth", config="x=1")) != stamp
    assert not write_quicklook(out, None, Caption(run="fourth", config="x=1"))[2]


def test_the_loss_curve_is_drawn_only_for_an_output_with_losses(tmp_path: Path) -> None:
    # told without xarray for a local NetCDF file or Zarr store (_may_hold); drawn when held
    losses = {"train_loss": ("epoch", [1.0, 0.5]), "val_loss": ("epoch", [1.2, 0.7])}
    with_loss = xr.Dataset(losses, coords={"epoch": [1, 2]})
    without = xr.Dataset({"other": ("epoch", [1.0, 0.5])}, coords={"epoch": [1, 2]})
    for name, ds in (("with.nc", with_loss), ("without.nc", without)):
        ds.to_netcdf(tmp_path / name)
    for name, ds in (("with.zarr", with_loss), ("without.zarr", without)):
        ds.to_zarr(tmp_path / name, consolidated=True, zarr_format=2)
    for stem in ("with", "without"):
        for suffix in ("nc", "zarr"):
            out = tmp_path / f"{stem}.{suffix}"
            assert _may_hold(out, LOSS_VARIABLE) is (stem == "with"), out
            curve = write_loss_curve(out)
            assert (curve is not None) is (stem == "with"), out
            assert Path(f"{out}.loss.png").exists() is (stem == "with"), out
    # what cannot be read cheaply is left to the drawing code
    assert _may_hold(tmp_path / "missing.nc", LOSS_VARIABLE)
    assert _may_hold("s3://bucket/out.nc", LOSS_VARIABLE)


@pytest.mark.usefixtures("prefect_server")
def test_a_picture_that_fails_after_the_run_warns_and_the_run_stands(
    tmp_path: Path, write_cube: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    import logging

    from gridsolve.flows import pipeline, reporting

    said: list[str] = []  # Prefect's logging setup replaces the root's handlers (caplog's)
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: said.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("gridsolve").addHandler(handler)

    def broken(*_: Any, **__: Any) -> Any:
        raise RuntimeError("no fonts here")

    monkeypatch.setattr(reporting, "write_quicklook", broken)
    cfg = build_config(
        {
            "load": {"path": str(write_cube(make_ds()))},
            "design": {"impl": "polynomial", "degree": 1},
            "write": {"path": str(tmp_path / "out.nc")},
            "cache": {"root": str(tmp_path / "cache")},
        }
    )
    try:
        summary = pipeline.run_config(cfg)  # the CLI's way: pictures drawn as the run ends
    finally:
        logging.getLogger("gridsolve").removeHandler(handler)
    assert Path(summary.output).is_file()
    assert "quick-look picture not made: no fonts here" in said
    assert not Path(f"{summary.output}.quicklook.png").exists()
