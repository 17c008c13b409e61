"""The ``model`` declarations: registered without importing their code (torch).

The implementation is ``stages/model/vmapped.py`` (over building, checks, per_sample,
chunk_kernel, compiled and tile_run), imported on the first model tile or prepare
step that runs (see :class:`gridsolve.stages.engine.registry.Lazy`);
what the plan and the cache key need before that lives here.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from gridsolve.schemas.contracts import ArraySpec
from gridsolve.schemas.errors import InputError
from gridsolve.schemas.kinds.model import ModelConfig, ModuleModel, MultidimLinearModel, NoModel
from gridsolve.schemas.metadata import ModelPrepared
from gridsolve.stages.engine.context import StageContext
from gridsolve.stages.engine.hashing import file_digest
from gridsolve.stages.engine.registry import Lazy, StageDecl, register, register_none

VERSION = "2"


def _stage(config: ModelConfig) -> str:
    return f"model/{config.impl}"


def fingerprint(config: ModelConfig, ctx: StageContext) -> dict[str, str]:
    """Digests of the weights file's content and, for a user module, of its package's source.

    The weights by content (a touched or copied file is a hit; the path is not
    in the key). The user's code is the class's module and every module it
    imports, transitively, that is local or of its own package, not only the
    file defining the class.
    """
    out: dict[str, str] = {}
    if config.weights is not None:
        if not Path(config.weights).is_file():
            raise InputError(
                f"weights file not found: {config.weights}",
                stage=_stage(config),
                fix="check model.weights",
            )
        out["weights"] = file_digest(config.weights)
    if isinstance(config, ModuleModel):
        # A user's module needs torch anyway; the built-in model's key needs none.
        from gridsolve.stages.engine.versions import user_code_digest
        from gridsolve.stages.model.building import import_target

        cls = import_target(config.target, _stage(config))
        out["code"] = user_code_digest(cls, config.target)
    return out


#: Contract of every model tile (gradient and Jacobian variables depend on the model).
TILE_OUTPUTS = {
    "prediction": ArraySpec(("output", "y", "x"), "f"),
    "model_status": ArraySpec(("y", "x"), "i"),
}


def pixel_bytes(prepared: Mapping[str, Any]) -> int:
    """Memory one pixel of a tile holds here: input, outputs, gradients (and Jacobians)."""
    meta = ModelPrepared.of(prepared)
    item = np.dtype(meta.dtype).itemsize
    n_out = meta.n_out
    n_in = int(np.prod(meta.input_shape))
    n_par = sum(int(np.prod(s)) for s in meta.params.values())
    wrt = meta.wrt
    grads = (n_par if wrt in ("params", "both") else 0) + (n_in if wrt in ("input", "both") else 0)
    jac = n_out if meta.jacobian else 0
    return int(item * (n_in + n_out + grads * (1 + jac)) + 8 * n_in)


for _impl, _cfg, _summary in (
    ("multidim_linear", MultidimLinearModel, "tensordot(x, weight, 2) + bias, one sample"),
    ("module", ModuleModel, "any single-sample nn.Module by import path"),
):
    register(
        StageDecl(
            kind="model",
            impl=_impl,
            version=VERSION,
            config=_cfg,
            run=Lazy("gridsolve.stages.model.vmapped:run_tile"),
            prepare=Lazy("gridsolve.stages.model.vmapped:prepare"),
            fingerprint=fingerprint,
            tiled=True,
            inputs=("load", "design", "solve"),
            optional_inputs=("train",),
            outputs=TILE_OUTPUTS,
            pixel_bytes=pixel_bytes,
            counts="model_status_counts",
            summary=_summary,
        )
    )


register_none(
    "model",
    NoModel,
    VERSION,
    "no model: the run writes the coefficients and their uncertainty only (left out of the plan)",
)
