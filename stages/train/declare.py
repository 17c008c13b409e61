"""The ``train`` declarations: registered without importing their code (torch).

The implementation is ``stages/train/stage.py``, imported when a training runs
(see :class:`gridsolve.stages.engine.registry.Lazy`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gridsolve.schemas.errors import ContractError
from gridsolve.schemas.kinds.train import AdamTrain, NoTrain, SGDTrain
from gridsolve.stages.engine.context import StageContext
from gridsolve.stages.engine.registry import Lazy, StageDecl, register
from gridsolve.stages.engine.store import StageOutput

# 2: both losses at each epoch's final weights; best_epoch recorded without early stopping
VERSION = "2"


def run_none(config: NoTrain, inputs: Mapping[str, Any], ctx: StageContext) -> StageOutput:
    """No training: never run, since a ``none`` train is left out of the plan."""
    raise ContractError(
        "train impl 'none' does not run", stage="train/none", fix="leave it to the plan"
    )


register(
    StageDecl(
        kind="train",
        impl="none",
        version=VERSION,
        config=NoTrain,
        run=run_none,
        summary="no training: the model's weights as given (left out of the plan)",
    )
)
for _impl, _cfg, _summary in (
    ("sgd", SGDTrain, "minibatch SGD with per-sample clipping, optionally DP-SGD"),
    ("adam", AdamTrain, "Adam with per-sample clipping, optionally DP noise"),
):
    register(
        StageDecl(
            kind="train",
            impl=_impl,
            version=VERSION,
            config=_cfg,
            run=Lazy("gridsolve.stages.train.stage:run"),
            inputs=("load", "solve"),
            peers=("model",),
            summary=_summary,
            describe=lambda meta: (
                f"{meta['epochs_run']} epoch(s), {meta['steps']} steps, "
                f"{meta['counts'].get('train_pixels', 0)} training pixels, "
                f"weights of epoch {meta.get('weights_epoch')} ({meta.get('weights_from')}), "
                f"last training loss "
                f"{meta['history'][-1]['train_loss'] if meta['history'] else None}"
            ),
        )
    )
