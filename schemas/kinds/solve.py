"""Configs of the built-in ``solve`` implementations (and the family plugins extend)."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any, ClassVar, Literal

from pydantic import ConfigDict, Field, field_validator, model_validator

from gridsolve.schemas import catalog
from gridsolve.schemas.base import StageConfig, speed_field


class SolveConfig(StageConfig):
    """Family of ``solve`` implementations."""

    kind: ClassVar[str] = "solve"


def _left_out(stages: Mapping[str, StageConfig], kind: str) -> bool:
    """Whether the run has ``kind``'s section set to ``none`` (not merely absent)."""
    conf = stages.get(kind)
    return conf is not None and not conf.active


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

    def cross_stage(self, stages: Mapping[str, StageConfig]) -> list[str]:
        """A least-squares fit needs a design and the normal equations of it."""
        problems = []
        if _left_out(stages, "design"):
            problems.append(
                "solve impl 'lstsq' fits a design, and design is none: give a design section "
                "(e.g. design: {impl: polynomial, degree: 1}), or fit a function of your own "
                "with solve: {impl: curvefit, ...}"
            )
        if _left_out(stages, "normal_equations"):
            problems.append(
                "solve impl 'lstsq' reads the normal equations, and normal_equations is none: "
                "remove the normal_equations section (default: svd)"
            )
        return problems

    @model_validator(mode="after")
    def _ridge_needs_lambda(self) -> LstsqSolve:
        if self.policy == "ridge" and self.ridge <= 0:
            raise ValueError("policy=ridge needs ridge > 0 (e.g. ridge: 1e-3)")
        if self.fallback == "ridge" and self.ridge <= 0:
            raise ValueError("fallback=ridge needs ridge > 0 (e.g. ridge: 1e-3)")
        return self


_NAME = r"^[A-Za-z_]\w*$"


class CurvefitSolve(SolveConfig):
    """Nonlinear least squares of your own single-sample function f(t, p) at every pixel.

    Batched Levenberg–Marquardt (MINPACK's lmder, as scipy's ``curve_fit(method="lm")``);
    it fits the function it is given and reads no design: a run with it has
    ``design`` and ``normal_equations`` ``none`` (the default when their sections are
    left out), and no model or training (they read linear coefficients).
    """

    model_config = ConfigDict(title="Nonlinear fit of your own function (curvefit)")

    #: sections a run with this solve does not have, and their value when left out
    implies: ClassVar[Mapping[str, str]] = {"design": "none", "normal_equations": "none"}

    impl: Literal["curvefit"] = "curvefit"
    target: str = Field(
        ...,
        description="Import path package.module:name of f(t, p) for ONE pixel: t the "
        "observation coordinates (obs,), p the parameters (param,), returning (obs,) with "
        "torch operations; or of an nn.Module class whose forward(t, p) does that.",
        pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$",
    )
    kwargs: dict[str, Any] = Field(
        default_factory=dict, description="Keyword arguments of the nn.Module's constructor."
    )
    params: list[str] = Field(
        ..., min_length=1, description="Names of the parameters, in the order f reads p."
    )
    p0: dict[str, float] = Field(
        ...,
        description="Initial guess of every parameter, by name (the same at every pixel).",
    )
    bounds: dict[str, tuple[float | None, float | None]] = Field(
        default_factory=dict,
        description="Optional [lower, upper] bounds by parameter name (null: none on that "
        "side); applied by a change of variables (MINUIT, lmfit).",
    )
    t: Literal["since_first", "coordinate", "index"] = Field(
        "since_first",
        description="What f receives as t: since_first, the observation coordinate minus its "
        "first value (days for datetimes); coordinate, the coordinate itself (datetimes: "
        "days since 1970-01-01); index, 0, 1, 2, …",
    )
    max_iter: int | None = Field(
        None,
        ge=1,
        description="Trial steps per pixel; default 100·(params + 1), as curve_fit's lm.",
    )
    xtol: float = Field(
        1.49012e-8,
        ge=0.0,
        allow_inf_nan=False,
        description="Relative step tolerance (curve_fit's).",
    )
    ftol: float = Field(
        1.49012e-8,
        ge=0.0,
        allow_inf_nan=False,
        description="Relative cost tolerance (curve_fit's).",
    )
    gtol: float = Field(
        0.0, ge=0.0, allow_inf_nan=False, description="Gradient orthogonality tolerance."
    )
    cov_scale: Literal["residual", "unscaled"] = Field(
        "residual",
        description="residual: covariance scaled by cost/(n_valid − params), curve_fit's "
        "default; unscaled: weights are 1/σ² of known errors (absolute_sigma=True).",
    )
    covariance: bool = Field(
        False, description="Also write each pixel's parameter covariance (param, param2)."
    )
    dtype: Literal["float32", "float64"] = Field(
        "float64",
        description="dtype of the results written; the fit always runs in float64.",
    )
    device: str = speed_field(
        "auto", "auto, cpu, cuda or cuda:N.", pattern=r"^(auto|cpu|cuda(:\d+)?)$"
    )
    chunk_pixels: int | None = speed_field(
        None, "Pixels fitted at once; default from the memory budget.", ge=1
    )
    compile: Literal["auto", "always", "never"] = speed_field(
        "auto",
        "torch.compile the batched Jacobian of f: auto (when the grid has at least a million "
        "pixels, where compiling pays), always, or never. A compiled Jacobian is checked "
        "against the eager one within the agreement bound, and any compile failure or "
        "disagreement falls back to eager.",
    )

    @field_validator("params")
    @classmethod
    def _names(cls, v: list[str]) -> list[str]:
        bad = [n for n in v if not re.fullmatch(_NAME, n)]
        if bad:
            raise ValueError(f"parameter names must be identifiers; not {bad}")
        if len(set(v)) != len(v):
            raise ValueError(f"parameter names must differ; got {v}")
        return v

    @model_validator(mode="after")
    def _named_everywhere(self) -> CurvefitSolve:
        problems = []
        not_finite = [n for n, v in self.p0.items() if not math.isfinite(v)]
        if not_finite:
            problems.append(f"p0 of {not_finite} is not a finite number")
        nan_bounds = [n for n, b in self.bounds.items() if any(v != v for v in b if v is not None)]
        if nan_bounds:
            problems.append(f"bounds of {nan_bounds} hold NaN: use null for no bound")
        missing = [n for n in self.params if n not in self.p0]
        if missing:
            problems.append(f"p0 lacks {missing}: give every parameter a start value")
        for what, names in (("p0", self.p0), ("bounds", self.bounds)):
            extra = [n for n in names if n not in self.params]
            if extra:
                problems.append(f"{what} names {extra}, which are not in params {self.params}")
        for name, (lo, hi) in self.bounds.items():
            start = self.p0.get(name)
            if lo is not None and hi is not None and not lo < hi:
                problems.append(f"bounds of {name!r}: lower {lo} is not below upper {hi}")
            elif start is not None and not (
                (lo is None or lo < start) and (hi is None or start < hi)
            ):
                problems.append(f"p0 of {name!r} ({start}) is not strictly inside its bounds")
        if problems:
            raise ValueError("; ".join(problems))
        return self

    def cross_stage(self, stages: Mapping[str, StageConfig]) -> list[str]:
        """No design, normal equations, model or training: curvefit fits f and nothing else."""
        out = []
        for kind, why in (
            ("design", "fits the function you name and reads no design"),
            ("normal_equations", "solves no normal equations"),
            ("model", "writes parameters, not the linear coefficients a model reads"),
            ("train", "writes parameters, not the linear coefficients training reads"),
        ):
            conf = stages.get(kind)
            if conf is not None and conf.active:
                out.append(
                    f"solve impl 'curvefit' {why}: leave the {kind} section out of the config "
                    f"file, or set it to {{impl: none}} (the UI form; on the command line "
                    f"--set '{kind}={{impl: none}}')"
                )
        return out

    def imported_modules(self) -> list[str]:
        """The module of ``target``."""
        return [self.target.partition(":")[0]]

    def bounds_arrays(self) -> tuple[list[float], list[float]]:
        """(lower, upper) per parameter in ``params`` order, ±inf where unbounded."""
        inf = float("inf")
        lo = [self.bounds.get(n, (None, None))[0] for n in self.params]
        hi = [self.bounds.get(n, (None, None))[1] for n in self.params]
        return [-inf if v is None else v for v in lo], [inf if v is None else v for v in hi]


for _builtin in (LstsqSolve, CurvefitSolve):
    catalog.add(_builtin)
