"""The ``write`` kind: the output contract written atomically."""

from gridsolve.stages.write import contract, netcdf

__all__ = ["contract", "netcdf"]
