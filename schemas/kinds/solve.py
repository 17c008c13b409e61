"""Configs of the built-in ``solve`` implementations (and the family plugins extend)."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import ConfigDict, Field, model_validator

from gridsolve.schemas import catalog
from gridsolve.schemas.base import StageConfig, speed_field


class SolveConfig(StageConfig):
    """Family of ``solve`` implementations."""

    kind: ClassVar[str] = "solve"


Policy = Literal["minnorm", "cholesky", "ridge"]


class LstsqSolve(SolveConfig):
    """Least squares at every pixel, shared factorisation or per-pixel when data are missing."""

    model_config = ConfigDict(title="Least-squares solve")

    impl: Literal["lstsq"] = "lstsq"
    policy: Policy = Field(
        "minnorm",
        description="minnorm: minimum-norm solution by SVD with a cutoff (right when coef > obs); "
        "cholesky: error if the system is singular; ridge: add ridge·I.",
    )
    ridge: float = Field(
        0.0, ge=0.0, description="Ridge λ ≥ 0 (used by policy=ridge and fallback=ridge)."
    )
    rcond: float | None = Field(
        None,
        ge=0.0,
        lt=1.0,
        description="Relative singular-value cutoff for minnorm; default eps·max(obs, coef).",
    )
    min_valid: int | None = Field(
        None,
        ge=1,
        description="Fewest valid observations for a pixel to be solved; "
        "default coef for cholesky, 1 for minnorm and ridge.",
    )
    fallback: Literal["minnorm", "ridge", "none"] = Field(
        "minnorm",
        description="For a pixel whose own factorisation fails: solve it this way (flagged), "
        "or none (NaN, flagged singular).",
    )
    dtype: Literal["float32", "float64"] = Field(
        "float32",
        description="dtype of the data product and of the coefficients written; "
        "factorisations are always float64.",
    )
    uncertainty: Literal["none", "stderr", "cov"] = Field(
        "none",
        description="Per-pixel uncertainty of the coefficients: none; stderr (standard errors, "
        "t-statistics, two-sided p-values, degrees of freedom, R²); or cov (also the full "
        "coefficient covariance). Not identifiable coefficients (minimum norm on a "
        "rank-deficient design) get NaN.",
    )
    cov_scale: Literal["residual", "unscaled"] = Field(
        "residual",
        description="residual: scale the covariance by the residual variance Σw·r²/dof "
        "(statsmodels OLS/WLS, numpy.polyfit cov=True); unscaled: weights are 1/σ² of known "
        "errors, no scaling (numpy's cov='unscaled'), p-values from the normal distribution.",
    )
    device: str = speed_field(
        "auto", "auto, cpu, cuda or cuda:N.", pattern=r"^(auto|cpu|cuda(:\d+)?)$"
    )
    chunk_pixels: int | None = speed_field(
        None, "Pixels per batched chunk; default from the memory budget.", ge=1
    )

    @model_validator(mode="after")
    def _ridge_needs_lambda(self) -> LstsqSolve:
        if self.policy == "ridge" and self.ridge <= 0:
            raise ValueError("policy=ridge needs ridge > 0 (e.g. ridge: 1e-3)")
        if self.fallback == "ridge" and self.ridge <= 0:
            raise ValueError("fallback=ridge needs ridge > 0 (e.g. ridge: 1e-3)")
        return self


for _builtin in (LstsqSolve,):
    catalog.add(_builtin)
