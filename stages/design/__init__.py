"""The ``design`` kind: the design matrix shared by every pixel."""

from gridsolve.stages.design import builtin

__all__ = ["builtin"]
