"""The reporting layer's pictures of an output file, drawn without Prefect.

:mod:`.pictures` writes them beside the output and says whether one drawn before
still shows the file (no xarray, no matplotlib: a rerun whose picture is reused
imports neither); :mod:`.maps` chooses what the maps show; :mod:`.drawing` draws
them with matplotlib. ``gridsolve.flows.reporting`` publishes them as Prefect
artifacts.
"""
