"""Batch independence of the per-pixel numerics: a pixel's bits do not depend on its neighbours."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from stages import linalg


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(("m", "k"), [(100, 50), (10, 50), (50, 10), (55, 50)])
def test_colmm_columns_do_not_depend_on_width_offset_or_threads(
    dtype: torch.dtype, m: int, k: int
) -> None:
    g = torch.Generator().manual_seed(m * k)
    M = torch.randn(m, k, dtype=dtype, generator=g)
    X = torch.randn(k, 9000, dtype=dtype, generator=g)
    full = linalg.colmm(M, X)
    threads = torch.get_num_threads()
    try:
        for n_threads in sorted({1, threads}):
            torch.set_num_threads(n_threads)
            spans = [(0, 1), (5, 7), (3, 1500), (1024, 5120), (777, 9000), (0, 9000), (1, 8999)]
            for start, stop in spans:
                assert torch.equal(linalg.colmm(M, X[:, start:stop]), full[:, start:stop])
    finally:
        torch.set_num_threads(threads)


def test_per_pixel_solve_does_not_depend_on_batch() -> None:
    rng = np.random.default_rng(0)
    A = torch.from_numpy(rng.standard_normal((20, 6)))
    M = torch.from_numpy(rng.random((20, 3000)) > 0.3)
    B0 = torch.where(M, torch.from_numpy(rng.standard_normal((20, 3000))), 0.0)
    W = M.double()
    full, _ = linalg.solve_per_pixel(A, B0, W, linalg.Policy("minnorm"))
    for s, e in [(0, 1), (5, 1029), (2000, 3000)]:
        part, _ = linalg.solve_per_pixel(A, B0[:, s:e], W[:, s:e], linalg.Policy("minnorm"))
        assert torch.equal(part, full[:, s:e])
