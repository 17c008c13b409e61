"""The ``train`` kind: the model's weights fitted to ``load.target``, one pixel one sample."""

from gridsolve.stages.train import contract

__all__ = ["contract"]
