"""``solve: {impl: curvefit}`` through the whole plan: against scipy's curve_fit per pixel.

The batched Levenberg–Marquardt core is tested in ``test_levmar.py``; here the
stage as a user meets it: a cube with a time axis and gaps, the user's function
imported by path, tiles, the output's variables and flags, refusals, cache keys.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import xarray as xr
from scipy.optimize import curve_fit

import gridsolve
from gridsolve.schemas.errors import ConfigError, ContractError
from gridsolve.schemas.kinds.solve import CurvefitSolve
from gridsolve.stages.engine.context import StageContext
from gridsolve.stages.solve.declare import curvefit_fingerprint
from gridsolve.stages.solve.levmar_status import FIT_STATUS_FLAGS

from testkit import ndvi_cube, season_jac, season_np

pytestmark = pytest.mark.usefixtures("one_torch_thread")

NAMES = ["base", "amp", "up_rate", "sos", "down_rate", "eos"]
P0 = dict(zip(NAMES, [0.2, 0.5, 0.08, 120.0, 0.07, 275.0], strict=True))
SOLVE = {"impl": "curvefit", "target": "my_curves:season", "params": NAMES, "p0": P0}


def scipy_fit(t: np.ndarray, row: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    v = np.isfinite(row)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            p, cov = curve_fit(
                season_np, t[v], row[v], p0=list(P0.values()), jac=season_jac, method="lm"
            )
    except (RuntimeError, TypeError, ValueError):
        return None
    return p, cov


def pcov_at(t: np.ndarray, row: np.ndarray, p: np.ndarray) -> np.ndarray:
    """(JᵀJ)⁻¹ · cost / (m − n) at ``p`` over the observed values of ``row``."""
    v = np.isfinite(row)
    J = season_jac(t[v], *p)
    r = row[v] - season_np(t[v], *p)
    out: np.ndarray = np.linalg.inv(J.T @ J) * (r @ r) / (v.sum() - p.size)
    return out


@pytest.fixture(scope="module")
def fitted() -> tuple[xr.DataArray, xr.Dataset]:
    da = ndvi_cube()
    return da, gridsolve.fit(da, solve={**SOLVE, "covariance": True}, progress=False)


def test_every_converged_pixel_matches_curve_fit(fitted: tuple[xr.DataArray, xr.Dataset]) -> None:
    da, out = fitted
    t = np.arange(46) * 8.0  # since_first, in days
    status = out["status"].values
    converged = status == 0
    assert converged.sum() >= 40, np.unique(status, return_counts=True)
    compared = 0
    for i, j in zip(*np.nonzero(converged), strict=True):
        ref = scipy_fit(t, da.values[:, i, j])
        assert ref is not None, (i, j)  # scipy converges where we say converged
        p, _ = ref
        ours = out["params"].values[:, i, j]
        if i == 0 and j < 2:
            # No season: its timing is not identifiable (stderr ~1e8 days), the cost is flat
            # along it, and where on that flat valley a fit stops depends on the CPU's
            # rounding (2.6e-6 apart on an Intel Xeon). What the data determine is checked:
            # the cost (ours no higher than scipy's) and the fitted curve.
            row = da.values[:, i, j]
            v = np.isfinite(row)
            cost = np.sum((row[v] - season_np(t[v], *ours)) ** 2)
            assert cost <= np.sum((row[v] - season_np(t[v], *p)) ** 2) * (1 + 1e-9), (i, j)
            # (at the step of its near-vertical edge the curves part by 7e-7: 1e-5 is still
            # 3,000 times below the noise of these data, σ = 0.03)
            np.testing.assert_allclose(season_np(t, *ours), season_np(t, *p), rtol=0, atol=1e-5)
            continue
        np.testing.assert_allclose(ours, p, rtol=1e-6, atol=1e-12)
        # curve_fit's pcov formula at its solution (its own pcov uses the Jacobian of the
        # step before; test_levmar.py measures that difference)
        cov = pcov_at(t, da.values[:, i, j], p)
        sd = np.sqrt(np.diag(cov))
        got = out["param_cov"].values[:, :, i, j]
        assert np.max(np.abs(got - cov) / np.outer(sd, sd)) < 1e-5, (i, j)
        np.testing.assert_allclose(out["param_stderr"].values[:, i, j], sd, rtol=1e-5)
        compared += 1
    assert compared == converged.sum() - converged[0, :2].sum()
    # nothing observed: flagged, NaN, never converged
    assert FIT_STATUS_FLAGS[int(status[1, 1])] == "all_missing"
    assert np.isnan(out["params"].values[:, 1, 1]).all()


def test_the_output_describes_the_fit(fitted: tuple[xr.DataArray, xr.Dataset]) -> None:
    _, out = fitted
    assert out["params"].dims == ("param", "lat", "lon")
    assert list(out["param_name"].values) == NAMES
    assert "param_name" in out["params"].attrs.get(
        "coordinates", out["params"].encoding.get("coordinates", "param_name")
    )
    flags = out["status"].attrs
    assert flags["flag_meanings"].split() == [FIT_STATUS_FLAGS[k] for k in sorted(FIT_STATUS_FLAGS)]
    assert "my_curves:season" in out["params"].attrs["long_name"]
    for gone in ("design", "coefficients", "coef_name", "trend"):
        assert gone not in out.variables, gone
    assert out["n_iter"].dtype.kind == "i" and int(out["n_iter"].max()) > 1
    assert out["n_valid"].values[1, 1] == 0


def test_tiles_give_the_same_fit(fitted: tuple[xr.DataArray, xr.Dataset]) -> None:
    da, whole = fitted
    tiled = gridsolve.fit(
        da, solve={**SOLVE, "covariance": True}, execution={"tile_pixels": 7}, progress=False
    )
    np.testing.assert_array_equal(tiled["status"].values, whole["status"].values)
    np.testing.assert_allclose(tiled["params"].values, whole["params"].values, rtol=1e-12)


def test_a_module_class_with_bounds(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    t = np.arange(30.0)
    truth = np.array([0.8, 0.5, 6.0])
    y = truth[0] - truth[1] * np.exp(-(t - 2.0) / truth[2])
    data = np.repeat(y[:, None, None], 12, axis=1).reshape(30, 3, 4) + rng.normal(
        0, 0.01, (30, 3, 4)
    )
    da = xr.DataArray(data, dims=("t", "y", "x"), coords={"t": t}, name="v")
    solve = {
        "impl": "curvefit",
        "target": "my_curves:Recovery",
        "kwargs": {"t0": 2.0},
        "params": ["level", "depth", "scale"],
        "p0": {"level": 1.0, "depth": 0.3, "scale": 3.0},
        "bounds": {"scale": [0.5, 4.0]},  # the truth (6) lies outside: stops at the bound
        "t": "coordinate",
    }
    out = gridsolve.fit(da, solve=solve, progress=False)
    scale = out["params"].sel(param=2).values
    assert np.all(scale <= 4.0) and np.allclose(scale, 4.0, atol=1e-3)
    assert {FIT_STATUS_FLAGS[int(s)] for s in out["status"].values.ravel()} == {"at_bound"}


@pytest.mark.parametrize(
    ("sections", "message"),
    [
        ({"design": {"impl": "polynomial"}}, "reads no design: leave the design section out"),
        ({"model": {"impl": "multidim_linear"}}, "or set it to {impl: none}"),
        ({"solve": {**SOLVE, "p0": {**P0, "sos": float("nan")}}}, "not a finite number"),
        ({"solve": {**SOLVE, "p0": {"base": 0.1}}}, "p0 lacks"),
        ({"solve": {**SOLVE, "bounds": {"sos": [200, 300]}}}, "not strictly inside its bounds"),
    ],
)
def test_bad_configs_are_refused_before_any_work(
    sections: dict[str, Any], message: str, tmp_path: Path
) -> None:
    with pytest.raises(ConfigError, match=message):
        gridsolve.config(
            load={"impl": "netcdf", "path": str(tmp_path / "cube.nc")},
            **{"solve": SOLVE, **sections},
            write={"impl": "netcdf", "path": str(tmp_path / "o.nc")},
        )


def test_lstsq_without_a_design_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="fits a design, and design is none"):
        gridsolve.config(load={"path": str(tmp_path / "cube.nc")}, design={"impl": "none"})


@pytest.mark.parametrize(
    ("target", "error", "message"),
    [
        ("my_curves:reads_a_number", ConfigError, "for ONE pixel"),
        ("my_curves:one_value", ContractError, "one value per observation"),
        ("my_curves:nothing_here", ConfigError, "not a function or an nn.Module class"),
        ("no_such_package.curves:f", ConfigError, "cannot import module"),
    ],
)
def test_a_function_that_cannot_be_fitted_is_refused_with_the_fix(
    target: str, error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        gridsolve.fit(ndvi_cube(2, 2), solve={**SOLVE, "target": target}, progress=False)


def test_the_key_covers_the_users_code(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pkg = tmp_path / "user_curves_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "helpers.py").write_text("SCALE = 1.0\n")
    (pkg / "curve.py").write_text(
        "from user_curves_pkg.helpers import SCALE\n\ndef f(t, p):\n    return p[0] * t * SCALE\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = CurvefitSolve(target="user_curves_pkg.curve:f", params=["a"], p0={"a": 1.0})
    ctx = StageContext(store=None)  # type: ignore[arg-type]
    before = curvefit_fingerprint(cfg, ctx)["code"]
    assert curvefit_fingerprint(cfg, ctx)["code"] == before
    (pkg / "helpers.py").write_text("SCALE = 2.0\n")  # an edit of a module it imports
    for name in [m for m in sys.modules if m.startswith("user_curves_pkg")]:
        del sys.modules[name]
    from gridsolve.stages.engine import versions

    versions.forget_versions()
    assert curvefit_fingerprint(cfg, ctx)["code"] != before


def test_a_function_edited_after_its_import_is_refused_not_keyed_anew(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The key would cover the new source while this process runs the old code (a
    # notebook's kernel): a later process with the new code would be served old results.
    (tmp_path / "edited_curve.py").write_text("def f(t, p):\n    return p[0] * t\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    da = ndvi_cube(2, 2)
    one = {"impl": "curvefit", "target": "edited_curve:f", "params": ["a"], "p0": {"a": 0.1}}
    first = gridsolve.fit(da, solve=one, progress=False, cache=tmp_path / "cache")
    assert first["status"].size == 4
    (tmp_path / "edited_curve.py").write_text("def f(t, p):\n    return p[0] * t + 1.0\n")
    with pytest.raises(ConfigError, match="changed after this process imported it"):
        gridsolve.fit(da, solve=one, progress=False, cache=tmp_path / "cache")
    sys.modules.pop("edited_curve")  # imported afresh: the file's code runs, keyed as it is
    again = gridsolve.fit(da, solve=one, progress=False, cache=tmp_path / "cache")
    assert not np.allclose(again["params"].values, first["params"].values, equal_nan=True)


def test_a_function_undefined_at_observed_times_is_flagged_not_refused(tmp_path: Path) -> None:
    # NaN where the data are observed: the pixel's cost is undefined, flagged; the probe
    # must not call such a function unbatchable
    da = ndvi_cube(2, 3)
    solve = {
        "impl": "curvefit",
        "target": "my_curves:undefined_before_start",
        "params": ["level", "start"],
        "p0": {"level": 0.3, "start": 40.0},
    }
    out = gridsolve.fit(da, solve=solve, progress=False)
    flags = {FIT_STATUS_FLAGS[int(s)] for s in out["status"].values.ravel()}
    assert flags == {"model_not_finite", "all_missing"}, flags
    assert np.isnan(out["params"].values).all()


def test_pixels_pooled_across_chunks_keep_the_path_of_one_fit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import torch
    from my_curves import season

    from gridsolve.stages.solve import curvefit, levmar
    from gridsolve.stages.solve.levmar import fit_batched

    da = ndvi_cube(4, 5)
    B = da.values.reshape(46, -1).T.copy()
    t = torch.arange(46, dtype=torch.float64) * 8.0
    p0 = torch.tensor(list(P0.values()), dtype=torch.float64)
    cfg = CurvefitSolve(**{**SOLVE, "chunk_pixels": 6})
    # a chunk sets its pixels aside as soon as one of them stops: most pixels are pooled,
    # some more than once, in batches of other chunks' pixels
    monkeypatch.setattr(curvefit, "POOL_BELOW", 1.0)
    joined = []
    monkeypatch.setattr(
        curvefit, "join", lambda parts: joined.append(len(parts)) or levmar.join(parts)
    )
    pooled = curvefit.fit_pixels(season, t, B, p0, cfg)
    whole = fit_batched(season, t, torch.from_numpy(B), p0).arrays()
    assert max(joined) > 1  # pixels of several chunks were iterated together
    assert set(pooled) == set(whole)
    np.testing.assert_array_equal(pooled["status"], whole["status"])
    np.testing.assert_array_equal(pooled["n_iter"], whole["n_iter"])
    np.testing.assert_array_equal(pooled["reason"], whole["reason"])
    for name in ("params", "param_stderr", "cost", "residual_rms", "covariance"):
        np.testing.assert_allclose(pooled[name], whole[name], rtol=1e-12, err_msg=name)


def test_no_pixels_give_empty_arrays_shaped_like_the_fit() -> None:
    import torch
    from my_curves import season

    from gridsolve.stages.solve import curvefit

    t = torch.arange(46, dtype=torch.float64) * 8.0
    p0 = torch.tensor(list(P0.values()), dtype=torch.float64)
    out = curvefit.fit_pixels(season, t, np.zeros((0, 46)), p0, CurvefitSolve(**SOLVE))
    n = len(P0)
    assert out["params"].shape == (0, n) and out["covariance"].shape == (0, n, n)
    assert out["status"].shape == (0,) and out["status"].dtype == np.int8


def test_batches_of_different_fits_are_not_joined() -> None:
    import torch
    from my_curves import season

    from gridsolve.stages.solve.levmar import begin, join

    t = torch.arange(46, dtype=torch.float64) * 8.0
    p0 = torch.tensor(list(P0.values()), dtype=torch.float64)
    b = torch.ones(3, 46, dtype=torch.float64)
    plain = begin(season, t, b, p0)
    weighted = begin(season, t, b, p0, weights=torch.full((46,), 2.0, dtype=torch.float64))
    assert len(join([plain, begin(season, t, b, p0)])) == 6
    with pytest.raises(ValueError, match="not of the same fit"):
        join([plain, weighted])
    with pytest.raises(ValueError, match="not of the same fit"):
        join([plain, begin(season, t, b, p0, max_iter=7)])
