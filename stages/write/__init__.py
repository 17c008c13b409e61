"""The ``write`` kind: the output contract written atomically (NetCDF file or Zarr store)."""

from gridsolve.stages.write import contract

__all__ = ["contract"]
