"""Where a worker's runs may read, write and import: the variables, and the worker's defaults.

Standard library only: ``gridsolve worker`` and ``gridsolve serve`` fill the
defaults in before they start Prefect, and their supervisor stays small (it
imports no stage). The checks themselves are ``stages/engine/paths.py``'s.
"""

from __future__ import annotations

import os
from pathlib import Path

#: Where a deployment run's relative paths point (outputs, cache, inputs).
HOME_ENV = "GRIDSOLVE_HOME"
#: Folders (``:``-separated) output files and cache folders must resolve inside.
ALLOWED_ROOTS_ENV = "GRIDSOLVE_ALLOWED_ROOTS"
#: Object-store prefixes (``s3://bucket/prefix``, separated by spaces) writes may go to
#: while ``GRIDSOLVE_ALLOWED_ROOTS`` confines local writes.
ALLOWED_URLS_ENV = "GRIDSOLVE_ALLOWED_URLS"
#: Where runs may read inputs from: local folders and ``s3://bucket/prefix`` URLs,
#: separated by spaces. Unset: anywhere this worker can read.
ALLOWED_INPUTS_ENV = "GRIDSOLVE_ALLOWED_INPUTS"
#: Module prefixes ``model.target`` may name (``mypkg.models other.pkg``), separated by
#: spaces. Unset: any importable module.
ALLOWED_MODULES_ENV = "GRIDSOLVE_ALLOWED_MODULES"
#: The value of a ``GRIDSOLVE_ALLOWED_*`` variable that confines nothing.
ANYWHERE = "*"


def deployment_home() -> Path:
    """The folder of a deployment run's relative paths: ``$GRIDSOLVE_HOME``.

    Default ``~/gridsolve``. Not the worker's working directory: that is the
    code checkout `prefect deploy` recorded, and outputs and caches do not
    belong in it.
    """
    return Path(os.environ.get(HOME_ENV) or Path.home() / "gridsolve").expanduser()


def confinement_defaults(home: Path, unconfined: bool = False) -> dict[str, str]:
    """What a worker's runs are confined to where its operator set nothing.

    Runs triggered by others (a UI "Custom run") read inputs under ``home/data``,
    write outputs and caches under ``home``, and import models from gridsolve's
    own package only; no object-store URL is allowed. ``unconfined``: none of it.
    """
    if unconfined:
        return dict.fromkeys(
            (ALLOWED_ROOTS_ENV, ALLOWED_URLS_ENV, ALLOWED_INPUTS_ENV, ALLOWED_MODULES_ENV),
            ANYWHERE,
        )
    return {
        ALLOWED_ROOTS_ENV: str(home),
        ALLOWED_URLS_ENV: "",
        ALLOWED_INPUTS_ENV: str(home / "data"),
        ALLOWED_MODULES_ENV: "gridsolve",
    }


def confine(env: dict[str, str], home: Path, unconfined: bool = False) -> str:
    """Fill ``env``'s unset or empty ``GRIDSOLVE_ALLOWED_*`` with the defaults; say the result.

    Returns a line saying what runs may then do. Empty counts as unset (``VAR=``
    from a compose file's ``${VAR:-}`` would otherwise confine nothing); ``*`` is
    how an operator allows anything.
    """
    for name, value in confinement_defaults(home, unconfined).items():
        if not env.get(name, "").strip():
            env[name] = value

    def shown(name: str) -> str:
        value = env[name].strip()
        return "anywhere" if ANYWHERE in value.split() else (value or "nowhere")

    # with local writes unconfined, so are writes to buckets (ensure_allowed_url)
    roots_free = env[ALLOWED_ROOTS_ENV].strip() == ANYWHERE
    return (
        f"runs read inputs from {shown(ALLOWED_INPUTS_ENV)}, write under "
        f"{shown(ALLOWED_ROOTS_ENV)} (buckets: "
        f"{'anywhere' if roots_free else shown(ALLOWED_URLS_ENV)}), import models from "
        f"{shown(ALLOWED_MODULES_ENV)} (GRIDSOLVE_ALLOWED_*; --unconfined lifts the defaults)"
    )
