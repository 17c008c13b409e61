"""The ``load`` kind: open an input cube, check its contract, hash its content."""

from gridsolve.stages.load import contract

__all__ = ["contract"]
