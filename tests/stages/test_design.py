"""Design matrices against independent formulas."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from gridsolve.schemas.errors import ContractError, InputError
from gridsolve.schemas.kinds.design import (
    HarmonicDesign,
    PolynomialDesign,
    RandomDesign,
    VariableDesign,
)
from gridsolve.schemas.kinds.load import NetCDFLoad

from testkit import Chain, make_ds


def _days(ds: Any) -> np.ndarray:
    return (ds["time"].values - np.datetime64("1970-01-01")) / np.timedelta64(1, "D")


def test_polynomial_scaled_is_vander_of_centred_time(chain: Chain, cube_path: Path) -> None:
    chain.whole("load", NetCDFLoad(path=str(cube_path)))
    art = chain.whole("design", PolynomialDesign(degree=3))
    d = _days(make_ds())
    t = (d - (d.min() + d.max()) / 2) / ((d.max() - d.min()) / 2)
    np.testing.assert_allclose(art.array("A"), np.vander(t, 4, increasing=True), rtol=0, atol=1e-14)
    assert art.meta["columns"] == ["t^0", "t^1", "t^2", "t^3"]
    assert art.meta["t_units"] == "days since 1970-01-01"
    assert art.meta["rank"] == 4 and art.meta["cond"] < 50


def test_polynomial_unscaled_uses_raw_days(chain: Chain, cube_path: Path) -> None:
    chain.whole("load", NetCDFLoad(path=str(cube_path)))
    art = chain.whole("design", PolynomialDesign(degree=1, scale=False))
    np.testing.assert_allclose(art.array("A")[:, 1], _days(make_ds()))


def test_harmonic_matches_formula(chain: Chain, cube_path: Path) -> None:
    chain.whole("load", NetCDFLoad(path=str(cube_path)))
    art = chain.whole("design", HarmonicDesign(harmonics=2, period=10.0, trend=False))
    d = _days(make_ds())
    c = (d.min() + d.max()) / 2
    w = 2 * np.pi * (d - c) / 10.0
    expected = np.stack([np.ones_like(d), np.cos(w), np.sin(w), np.cos(2 * w), np.sin(2 * w)], 1)
    np.testing.assert_allclose(art.array("A"), expected, atol=1e-12)


@pytest.mark.parametrize(
    ("freq", "harmonics", "refused", "fix"),
    [
        ("YS", 1, True, "impl: polynomial"),  # annual means cannot see the annual cycle
        ("MS", 6, True, "at most 5"),  # monthly data: harmonic 6 is at the Nyquist limit
        ("MS", 5, False, ""),
        ("D", 2, False, ""),
    ],
)
def test_harmonics_the_sampling_cannot_determine_are_refused(
    chain: Chain, write_cube: Any, freq: str, harmonics: int, refused: bool, fix: str
) -> None:
    import pandas as pd

    ds = make_ds(n_obs=48).assign_coords(time=pd.date_range("1990-01-01", periods=48, freq=freq))
    chain.whole("load", NetCDFLoad(path=str(write_cube(ds, "s.nc"))))
    if not refused:
        art = chain.whole("design", HarmonicDesign(harmonics=harmonics))
        assert art.meta["rank"] == 2 + 2 * harmonics
        return
    with pytest.raises(InputError) as err:
        chain.whole("design", HarmonicDesign(harmonics=harmonics))
    said = str(err.value)
    assert f"too far apart for harmonic {harmonics} of a 365.25-day period" in said, said
    assert fix in said, said


def test_random_is_seeded(chain: Chain, cube_path: Path) -> None:
    chain.whole("load", NetCDFLoad(path=str(cube_path)))
    a = np.array(chain.whole("design", RandomDesign(coef=7, seed=3)).array("A"))
    assert a.shape == (12, 7)
    np.testing.assert_array_equal(a, np.random.default_rng(3).standard_normal((12, 7)))


def test_variable_design_from_file(chain: Chain, write_cube: Any) -> None:
    ds = make_ds()
    A = np.random.default_rng(1).standard_normal((12, 4))
    ds["A"] = (("basis", "time"), A.T)  # stored transposed on purpose
    ds = ds.assign_coords(basis=["a", "b", "c", "d"])
    path = write_cube(ds, "d.nc")
    chain.whole("load", NetCDFLoad(path=str(path), variable="signal", design="A"))
    art = chain.whole("design", VariableDesign())
    np.testing.assert_array_equal(art.array("A"), A)
    assert art.meta["columns"] == ["a", "b", "c", "d"]


def test_generated_design_needs_numeric_obs(chain: Chain, write_cube: Any) -> None:
    ds = make_ds().assign_coords(time=[f"t{i}" for i in range(12)])
    chain.whole("load", NetCDFLoad(path=str(write_cube(ds, "s.nc"))))
    with pytest.raises(ContractError, match="numeric or datetime observation coordinate"):
        chain.whole("design", PolynomialDesign())


@pytest.mark.parametrize(
    "values",
    [
        np.array(["2021-01-01", "NaT", "2021-01-03"], dtype="datetime64[ns]"),
        np.array([0.0, np.nan, 2.0]),
        np.array([0.0, 1.0, np.inf]),
    ],
)
def test_obs_axis_refuses_non_finite_values(values: np.ndarray) -> None:
    from gridsolve.stages.design.builtin import obs_axis

    with pytest.raises(ContractError, match="needs a finite observation coordinate"):
        obs_axis(values, "design/polynomial")


def test_obs_axis_days_are_unchanged_for_valid_datetimes() -> None:
    from gridsolve.stages.design.builtin import obs_axis

    days, unit = obs_axis(np.array(["1970-01-02", "2021-01-01T12"], dtype="datetime64[ns]"), "d")
    np.testing.assert_array_equal(days, [1.0, 18628.5])
    assert unit == "days since 1970-01-01"


@pytest.mark.parametrize(
    ("times", "harmonics", "refused"),
    [
        (np.arange(40) * 365.25, 1, True),  # annual means
        (np.cumsum(np.random.default_rng(0).uniform(360, 370, 40)), 1, True),  # near-annual
        (np.arange(0, 3650, 16.0), 12, True),  # 16-day composites: 12 per year aliases
        (np.arange(0, 3650, 16.0), 11, False),
        (np.cumsum(np.random.default_rng(0).uniform(150, 300, 60)), 1, False),  # irregular
    ],
)
def test_sparse_sampling_is_refused_when_regular_and_fitted_when_its_phases_cover_the_cycle(
    times: np.ndarray, harmonics: int, refused: bool
) -> None:
    from gridsolve.stages.design.builtin import refuse_aliased

    if refused:
        with pytest.raises(InputError, match="too far apart"):
            refuse_aliased(times, 365.25, harmonics, "days since 1970-01-01")
    else:
        refuse_aliased(times, 365.25, harmonics, "days since 1970-01-01")
