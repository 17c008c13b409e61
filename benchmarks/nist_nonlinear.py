"""Accuracy on NIST's certified nonlinear regressions (StRD), gridsolve beside curve_fit.

For every StRD nonlinear dataset (tests/data/nist_nonlinear: NIST's own files) and
both of NIST's starting points: gridsolve's batched Levenberg–Marquardt
(stages/solve/levmar.py, each dataset as a cube of 2 pixels, one per start) and
``scipy.optimize.curve_fit(method="lm")`` from the same start with the same
tolerances, as LRE (log relative error: correct significant digits, capped at 15,
the minimum over the parameters) of the parameters and of their standard
deviations. "reached": gridsolve's status is converged and both LREs are ≥ 6.
A scipy cell "fail" means curve_fit raised (it did not converge).

Usage: python benchmarks/nist_nonlinear.py [--tol 1e-15 | --tol default] [--readme]
(takes seconds; prints a Markdown table; --readme also writes a compact one, a row per
dataset with both starts, into README.md between its nist-nonlinear markers)
"""

from __future__ import annotations

import argparse
import math
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import nist_nonlinear

from common import into_readme, machine

README = Path(__file__).resolve().parents[1] / "README.md"


def _digits(value: float) -> str:
    """An LRE to one decimal, rounded down: 5.96 digits is not 6."""
    return f"{math.floor(value * 10) / 10:.1f}"


def _cell(value: float | None) -> str:
    return "fail" if value is None else _digits(value)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--tol",
        default=str(nist_nonlinear.TIGHT),
        help="xtol = ftol for both (a number, or 'default' for MINPACK's √eps)",
    )
    p.add_argument("--readme", action="store_true", help="also write README.md's table")
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
            f"| {_digits(r.lre_params)} | {_digits(r.lre_sd)} | {'yes' if r.reached else 'no'} "
            f"| {_cell(r.scipy_params)} | {_cell(r.scipy_sd)} |"
        )
    reached = sum(r.reached for r in rows)
    print(f"\ngridsolve reached 6 digits in {reached} of {len(rows)} fits")
    if args.readme:
        command = "python benchmarks/nist_nonlinear.py --readme"
        body = compact(rows, args.tol)
        README.write_text(into_readme(README.read_text(), "nist-nonlinear", body, command))
        print(f"wrote the table into {README}")
    return 0


def _pair(params: float | None, sd: float | None, status: str = "converged") -> str:
    """One fit's cell: digits of the parameters / of the SDs, and a status other than converged."""
    if params is None or sd is None:
        return "fail"
    return f"{_digits(params)} / {_digits(sd)}" + ("" if status == "converged" else f" ({status})")


def _scipy_reached(r: nist_nonlinear.Row) -> bool:
    return r.scipy_params is not None and min(r.scipy_params, r.scipy_sd or 0.0) >= 6


def compact(rows: list[nist_nonlinear.Row], tol: str) -> str:
    """The README's table: a row per dataset, gridsolve beside curve_fit from both starts."""
    lines = [
        f"`python benchmarks/nist_nonlinear.py` (xtol = ftol = {tol}) on "
        f"{machine()}, {time.strftime('%Y-%m-%d')}. Each cell: correct significant digits "
        "(LRE, capped at 15; the minimum over the parameters; rounded down) of the "
        "parameters / of their standard deviations; gridsolve's status where it is not `converged`; "
        "`fail`: curve_fit raised.",
        "",
        "| dataset | difficulty | start 1: gridsolve | start 1: curve_fit "
        "| start 2: gridsolve | start 2: curve_fit |",
        "|" + " --- |" * 6,
    ]
    by_name: dict[str, list[nist_nonlinear.Row]] = {}
    for r in rows:
        by_name.setdefault(r.name, []).append(r)
    for name, pair in by_name.items():
        cells = []
        for r in sorted(pair, key=lambda r: r.start):
            cells += [_pair(r.lre_params, r.lre_sd, r.status), _pair(r.scipy_params, r.scipy_sd)]
        lines.append(f"| {name} | {nist_nonlinear.DIFFICULTY[name]} | " + " | ".join(cells) + " |")
    ours = sum(r.reached for r in rows)
    theirs = sum(_scipy_reached(r) for r in rows)
    lines += [
        "",
        f"Both parameters and standard deviations to ≥ 6 digits (and, for gridsolve, status "
        f"`converged`): gridsolve {ours} of {len(rows)} fits, curve_fit {theirs} of "
        f"{len(rows)}.",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
