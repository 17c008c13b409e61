"""Batch independence of the per-pixel numerics, within the stated agreement bound.

A pixel's result must not depend on its neighbours in a tile or chunk, nor on
the thread count, beyond the bound of stages/engine/agreement.py: MKL rounds a
matrix product differently with its width on some code paths (MKL_CBWR=AVX2
shows it), so equal bits are not asserted here. tests/stages/test_determinism.py
runs the same checks across emulated CPUs.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gridsolve.stages.engine.agreement import disagreements
from gridsolve.stages.solve import linalg


def _agree(part: torch.Tensor, full: torch.Tensor) -> list[str]:
    return disagreements({"x": part.numpy()}, {"x": full.numpy()})


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(("m", "k"), [(100, 50), (10, 50), (50, 10), (55, 50)])
def test_colmm_columns_do_not_depend_on_width_offset_or_threads(
    dtype: torch.dtype, m: int, k: int
) -> None:
    g = torch.Generator().manual_seed(m * k)
    M = torch.randn(m, k, dtype=dtype, generator=g)
    X = torch.randn(k, 9000, dtype=dtype, generator=g)
    full = linalg.colmm(M, X)
    oracle = (M.double() @ X.double()).to(dtype)
    assert not _agree(full, oracle)
    threads = torch.get_num_threads()
    try:
        for n_threads in sorted({1, threads}):
            torch.set_num_threads(n_threads)
            spans = [(0, 1), (5, 7), (3, 1500), (1024, 5120), (777, 9000), (0, 9000), (1, 8999)]
            for start, stop in spans:
                part = linalg.colmm(M, X[:, start:stop])
                assert not _agree(part, full[:, start:stop]), (n_threads, start, stop)
    finally:
        torch.set_num_threads(threads)


def test_per_pixel_solve_does_not_depend_on_batch() -> None:
    rng = np.random.default_rng(0)
    A = torch.from_numpy(rng.standard_normal((20, 6)))
    M = torch.from_numpy(rng.random((20, 3000)) > 0.3)
    B0 = torch.where(M, torch.from_numpy(rng.standard_normal((20, 3000))), 0.0)
    W = M.double()
    full, status = linalg.solve_per_pixel(A, B0, W, linalg.Policy("minnorm"))
    for s, e in [(0, 1), (5, 1029), (2000, 3000)]:
        part, part_status = linalg.solve_per_pixel(
            A, B0[:, s:e], W[:, s:e], linalg.Policy("minnorm")
        )
        assert torch.equal(part_status, status[s:e])
        assert not _agree(part, full[:, s:e])
    # and each pixel is its own weighted least-squares solution (numpy oracle)
    for p in (0, 1234, 2999):
        rows = M[:, p].numpy()
        expected = np.linalg.lstsq(A.numpy()[rows], B0[:, p].numpy()[rows], rcond=None)[0]
        np.testing.assert_allclose(full[:, p].numpy(), expected, rtol=1e-9, atol=1e-12)
