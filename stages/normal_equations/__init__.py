"""The ``normal_equations`` kind: factorisations of the shared design."""

from gridsolve.stages.normal_equations import contract

__all__ = ["contract"]
