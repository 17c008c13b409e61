"""Fuzz: random configs and small random cubes never raise anything but a GridsolveError, nor hang.

Cubes get NaN, inf, zero-size dims, odd dtypes and odd dim names; configs get
random (often invalid) values. Every example runs the whole stage chain
through the generic runner (no Prefect), under a time limit.
"""

from __future__ import annotations

import signal
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
import xarray as xr
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gridsolve.schemas.errors import GridsolveError
from gridsolve.schemas.pipeline import build_config
from gridsolve.stages.engine.context import StageContext
from gridsolve.stages.engine.store import Store

from testkit import Chain

DTYPES = ["float32", "float64", "int16", "uint8", "int64", "bool"]


@contextmanager
def time_limit(seconds: int) -> Iterator[None]:
    def expired(signum: int, frame: Any) -> None:
        raise TimeoutError(f"example ran past {seconds} s: a hang")

    old = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


@st.composite
def cubes(draw: Any) -> xr.Dataset:
    size = st.sampled_from([0, 1, 2, 3, 4, 5, 6, 7])  # a zero-size dim one time in eight
    n_obs, ny, nx = draw(size), min(4, draw(size)), min(4, draw(size))
    dtype = draw(st.sampled_from(DTYPES))
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    data = rng.standard_normal((n_obs, ny, nx)) * draw(st.sampled_from([1.0, 1e-30, 1e30]))
    if dtype.startswith("float") and data.size:
        mask = rng.random(data.shape)
        data[mask < draw(st.sampled_from([0.0, 0.3, 1.0]))] = np.nan
        if draw(st.booleans()):
            data[mask > 0.97] = np.inf
    with np.errstate(invalid="ignore"):
        values = data.astype(dtype) if dtype != "bool" else data > 0
    dims = draw(st.sampled_from([("time", "y", "x"), ("y", "x", "band"), ("a", "b", "c")]))
    order = {
        ("time", "y", "x"): (0, 1, 2),
        ("y", "x", "band"): (1, 2, 0),
        ("a", "b", "c"): (0, 1, 2),
    }[dims]
    coords: dict[str, Any] = {}
    obs_dim = dims[order.index(0)] if dims != ("a", "b", "c") else "a"
    if draw(st.booleans()) and n_obs:
        coords[obs_dim] = pd.date_range("2020-01-01", periods=n_obs, freq="D")
    ds = xr.Dataset(
        {"v": (dims, np.transpose(values, order) if dims == ("y", "x", "band") else values)},
        coords=coords,
    )
    if draw(st.booleans()):
        ds["extra"] = (dims[:1], np.zeros(ds.sizes[dims[0]]))
    return ds


@st.composite
def configs(draw: Any) -> dict[str, Any]:
    """Mostly valid configs (so that most examples reach the later stages), some not."""
    kind = draw(
        st.sampled_from(["polynomial"] * 3 + ["harmonic"] * 2 + ["random"] * 2 + ["variable"])
    )
    if kind == "polynomial":
        degree = draw(st.integers(0, 4))
        design, coef = {"impl": kind, "degree": degree, "scale": draw(st.booleans())}, degree + 1
    elif kind == "harmonic":
        h = draw(st.integers(1, 2))
        design, coef = {"impl": kind, "harmonics": h}, 2 + 2 * h
    elif kind == "random":
        coef = draw(st.integers(1, 9))
        design = {"impl": kind, "coef": coef}
    else:
        design, coef = {"impl": kind}, 1
    policy = draw(st.sampled_from(["minnorm", "cholesky", "ridge"]))
    solve = {
        "policy": policy,
        "ridge": 0.5 if policy == "ridge" else draw(st.sampled_from([0.0, 0.1])),
        "dtype": draw(st.sampled_from(["float32", "float64"])),
        "min_valid": draw(st.sampled_from([None, 1, 3])),
        "fallback": draw(st.sampled_from(["minnorm", "none"])),
    }
    dims = (coef, 1) if draw(st.integers(0, 9)) else (draw(st.integers(1, 3)), 2)
    model = {
        "input_dim": dims[0],
        "hidden_dim": dims[1],
        "wrt": draw(st.sampled_from(["params", "input", "both"])),
        "jacobian": draw(st.booleans()),
        "dtype": draw(st.sampled_from(["float32", "float64"])),
    }
    raw = {"design": design, "solve": solve, "model": model}
    if draw(st.integers(0, 9)) == 0:  # now and then, an invalid value somewhere
        section = draw(st.sampled_from(["design", "solve", "model"]))
        raw[section] = {**raw[section], draw(st.sampled_from(["impl", "bogus", "ridge"])): -1}
    return raw


@pytest.mark.slow  # ≥ 5 s beside a CPU hog: in CI, not in the fast tier
@settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(cubes(), configs(), st.sampled_from([None, None, None, "v", "missing"]))
def test_random_inputs_fail_only_with_clear_errors(
    ds: xr.Dataset, raw: dict[str, Any], variable: str | None
) -> None:
    with tempfile.TemporaryDirectory() as tmp, time_limit(60):
        root = Path(tmp)
        try:
            ds.to_netcdf(root / "cube.nc")
        except Exception:
            return  # xarray itself cannot write this dataset: not an input a user can have
        cfg_raw = {**raw, "load": {"path": str(root / "cube.nc"), "variable": variable}}
        cfg_raw["write"] = {"path": str(root / "out" / "out.nc")}
        try:
            cfg = build_config(cfg_raw)
            chain = Chain(StageContext(store=Store(root / "cache"), memory_budget=64 * 2**20))
            for kind in ("load", "design", "normal_equations"):
                chain.whole(kind, getattr(cfg, kind))
            chain.tiled("solve", cfg.solve)
            chain.tiled("model", cfg.model)
            chain.whole("write", cfg.write)
        except GridsolveError as err:
            text = str(err)
            assert text and "Traceback" not in text
            assert not (root / "out" / "out.nc").exists()
            assert "failed unexpectedly" not in text, text  # a StageError would be a bug
            return
        assert (root / "out" / "out.nc").is_file()
