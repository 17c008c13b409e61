"""Configs of the built-in implementations, one module per stage kind.

Importing a module adds its configs to :mod:`gridsolve.schemas.catalog`.
"""
