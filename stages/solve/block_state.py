"""The state of a block being solved, shared by its paths.

Its inputs and settings (:class:`_Block`) and, with gaps, the results each path
fills in (:class:`_Gappy`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from gridsolve.schemas.kinds.solve import LstsqSolve
from gridsolve.stages.engine.context import resolve_device
from gridsolve.stages.solve.policy import Policy
from gridsolve.stages.solve.prepared import SharedOperator, policy_of
from gridsolve.stages.solve.uncertainty import _Moments


@dataclass
class _Block:
    """A block being solved: its inputs and settings, its status, paths taken and timings."""

    B: np.ndarray  # (obs, P)
    op: SharedOperator
    config: LstsqSolve
    dtype: np.dtype  # of the stored results
    device: torch.device
    pol: Policy
    full: bool  # the covariance is asked for
    mom: _Moments | None  # None: no uncertainty asked for
    clock: float  # when the block started (perf_counter)
    seconds: dict[str, float]
    paths: dict[str, int]
    status: np.ndarray  # (P,) int8

    @classmethod
    def start(cls, B: np.ndarray, op: SharedOperator, config: LstsqSolve) -> _Block:
        """A block of pixels ``B`` with nothing solved yet."""
        dtype = np.dtype(config.dtype)
        device = resolve_device(config.device)
        pol = policy_of(config)
        clock = time.perf_counter()
        n_px = B.shape[1]
        full = config.uncertainty == "cov"
        mom = _Moments(op.A.shape[1], n_px, config) if config.uncertainty != "none" else None
        return cls(
            B=B,
            op=op,
            config=config,
            dtype=dtype,
            device=device,
            pol=pol,
            full=full,
            mom=mom,
            clock=clock,
            seconds={"mask": 0.0, "shared": 0.0, "pattern": 0.0, "per_pixel": 0.0},
            paths={"shared": 0, "pattern": 0, "per_pixel": 0},
            status=np.zeros(n_px, dtype=np.int8),
        )


@dataclass
class _Gappy:
    """Results of a block with gaps, each pixel's set by the path that solves it.

    The coefficients of pixels no path solves are NaN (:func:`_unsolved_are_nan`).
    """

    valid: np.ndarray  # (obs, P) the observations each pixel's fit uses
    n_valid: np.ndarray  # (P,) int32
    solvable: np.ndarray  # (P,) enough valid observations
    per_pixel: np.ndarray  # (P,) left to the per-pixel path
    C: np.ndarray  # (coef, P) in the stored dtype
    rms: np.ndarray  # (P,) in the stored dtype
    #: (coef, P) the coefficients each pixel's valid rows do not determine; None: none yet
    undetermined: np.ndarray | None = None

    def mark(self, idx: np.ndarray | slice, undetermined: np.ndarray) -> None:
        """Record which coefficients of pixels ``idx`` are undetermined: (coef, n) or (coef, 1)."""
        if self.undetermined is None:
            if not undetermined.any():
                return
            self.undetermined = np.zeros(self.C.shape, dtype=bool)
        self.undetermined[:, idx] = undetermined
