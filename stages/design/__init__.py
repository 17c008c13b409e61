"""The ``design`` kind: the design matrix shared by every pixel."""

from gridsolve.stages.design import builtin, contract

__all__ = ["builtin", "contract"]
