"""The ``normal_equations`` kind: factorisations of the shared design."""

from gridsolve.stages.normal_equations import contract, svd

__all__ = ["contract", "svd"]
