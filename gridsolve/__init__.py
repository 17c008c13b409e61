"""gridsolve: per-pixel least squares and per-sample gradients over data cubes, as Prefect stages.

The import names are ``gridsolve.flows``, ``gridsolve.stages`` and
``gridsolve.schemas``. Their sources stay in the repository's top-level
``flows/``, ``stages/`` and ``schemas/`` folders (the layout the product
card fixes); ``gridsolve/flows`` etc. are relative symbolic links to them, so
editable installs, wheels, mypy and pytest all see one package named
``gridsolve`` and nothing is installed under the generic names ``flows``,
``stages`` or ``schemas`` (which other projects' folders and PyPI
distributions shadow). See README, "Layout".
"""
