"""The ``solve`` declarations (``lstsq``, ``curvefit``): registered without importing their code.

The implementations are ``stages/solve/lstsq.py`` and ``stages/solve/curvefit.py``
(torch), imported on the first solve that runs (see
:class:`gridsolve.stages.engine.registry.Lazy`); what the plan and the cache need
before that (the contract, a pixel's memory, the user's code) lives here.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gridsolve.schemas.contracts import ArraySpec
from gridsolve.schemas.kinds.solve import CurvefitSolve, LstsqSolve
from gridsolve.schemas.metadata import CurvefitPrepared, SolvePrepared
from gridsolve.stages.engine.context import StageContext
from gridsolve.stages.engine.outputs import OutputContext, OutputVariable
from gridsolve.stages.engine.registry import Lazy, StageDecl, register

VERSION = "2"

TILE_OUTPUTS = {
    "coefficients": ArraySpec(("coef", "y", "x"), "f"),
    "residual_rms": ArraySpec(("y", "x"), "f"),
    "n_valid": ArraySpec(("y", "x"), "i"),
    "status": ArraySpec(("y", "x"), "i"),
}


def pixel_bytes(prepared: Mapping[str, Any]) -> int:
    """Memory one pixel of a tile holds here: its series, mask, weights and results."""
    meta = SolvePrepared.of(prepared)
    n_obs, coef = meta.obs, meta.coef
    # uncertainty: float64 moments and the stored results (stderr; the covariance); t and
    # p are the writer's
    extra = {"none": 0, "stderr": 5 * coef + 12, "cov": 5 * coef + 12 + 2 * coef * coef}
    # + coef: the undetermined-coefficient mask of a tile with underdetermined pixels
    return n_obs * (8 + 8 + 1) + 9 * coef + 16 + 8 * extra[meta.uncertainty]


register(
    StageDecl(
        kind="solve",
        impl="lstsq",
        version=VERSION,
        config=LstsqSolve,
        run=Lazy("gridsolve.stages.solve.lstsq:run_tile"),
        prepare=Lazy("gridsolve.stages.solve.lstsq:prepare"),
        tiled=True,
        inputs=("load", "design", "normal_equations"),
        outputs=TILE_OUTPUTS,
        pixel_bytes=pixel_bytes,
        counts="status_counts",
        summary="least squares per pixel: shared operator, gap patterns, per-pixel Cholesky",
    )
)


# ---------------------------------------------------------------- curvefit
CURVEFIT_VERSION = "1"

CURVEFIT_OUTPUTS = {
    "params": ArraySpec(("param", "y", "x"), "f"),
    "param_stderr": ArraySpec(("param", "y", "x"), "f"),
    "cost": ArraySpec(("y", "x"), "f"),
    "n_iter": ArraySpec(("y", "x"), "i"),
}


def curvefit_fingerprint(config: CurvefitSolve, ctx: StageContext) -> dict[str, str]:
    """Digest of the source of the user's function: its module and the local modules it imports."""
    from gridsolve.stages.engine.versions import user_code_digest
    from gridsolve.stages.solve.curvefit import target_object  # imports torch, as f does

    obj = target_object(config)
    return {"code": user_code_digest(obj, config.target)}


def curvefit_pixel_bytes(prepared: Mapping[str, Any]) -> int:
    """Memory one pixel of a tile holds: its series, weights and results (tile arrays)."""
    meta = SolvePrepared.of(prepared)
    n_obs, n_param = meta.obs, meta.coef
    cov = n_param * n_param if meta.uncertainty == "cov" else 0
    return n_obs * (8 + 8) + 8 * (2 * n_param + cov + 5)


def curvefit_variables(ctx: OutputContext) -> list[OutputVariable]:
    """The fitted parameters, their standard errors and covariance, the cost and iterations."""
    prepared = SolvePrepared.of(ctx.own)
    how = (
        "scaled by the residual variance cost/(n_valid - n_param), as curve_fit's pcov"
        if prepared.cov_scale == "residual"
        else "unscaled (weights taken as 1/variance of known errors, absolute_sigma=True)"
    )
    target = CurvefitPrepared.of(ctx.own.prepared).target
    return [
        OutputVariable(
            "params",
            "solve",
            "params",
            ("param", "y", "x"),
            {
                "long_name": f"fitted parameters of {target}",
                "comment": "trust a pixel only where status is converged (and its "
                "param_stderr is small): iteration_limit, stalled, singular and at_bound "
                "pixels keep their last iterate; NaN where it was not fitted at all",
            },
        ),
        OutputVariable(
            "param_stderr",
            "solve",
            "param_stderr",
            ("param", "y", "x"),
            {
                "long_name": "standard error of the fitted parameters",
                "comment": f"square root of the covariance's diagonal; covariance {how}",
            },
        ),
        OutputVariable(
            "param_cov",
            "solve",
            "param_cov",
            ("param", "param2", "y", "x"),
            {
                "long_name": "covariance of the fitted parameters",
                "comment": f"(J^T W J)^-1 at the solution, {how}; param2 indexes as param",
            },
        ),
        OutputVariable(
            "cost",
            "solve",
            "cost",
            ("y", "x"),
            {"long_name": "weighted sum of squared residuals at the solution"},
        ),
        OutputVariable(
            "n_iter",
            "solve",
            "n_iter",
            ("y", "x"),
            {"long_name": "Levenberg-Marquardt trial steps taken", "units": "1"},
        ),
    ]


register(
    StageDecl(
        kind="solve",
        impl="curvefit",
        version=CURVEFIT_VERSION,
        config=CurvefitSolve,
        run=Lazy("gridsolve.stages.solve.curvefit:run_tile"),
        prepare=Lazy("gridsolve.stages.solve.curvefit:prepare"),
        fingerprint=curvefit_fingerprint,
        tiled=True,
        inputs=("load",),
        outputs=CURVEFIT_OUTPUTS,
        pixel_bytes=curvefit_pixel_bytes,
        counts="status_counts",
        variables=curvefit_variables,
        summary="nonlinear least squares of your single-sample f(t, p) per pixel "
        "(batched Levenberg-Marquardt)",
    )
)
