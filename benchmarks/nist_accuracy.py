"""Accuracy on NIST's certified linear regressions (StRD), per solve path.

For every StRD linear dataset (tests/nist_strd.py: data and certified values from
NIST's pages), the solve stage's coefficients, standard errors and R² on its three
paths, as LRE (log relative error, digits correct, capped at 15; the minimum over
the coefficients), beside Householder QR in float64 and numpy.linalg.lstsq:

* shared — every pixel has every observation: the shared operator;
* pattern — one extra observation missing at every pixel: a gap pattern common to
  the grid, solved by its own operator on exactly NIST's rows;
* per-pixel — each pixel with its own constant weights (OLS unchanged): the
  per-pixel normal equations (and whatever fallback they take).

Usage: python benchmarks/nist_accuracy.py  (prints a Markdown table; ``--check``
exits 1 when a path is more than a digit below QR)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import nist_strd

from gridsolve.schemas.kinds.solve import LstsqSolve
from gridsolve.stages.load import patterns
from gridsolve.stages.solve import block, prepared

PIXELS = 6
PATHS = ("shared", "pattern", "per_pixel")


def qr_fit(A: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray, float]:
    """Householder QR in float64: coefficients, standard errors, R² (NIST's definitions)."""
    Q, R = np.linalg.qr(A)
    c = np.linalg.solve(R, Q.T @ y)
    return c, *_stats(A, y, c, np.linalg.inv(R))


def lstsq_fit(A: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray, float]:
    """numpy.linalg.lstsq (SVD, default cutoff), with stderr from its pseudo-inverse."""
    c = np.linalg.lstsq(A, y, rcond=None)[0]
    return c, *_stats(A, y, c, np.linalg.pinv(A))


def _stats(A: np.ndarray, y: np.ndarray, c: np.ndarray, T: np.ndarray) -> tuple[np.ndarray, float]:
    # T: (XᵀX)⁻¹ = T Tᵀ (R⁻¹, or pinv(A))
    r = y - A @ c
    dof = len(y) - A.shape[1]
    se = np.sqrt(r @ r / dof * (T * T).sum(axis=1))
    spans = bool(np.allclose(A[:, 0], 1.0))
    total = ((y - y.mean()) ** 2).sum() if spans else (y * y).sum()
    return se, float(1.0 - (r @ r) / total)


def path_fit(ds: nist_strd.Dataset, path: str) -> dict[str, np.ndarray]:
    """The solve stage's results for ``ds`` replicated on PIXELS pixels along ``path``."""
    A, y = ds.design(), ds.response()
    B = np.repeat(y[:, None], PIXELS, axis=1)
    own = None
    gaps = None
    if path == "pattern":
        A = np.vstack([A, A[:1]])
        B = np.vstack([B, np.full((1, PIXELS), np.nan)])
        gaps = np.unique(patterns.pattern_hash(np.isfinite(B)))
    elif path == "per_pixel":
        own = np.repeat(np.linspace(0.5, 2.0, PIXELS)[None, :], A.shape[0], axis=0)
    config = LstsqSolve(dtype="float64", uncertainty="stderr")
    op = prepared.make_operator(A, np.ones(A.shape[0]), config)
    out = block.solve_block(B, op, config, own_weights=own, gap_patterns=gaps)
    got = dict(out.arrays)
    got["paths"] = np.array([out.meta["paths"][p] for p in PATHS])
    return got


def scores(ds: nist_strd.Dataset) -> dict[str, tuple[float, float, float, bool]]:
    """Per method: the worst LRE over pixels of coefficients, stderr and R², all pixels ok."""
    lre = nist_strd.lre
    A, y = ds.design(), ds.response()
    res: dict[str, tuple[float, float, float, bool]] = {}
    for name, fit in (("qr", qr_fit), ("lstsq", lstsq_fit)):
        c, se, r2 = fit(A, y)
        res[name] = (lre(c, ds.beta).min(), lre(se, ds.sd).min(), float(lre(r2, ds.r2)), True)
    for path in PATHS:
        got = path_fit(ds, path)
        c, se = got["coefficients"], got["coef_stderr"]
        beta, sd = np.array(ds.beta)[:, None], np.array(ds.sd)[:, None]
        on = int(got["paths"][PATHS.index(path)]) == PIXELS
        res[path] = (
            float(lre(c, beta).min()),
            float(lre(se, sd).min()),
            float(lre(got["r2"], ds.r2).min()),
            bool((got["status"] == 0).all()) and on,
        )
    return res


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="exit 1 if a path is > 1 digit below QR")
    args = p.parse_args()
    print(
        "| dataset | cond(A) | "
        + " | ".join(f"{m} coef / se / R²" for m in ("QR", "lstsq", *PATHS))
        + " | all ok |"
    )
    print("|" + " --- |" * (3 + len(PATHS) + 2))
    bad = []
    for ds in nist_strd.DATASETS:
        res = scores(ds)
        cells = ["{:.1f} / {:.1f} / {:.1f}".format(*res[m][:3]) for m in ("qr", "lstsq", *PATHS)]
        ok = all(res[m][3] for m in PATHS)
        print(
            f"| {ds.name} | {np.linalg.cond(ds.design()):.1e} | "
            + " | ".join(cells)
            + f" | {'yes' if ok else 'NO'} |"
        )
        q = res["qr"]
        for m in PATHS:
            if not res[m][3] or res[m][0] < q[0] - 1 or res[m][1] < q[1] - 1:
                bad.append(f"{ds.name}/{m}")
    if bad:
        print(f"\nbelow QR − 1 digit (or not all ok): {', '.join(bad)}")
    return 1 if (args.check and bad) else 0


if __name__ == "__main__":
    raise SystemExit(main())
