"""The ``write`` kind: the output contract written atomically (NetCDF file or Zarr store)."""

from gridsolve.stages.write import contract, netcdf, zarr

__all__ = ["contract", "netcdf", "zarr"]
