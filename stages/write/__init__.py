"""The ``write`` kind: the output contract written atomically."""

from gridsolve.stages.write import netcdf

__all__ = ["netcdf"]
