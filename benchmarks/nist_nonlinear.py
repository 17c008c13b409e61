"""Accuracy on NIST's certified nonlinear regressions (StRD), gridsolve beside curve_fit.

For every StRD nonlinear dataset (tests/data/nist_nonlinear: NIST's own files) and
both of NIST's starting points: gridsolve's batched Levenberg–Marquardt
(stages/solve/levmar.py, each dataset as a cube of 2 pixels, one per start) and
``scipy.optimize.curve_fit(method="lm")`` from the same start with the same
tolerances, as LRE (log relative error: correct significant digits, capped at 15,
the minimum over the parameters) of the parameters and of their standard
deviations. "reached": gridsolve's status is converged and both LREs are ≥ 6.
A scipy cell "fail" means curve_fit raised (it did not converge).

Usage: python benchmarks/nist_nonlinear.py [--tol 1e-15 | --tol default]
(takes seconds; prints a Markdown table)
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import nist_nonlinear


def _cell(value: float | None) -> str:
    return "fail" if value is None else f"{value:.1f}"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--tol",
        default=str(nist_nonlinear.TIGHT),
        help="xtol = ftol for both (a number, or 'default' for MINPACK's √eps)",
    )
    args = p.parse_args()
    tol = None if args.tol == "default" else float(args.tol)
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    print(f"xtol = ftol = {args.tol}\n")
    print(
        "| dataset | difficulty | start | gridsolve status | params LRE | SD LRE | reached "
        "| curve_fit params LRE | curve_fit SD LRE |"
    )
    print("|" + " --- |" * 9)
    rows = nist_nonlinear.table(tol)
    for r in rows:
        print(
            f"| {r.name} | {nist_nonlinear.DIFFICULTY[r.name]} | {r.start} | {r.status} "
            f"| {r.lre_params:.1f} | {r.lre_sd:.1f} | {'yes' if r.reached else 'no'} "
            f"| {_cell(r.scipy_params)} | {_cell(r.scipy_sd)} |"
        )
    reached = sum(r.reached for r in rows)
    print(f"\ngridsolve reached 6 digits in {reached} of {len(rows)} fits")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
