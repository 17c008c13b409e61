"""A block's uncertainty outputs: standard errors, dof, R², flags (and covariance).

:class:`_Moments` collects them path by path as pixels are solved, from the
unscaled spread of each pixel's solution operator (:func:`_shared_spread` for
the shared one) and its weighted residual and data RMS (:func:`_statistics`).
"""

from __future__ import annotations

import numpy as np

from gridsolve.schemas.contracts import ArraySpec
from gridsolve.schemas.kinds.solve import LstsqSolve
from gridsolve.stages.solve import kernel
from gridsolve.stages.solve.policy import FELL_BACK_RIDGE, SOLVED
from gridsolve.stages.solve.prepared import SharedOperator
from gridsolve.stages.solve.shared_operator import operator_spread

#: What ``uncertainty: stderr`` adds per tile (``cov`` adds ``coef_cov (coef, coef2, y, x)``).
UNCERTAINTY_OUTPUTS = {
    "coef_stderr": ArraySpec(("coef", "y", "x"), "f"),
    "dof": ArraySpec(("y", "x"), "f"),
    "r2": ArraySpec(("y", "x"), "f"),
    "uncertainty_flags": ArraySpec(("y", "x"), "i"),
}


class _Moments:
    """The uncertainty results of a block, filled path by path as pixels are solved."""

    def __init__(self, coef: int, n_px: int, config: LstsqSolve) -> None:
        self.config = config
        dtype = np.dtype(config.dtype)
        specs = dict(UNCERTAINTY_OUTPUTS)
        if config.uncertainty == "cov":
            specs["coef_cov"] = ArraySpec(("coef", "coef2", "y", "x"), "f")
        # Filled as paths solve pixels; what none fills is set once, at the end (finish).
        self.out = {
            name: np.empty(
                (*[coef for d in spec.dims if d.startswith("coef")], n_px),
                dtype if spec.kinds == "f" else np.dtype(np.int8),
            )
            for name, spec in specs.items()
        }
        self.done = np.zeros(n_px, dtype=bool)

    def put(
        self,
        idx: np.ndarray | slice,
        C: np.ndarray,
        n_valid: np.ndarray,
        status: np.ndarray,
        wrms: np.ndarray | None,
        trms: np.ndarray | None,
        var: np.ndarray,
        edf: np.ndarray | float,
        cov: np.ndarray | None,
    ) -> None:
        """Pixels ``idx``, from their stored coefficients ``C`` (coef, n), counts and status.

        With their weighted residual and data RMS and their unscaled spread;
        ``var``/``cov`` without a pixel axis are shared by all of them.
        """
        if cov is None and self._put_compiled(idx, C, n_valid, status, wrms, trms, var, edf):
            self.done[idx] = True
            return
        unknown = np.full(C.shape[1], np.nan)
        stats = _statistics(
            C,
            n_valid,
            status,
            unknown if wrms is None else wrms,
            unknown if trms is None else trms,
            var,
            edf,
            cov,
            self.config,
        )
        for name, values in stats.items():
            self.out[name][..., idx] = values
        self.done[idx] = True

    def _put_compiled(
        self,
        idx: np.ndarray | slice,
        C: np.ndarray,
        n_valid: np.ndarray,
        status: np.ndarray,
        wrms: np.ndarray | None,
        trms: np.ndarray | None,
        var: np.ndarray,
        edf: np.ndarray | float,
    ) -> bool:
        """:meth:`put` by the compiled kernel, where it applies; whether it did.

        It applies to per-pixel moments without covariance, and writes straight into
        the outputs when they are float64 and ``idx`` is a slice.
        """
        if (
            "coef_cov" in self.out
            or wrms is None
            or trms is None
            or var.ndim != 2
            or not isinstance(edf, np.ndarray)
            or kernel.name() != "c"
        ):
            return False
        p = C.shape[1]

        def rows(a: np.ndarray) -> np.ndarray:
            a = a.astype(np.float64, copy=False)
            return a if a.strides[1] == a.itemsize else np.ascontiguousarray(a)

        direct = isinstance(idx, slice) and self.out["coef_stderr"].dtype == np.float64
        names = ("coef_stderr", "dof", "r2", "uncertainty_flags")
        if direct:
            dest = {name: self.out[name][..., idx] for name in names}
        else:
            dest = {
                name: np.empty_like(self.out[name][..., :p], dtype=np.float64) for name in names
            }
            dest["uncertainty_flags"] = np.empty(p, dtype=np.int8)
        kernel.statistics(
            rows(C),
            np.ascontiguousarray(status, dtype=np.int8),
            np.ascontiguousarray(n_valid, dtype=np.int32),
            np.ascontiguousarray(wrms, dtype=np.float64),
            np.ascontiguousarray(trms, dtype=np.float64),
            rows(var),
            np.ascontiguousarray(edf, dtype=np.float64),
            self.config.policy == "ridge",
            self.config.cov_scale == "residual",
            SOLVED,
            FELL_BACK_RIDGE,
            dest,
        )
        if not direct:
            for name, values in dest.items():
                self.out[name][..., idx] = values
        return True

    def finish(self, C: np.ndarray, status: np.ndarray) -> dict[str, np.ndarray]:
        """The results of every pixel: those no path filled have NaN and their flags."""
        left = ~self.done
        if left.any():
            solved = _solved(C[:, left], status[left])
            for name, arr in self.out.items():
                if name == "uncertainty_flags":
                    # solved without a spread: not identifiable, no dof (as NaN moments give)
                    arr[left] = np.where(solved, 1 | 2, 4)
                else:
                    arr[..., left] = np.nan
        return self.out


def _shared_spread(
    op: SharedOperator, rows: np.ndarray, full: bool
) -> tuple[np.ndarray, float, np.ndarray | None]:
    """Unscaled spread of the shared operator restricted to ``rows`` (its zero-weight rows out)."""
    sw = op.sqrtw[rows]
    ident = op.identifiable if op.identifiable is not None else np.ones(op.A.shape[1], bool)
    if op.determined is not None:  # ridge's spread of a column the rows do not determine
        ident = ident & op.determined
    Pw, Aw = op.P[:, rows] / sw[None, :], op.A[rows] * sw[:, None]
    return operator_spread(Pw, Aw, ident, full)


def _solved(C: np.ndarray, status: np.ndarray) -> np.ndarray:
    solved: np.ndarray = np.isin(status, SOLVED) & np.isfinite(C).all(axis=0)
    return solved


def _statistics(
    C: np.ndarray,
    n_valid: np.ndarray,
    status: np.ndarray,
    wrms: np.ndarray,
    trms: np.ndarray,
    var: np.ndarray,
    edf: np.ndarray | float,
    cov: np.ndarray | None,
    config: LstsqSolve,
) -> dict[str, np.ndarray]:
    """Standard errors, dof, R², flags (and covariance) of pixels solved together.

    ``var`` (coef, n) or (coef,) and ``cov`` are the unscaled spread, NaN where
    a coefficient is not identifiable; the p-values are the writer's
    (``stages/solve/outputs.py`` ``p_values``).
    """
    dtype = np.dtype(config.dtype)
    solved = _solved(C, status)
    n = n_valid.astype(np.float64)
    var = var if var.ndim == 2 else var[:, None]
    with np.errstate(all="ignore"):
        dof = np.where(solved, n - edf, np.nan)
        # the effective rank is an integer unless ridge shrinks it: drop its rounding
        if config.policy != "ridge":
            whole = np.round(dof)
            exact = (np.abs(dof - whole) <= 1e-6) & (status != FELL_BACK_RIDGE)
            dof = np.where(exact, whole, dof) + 0.0  # no −0
        if config.cov_scale == "residual":
            # σ = wrms·√(n/dof), in roots so that squares of extreme data cannot overflow
            sigma = np.where(solved & (dof > 0), wrms * np.sqrt(n / dof), np.nan)
        else:
            sigma = np.where(solved, 1.0, np.nan)
        stderr = np.sqrt(var) * sigma
        r2 = np.where(solved, 1.0 - (wrms / trms) ** 2, np.nan)
    # var ≥ 0 or NaN (not identifiable): a column sum is NaN exactly where one is
    unidentified = np.isnan(var.sum(axis=0))
    flags = np.where(solved, unidentified * 1 + ~(dof > 0) * 2, 4).astype(np.int8)
    out = {
        "coef_stderr": stderr.astype(dtype, copy=False),
        "dof": dof.astype(dtype, copy=False),
        "r2": r2.astype(dtype, copy=False),
        "uncertainty_flags": flags,
    }
    if cov is not None:
        cov = cov if cov.ndim == 3 else cov[:, :, None]
        with np.errstate(all="ignore"):
            out["coef_cov"] = (cov * (sigma * sigma)).astype(dtype, copy=False)
    return out
