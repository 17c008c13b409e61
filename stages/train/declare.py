"""The ``train`` declarations: registered without importing their code (torch).

The implementation is ``stages/train/stage.py``, imported when a training runs
(see :class:`gridsolve.stages.engine.registry.Lazy`).
"""

from __future__ import annotations

from gridsolve.schemas.kinds.train import AdamTrain, NoTrain, SGDTrain
from gridsolve.schemas.metadata import TrainMeta
from gridsolve.stages.engine.registry import Lazy, StageDecl, register, register_none

# 2: both losses at each epoch's final weights; best_epoch recorded without early stopping
VERSION = "2"


register_none(
    "train", NoTrain, VERSION, "no training: the model's weights as given (left out of the plan)"
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
            describe=lambda meta: TrainMeta.of(meta).describe(),
        )
    )
