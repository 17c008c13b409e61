"""The variables the ``model`` kind writes: prediction, status, per-sample gradients, Jacobians.

Declared once here (``KindContract.variables``); the gradient and Jacobian
variables follow the model's parameters (its prepared metadata). No torch:
writing a cached run imports none.
"""

from __future__ import annotations

from gridsolve.schemas.contracts import MODEL_STATUS_FLAGS
from gridsolve.schemas.metadata import ModelPrepared
from gridsolve.stages.engine.outputs import OutputContext, OutputVariable, flag_attrs


def variables(ctx: OutputContext) -> list[OutputVariable]:
    """Every variable the model writes (those of optional arrays the run did not make too)."""
    m = ModelPrepared.of(ctx.own)
    # a model that makes no gradients need not say what they are of
    obj = "sum of outputs" if m.objective == "sum" else "mean squared error against the target"
    out = [
        OutputVariable(
            "prediction",
            "model",
            "prediction",
            ("output", "y", "x"),
            # the model declares no units
            {"long_name": "model output per pixel", "units": "1"},
        ),
        OutputVariable(
            "model_status",
            "model",
            "model_status",
            ("y", "x"),
            flag_attrs("model stage status", MODEL_STATUS_FLAGS),
        ),
    ]
    kind_word = {"grad": "gradient", "jac": "Jacobian"}
    for kind, label in (
        ("grad", "per-sample gradient"),
        ("jac", "per-sample Jacobian of the outputs"),
    ):
        lead = ("output",) if kind == "jac" else ()
        of = f" of the {obj}" if kind == "grad" else ""
        for name, named in m.param_dims.items():
            # A parameter dim named like the Jacobian's own (the bias's "output")
            # gets a name of its own: one dim may not appear twice in a variable.
            dims = tuple(f"{d}_wrt" if d in lead else d for d in named)
            out.append(
                OutputVariable(
                    f"{kind}_{name.replace('.', '_')}",
                    "model",
                    f"{kind}:{name}",
                    (*lead, *dims, "y", "x"),
                    {
                        "long_name": f"per-sample {kind_word[kind]} wrt a model parameter",
                        "comment": f"{label} with respect to parameter {name}{of}",
                        "parameter": name,
                        "units": "1",
                    },
                )
            )
        if m.input_dims is None:
            continue
        out.append(
            OutputVariable(
                f"{kind}_input",
                "model",
                f"{kind}:input",
                (*lead, *m.input_dims, "y", "x"),
                {
                    "long_name": f"per-sample {kind_word[kind]} wrt the model input",
                    "comment": f"{label} with respect to the input (the coefficients){of}",
                    "units": "1",
                },
            )
        )
    return out
