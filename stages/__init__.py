"""Stage kinds and their implementations: plain functions, no Prefect.

Importing this package registers the built-in implementations.
"""

from gridsolve.stages import design, load, model, normal_equations, solve, write

__all__ = ["design", "load", "model", "normal_equations", "solve", "write"]
