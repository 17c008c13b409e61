"""gridsolve: per-pixel least squares and per-sample gradients over data cubes, as Prefect stages.

The import names are ``gridsolve.flows``, ``gridsolve.stages`` and
``gridsolve.schemas``. Their sources stay in the repository's top-level
``flows/``, ``stages/`` and ``schemas/`` folders (the layout the product
card fixes); ``gridsolve/flows`` etc. are relative symbolic links to them, so
editable installs, wheels, mypy and pytest all see one package named
``gridsolve`` and nothing is installed under the generic names ``flows``,
``stages`` or ``schemas`` (which other projects' folders and PyPI
distributions shadow). See docs/extending.md, "One import name".
"""

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gridsolve.api import config, fit
    from gridsolve.schemas.pipeline import PipelineConfig as Config

__all__ = ["Config", "config", "fit"]


def __getattr__(name: str) -> Any:
    """``fit``, ``config`` and ``Config``, imported on first use.

    ``import gridsolve`` (every CLI call does it) stays free of pydantic and xarray.
    """
    if name in ("fit", "config"):
        from gridsolve import api

        return getattr(api, name)
    if name == "Config":
        from gridsolve.schemas.pipeline import PipelineConfig

        return PipelineConfig
    raise AttributeError(f"module 'gridsolve' has no attribute {name!r}")
