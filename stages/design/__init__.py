"""The ``design`` kind: the design matrix shared by every pixel."""

from gridsolve.stages.design import contract

__all__ = ["contract"]
