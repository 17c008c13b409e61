"""The ``model`` kind: a single-sample PyTorch model at every pixel, per-sample gradients."""

from gridsolve.stages.model import contract

__all__ = ["contract"]
