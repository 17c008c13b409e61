"""The ``load`` kind: open an input cube, check its contract, hash its content."""

from gridsolve.stages.load import contract, netcdf

__all__ = ["contract", "netcdf"]
