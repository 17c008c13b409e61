"""Residual RMS without overflow or underflow, against float64 numpy."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gridsolve.stages.solve.columns import column_rms, stable_sum


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("scale", [1e20, 1e-20, 1e-30, 1e-40, 3e37])
def test_column_rms_at_extreme_scales(dtype: torch.dtype, scale: float) -> None:
    R = torch.from_numpy(np.random.default_rng(0).standard_normal((50, 300)) * scale).to(dtype)
    ref = np.sqrt((R.numpy().astype(np.float64) ** 2).mean(axis=0))  # float64: no overflow here
    got = column_rms(R, 50).numpy()
    subnormal = dtype == torch.float32 and scale < 1.2e-38  # the data keep fewer digits
    np.testing.assert_allclose(got, ref, rtol=1e-3 if subnormal else 1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_column_rms_is_the_plain_formula_bit_for_bit_in_normal_ranges(dtype: torch.dtype) -> None:
    R = torch.from_numpy(np.random.default_rng(1).standard_normal((40, 500)) * 3.7).to(dtype)
    plain = torch.sqrt(stable_sum(R * R) / 40)
    assert torch.equal(column_rms(R, 40), plain)


def test_column_rms_edge_columns() -> None:
    R = torch.tensor([[0.0, np.nan, np.inf, 1e300], [0.0, 1.0, 1.0, -1e300]], dtype=torch.float64)
    got = column_rms(R, 2).numpy()
    assert got[0] == 0.0 and np.isnan(got[1]) and np.isinf(got[2])
    np.testing.assert_allclose(got[3], 1e300, rtol=1e-15)
    assert column_rms(R[:0], 1).tolist() == [0.0] * 4
