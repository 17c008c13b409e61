"""The ``normal_equations`` kind: factorisations of the shared design."""

from gridsolve.stages.normal_equations import svd

__all__ = ["svd"]
