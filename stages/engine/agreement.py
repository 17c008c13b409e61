"""The reproducibility guarantee, as numbers: how closely two computations of one output agree.

gridsolve promises two things (docs/failures.md, "Determinism"):

* **Byte-identical** outputs for the same input content, config and tiling on
  the same machine (CPU code path) and library versions, across runs,
  processes and cache hits.
* **Agreement within a bound** across everything that only changes speed or
  the machine: tile size and memory budget, thread count, task runner
  (threads or Dask), and CPU code path (Intel or AMD, AVX2 or AVX-512; MKL
  picks a different kernel on each, emulated in tests with ``MKL_CBWR``).
  BLAS kernels round differently with the shape of a matrix product and the
  instructions used, so equal bits there would be luck, not a guarantee.

The bound is relative to the largest magnitude of the output variable (a
norm-wise bound, as backward-stable algorithms give): ``max|a − b| ≤ rtol ·
max|b|``. Integer outputs (status flags, valid counts) and the positions of
NaN are identical. The cache relies on this: fields that only change speed
are not part of any key, because what they change stays within the bound.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

#: Relative agreement bound per dtype of the output variable. float32: 64 ulp
#: (measured: ≤ 2.5 ulp across MKL branches, threads and tilings). float64:
#: the per-pixel solve stops refining at relative corrections of 1e-11, which
#: ill-conditioned pixels amplify (measured: ≤ 6.1e-12). Designs near the
#: float32 refusal limit (condition 1e4) can approach the float32 bound.
RTOL: dict[str, float] = {"float32": 64 * float(np.finfo(np.float32).eps), "float64": 1e-9}


def rtol_for(dtype: np.dtype) -> float:
    """The agreement bound of a floating-point dtype (float16 counts as float32)."""
    return RTOL["float64"] if np.dtype(dtype).itemsize >= 8 else RTOL["float32"]


def disagreements(a: Mapping[str, np.ndarray], b: Mapping[str, np.ndarray]) -> list[str]:
    """Every variable of ``a`` that does not agree with ``b`` within the guarantee, explained."""
    problems: list[str] = []
    for name in sorted(set(a) | set(b)):
        if name not in a or name not in b:
            problems.append(f"{name}: present in only one of the two outputs")
            continue
        x, y = np.asarray(a[name]), np.asarray(b[name])
        if x.shape != y.shape:
            problems.append(f"{name}: shapes {x.shape} and {y.shape} differ")
            continue
        if x.dtype.kind != "f" or y.dtype.kind != "f":
            if not np.array_equal(x, y):
                problems.append(f"{name}: integer values differ at {int((x != y).sum())} places")
            continue
        nan_x, nan_y = np.isnan(x), np.isnan(y)
        if not np.array_equal(nan_x, nan_y):
            problems.append(f"{name}: NaN at {int((nan_x != nan_y).sum())} different places")
            continue
        if nan_y.all():
            continue
        scale = float(np.nanmax(np.abs(y.astype(np.float64))))
        diff = float(np.nanmax(np.abs(x.astype(np.float64) - y.astype(np.float64))))
        rtol = rtol_for(np.promote_types(x.dtype, y.dtype))
        if diff > rtol * scale:
            problems.append(
                f"{name}: max |difference| {diff:.3g} exceeds {rtol:.3g} × max |value| {scale:.3g}"
            )
    return problems
