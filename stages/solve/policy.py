"""The solve's status codes, numerical tolerances and singular-system policy.

Shared by every module of its numerics (``linalg`` and the modules it runs).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from gridsolve.schemas.contracts import STATUS_CODES

EPS64 = float(np.finfo(np.float64).eps)
OK = STATUS_CODES["ok"]
ALL_MISSING = STATUS_CODES["all_missing"]
TOO_FEW = STATUS_CODES["too_few_observations"]
FELL_BACK_RIDGE = STATUS_CODES["fell_back_to_ridge"]
FELL_BACK_MINNORM = STATUS_CODES["fell_back_to_minimum_norm"]
SINGULAR = STATUS_CODES["singular"]
UNDERDETERMINED = STATUS_CODES["underdetermined"]
#: The statuses of pixels whose coefficients are finite (solved by some policy).
SOLVED = (OK, FELL_BACK_RIDGE, FELL_BACK_MINNORM, UNDERDETERMINED)

#: A design whose raw condition number is at least this gets one more refinement
#: step against the data in its own coordinates (per pixel, and the shared and
#: gap-pattern operators in lstsq); below it the step changes nothing measurable
#: (NIST's Norris, cond 9e2, gains nothing; Wampler1-5, cond 6e6, gain 2 digits in
#: the standard errors) and is skipped.
REFINE_COND = 1e6
#: A design whose column-equilibrated condition number is at least this (NIST's Filip:
#: 5e9; a raw quadratic in calendar years: 2e6) takes each pixel's variances from a QR
#: of its own rows: there float64's spread is at its limit, and the normal equations'
#: draw of it differed from QR's by up to a digit.
QR_SPREAD_COND = 1e8
#: Refinement steps of the per-pixel normal equations, and the relative size
#: of the last correction (its largest magnitude over the coefficients' largest)
#: above which a pixel goes to the SVD path instead.
REFINE_STEPS = 2
REFINE_TOL = 1e-11
#: A Cholesky pivot below this fraction of its diagonal entry means the
#: pixel's design is (nearly) rank-deficient, κ(A) ≳ 1e5: solve it by SVD.
PIVOT_TOL = 1e-10
#: A minimum-norm coefficient is identifiable when the unit vector of its column
#: lies in the row space of the pixel's design: its squared projection onto that
#: space (1 when it does) may fall short of 1 by this much (rounding, measured
#: in tests/stages/test_uncertainty.py); otherwise its uncertainty is NaN.
IDENT_TOL = 1e-6
#: The constant vector is in a design's column space when its squared distance
#: to that space is at most this fraction of its squared norm.
CONST_TOL = 1e-10


@dataclass(frozen=True)
class Policy:
    """How singular or ill-posed systems are handled (see LstsqSolve)."""

    policy: str  # minnorm | cholesky | ridge
    ridge: float = 0.0
    rcond: float | None = None
    fallback: str = "minnorm"  # minnorm | ridge | none

    def cutoff(self, rows: int, coef: int) -> float:
        """Relative singular-value cutoff (numpy.linalg.lstsq's default when unset)."""
        return self.rcond if self.rcond is not None else EPS64 * max(rows, coef)
