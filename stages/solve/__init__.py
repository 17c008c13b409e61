"""The ``solve`` kind: coefficients and diagnostics at every pixel, tile by tile."""

from gridsolve.stages.solve import contract

__all__ = ["contract"]
