"""The nonlinear fit's compiled Jacobian (``solve.compile``): same fit as eager, within the bound.

The compiled path changes only speed: its results are compared with the eager fit's
under the agreement guarantee (``stages/engine/agreement.py``); when compiling fails
the fit runs eager and says so; ``auto`` compiles only large grids.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

import gridsolve
from gridsolve.schemas.kinds.solve import CurvefitSolve
from gridsolve.stages.engine.agreement import disagreements
from gridsolve.stages.solve import curvefit, levmar_compiled
from gridsolve.stages.solve.levmar_compiled import FixedRows

from testkit import ndvi_cube

pytestmark = pytest.mark.usefixtures("one_torch_thread")

NAMES = ["base", "amp", "up_rate", "sos", "down_rate", "eos"]
P0 = dict(zip(NAMES, [0.2, 0.5, 0.08, 120.0, 0.07, 275.0], strict=True))
SOLVE = {"impl": "curvefit", "target": "my_curves:season", "params": NAMES, "p0": P0}


@pytest.fixture(autouse=True)
def cold() -> Iterator[None]:
    """Every test starts and ends without compiled Jacobians in the process."""
    levmar_compiled.forget_compiled()
    yield
    levmar_compiled.forget_compiled()


def test_fixed_rows_pads_small_batches_and_cuts_large_ones() -> None:
    seen: list[int] = []

    def exactly_five(u: torch.Tensor) -> torch.Tensor:
        seen.append(int(u.shape[0]))
        assert u.shape[0] == 5
        return u * 2.0 + u.sum(dim=1, keepdim=True)  # row by row, like a Jacobian

    fn = FixedRows(exactly_five, 5)
    for k in (0, 1, 4, 5, 6, 12):
        u = torch.arange(3.0 * k, dtype=torch.float64).reshape(k, 3)
        got = fn(u)
        want = u * 2.0 + u.sum(dim=1, keepdim=True)
        assert got.shape == (k, 3)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert set(seen) == {5}


def _fit(B: np.ndarray, **extra: object) -> dict[str, np.ndarray]:
    from my_curves import season

    t = torch.arange(46, dtype=torch.float64) * 8.0
    p0 = torch.tensor(list(P0.values()), dtype=torch.float64)
    config = CurvefitSolve(**{**SOLVE, **extra})
    lower = torch.full((len(NAMES),), -torch.inf, dtype=torch.float64)
    upper = torch.full((len(NAMES),), torch.inf, dtype=torch.float64)
    for name, (lo, hi) in config.bounds.items():  # as the stage's prepare stores them
        lower[NAMES.index(name)] = -torch.inf if lo is None else lo
        upper[NAMES.index(name)] = torch.inf if hi is None else hi
    return curvefit.fit_pixels(season, t, B, p0, config, bounds=(lower, upper))


def test_a_failed_compile_runs_eager_and_says_so(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def broken(*_: object) -> None:
        raise RuntimeError("inductor: no C++ compiler\nmore lines")

    monkeypatch.setattr(levmar_compiled, "compile_rows", broken)
    B = ndvi_cube(2, 3).values.reshape(46, -1).T.copy()
    with caplog.at_level(logging.WARNING, logger="gridsolve.solve"):
        got = _fit(B, compile="always")
    assert "torch.compile of the Jacobian failed, running eager" in caplog.text
    assert "RuntimeError: inductor: no C++ compiler" in caplog.text
    assert "solve.compile: never" in caplog.text  # how to skip the attempt
    want = _fit(B, compile="never")
    for name in want:  # eager after all: the same bits
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)


def test_auto_compiles_only_grids_of_a_million_pixels(monkeypatch: pytest.MonkeyPatch) -> None:
    tried: list[int] = []

    def count(eager: object, example: torch.Tensor) -> None:
        tried.append(int(example.shape[0]))
        raise RuntimeError("not compiled in this test")

    monkeypatch.setattr(levmar_compiled, "compile_rows", count)
    B = ndvi_cube(2, 3).values.reshape(46, -1).T.copy()
    _fit(B)  # auto, 6 pixels
    _fit(B, compile="never")
    assert tried == []
    monkeypatch.setattr(curvefit, "COMPILE_MIN_PIXELS", 6)
    _fit(B, chunk_pixels=4)
    assert tried == [4]  # compiled for whole chunks: the tile's last one is padded


BOUNDED = {"chunk_pixels": 4, "bounds": {"amp": [0.0, 2.0]}, "covariance": True}


def _agree(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    """Two fits of ``ndvi_cube(3, 3)`` agree within the guarantee.

    A Jacobian's last bits depend on the size of the batch it is computed in (padded
    batches are whole chunks), and so do where the two pixels without a season stop
    on their flat cost (see test_curvefit.py): those two are left out.
    """
    keep = np.ones(9, bool)
    keep[:2] = False
    assert set(got) == set(want)
    for name in want:
        a, b = got[name][keep], want[name][keep]
        if a.dtype.kind == "f":
            assert disagreements({name: a}, {name: b}) == [], name
        else:
            np.testing.assert_array_equal(a, b, err_msg=name)
    assert (want["status"][keep] == 0).sum() >= 5  # most of them converged


class Counting:
    """Stands in for the compiler: ``FixedRows`` over the eager function itself, or a
    function ``wrong`` of it; counts the batch sizes it is called on."""

    def __init__(self, wrong: Any = None, fail_after: int | None = None) -> None:
        self.sizes: list[int] = []
        self.wrong, self.fail_after = wrong, fail_after

    def __call__(self, eager: Any, example: torch.Tensor) -> FixedRows:
        def fn(u: torch.Tensor) -> torch.Tensor:
            self.sizes.append(int(u.shape[0]))
            if self.fail_after is not None and len(self.sizes) > self.fail_after:
                raise RuntimeError("out of memory on the device")
            out = eager(u)
            return out if self.wrong is None else self.wrong(out)

        return FixedRows(fn, int(example.shape[0]), eager)


def test_the_compiled_jacobians_serve_the_fit_on_padded_batches(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fake = Counting()
    monkeypatch.setattr(levmar_compiled, "compile_rows", fake)
    B = ndvi_cube(3, 3).values.reshape(46, -1).T.copy()  # 9 pixels: chunks of 4, 4 and 1
    got = _fit(B, compile="always", **BOUNDED)
    entries = list(levmar_compiled._COMPILED.values())
    assert len(entries) == 1 and entries[0][1] is not None
    jac, jac_p = entries[0][1]
    assert jac is not jac_p  # with bounds, ∂f/∂p (the covariance's) is its own function
    assert set(fake.sizes) == {4}  # the compiled graphs only ever see whole chunks
    calls = len(fake.sizes)
    want = _fit(B, compile="never", **BOUNDED)
    assert len(fake.sizes) == calls  # never is never
    _agree(got, want)


@pytest.mark.parametrize(
    ("fake", "said"),
    [
        (Counting(wrong=lambda j: j * (1 + 1e-6)), "disagrees with eager beyond the agreement"),
        (Counting(fail_after=0), "torch.compile of the Jacobian failed, running eager"),
        (Counting(fail_after=8), "failed during the fit, going on eager"),
    ],
    ids=["disagrees", "fails-on-its-first-call", "fails-later"],
)
def test_a_compiled_jacobian_that_is_wrong_or_fails_leaves_the_fit_eager(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, fake: Counting, said: str
) -> None:
    monkeypatch.setattr(levmar_compiled, "compile_rows", fake)
    B = ndvi_cube(3, 3).values.reshape(46, -1).T.copy()
    with caplog.at_level(logging.WARNING, logger="gridsolve.solve"):
        got = _fit(B, compile="always", **BOUNDED)
    assert said in caplog.text
    assert caplog.text.count(said) == 1  # said once, not per call
    want = _fit(B, compile="never", **BOUNDED)
    _agree(got, want)


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("g++") is None, reason="torch.compile needs a C++ compiler")
def test_the_compiled_fit_agrees_with_eager_within_the_bound() -> None:
    # Chunks of 16 pixels with bounds: the compiled ∂f/∂u (through the bounds' change of
    # variables) and ∂f/∂p (the covariance) are both used, on full chunks, on pooled
    # batches of fewer pixels (padded) and through the whole stage (run_tile's key).
    da = ndvi_cube(6, 8)
    solve = {**SOLVE, "chunk_pixels": 16, "bounds": {"amp": [0.0, 2.0]}, "covariance": True}
    eager = gridsolve.fit(da, solve={**solve, "compile": "never"}, progress=False)
    assert levmar_compiled._COMPILED == {}
    compiled = gridsolve.fit(da, solve={**solve, "compile": "always"}, progress=False)
    entries = list(levmar_compiled._COMPILED.values())
    assert len(entries) == 1 and entries[0][1] is not None  # compiled, checked, used
    jac, jac_p = entries[0][1]
    assert isinstance(jac, FixedRows) and jac is not jac_p and jac.size == 16
    # The two pixels without a season have a flat cost along their timing (see
    # test_curvefit.py): where a fit stops on it depends on rounding, not on the data.
    keep = np.ones((6, 8), bool)
    keep[0, :2] = False
    for name in ("params", "param_stderr", "param_cov", "cost", "residual_rms"):
        got, want = compiled[name].values[..., keep], eager[name].values[..., keep]
        assert disagreements({name: got}, {name: want}) == [], name
    for name in ("status", "n_iter", "n_valid"):
        got, want = compiled[name].values[keep], eager[name].values[keep]
        np.testing.assert_array_equal(got, want, err_msg=name)
    assert (compiled["status"].values[keep] == 0).sum() >= 40
