"""Where an output goes and whether it may: what both writers share around the write.

Before any work, a bucket output's bucket must exist, take our writes and hold
nothing that may not be replaced (:func:`check_write_target`); the writers check
every output again when they write (:meth:`Location.check_output
<gridsolve.stages.engine.storage.Location.check_output>`: a local output's folder
is made then, and only a previous gridsolve output is replaced). After writing,
the facts of what was written (size and checksum, or an object's identity) are
what a cache hit checks (:func:`still_valid`).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from gridsolve.schemas.kinds.write import NetCDFWrite, ZarrWrite
from gridsolve.schemas.metadata import WriteMeta
from gridsolve.stages.engine import storage


def free_bytes(folder: Path) -> int:
    """Bytes free to us in ``folder`` (a huge number where that cannot be known)."""
    try:
        st = os.statvfs(folder)
    except OSError:
        return 2**62
    return st.f_bavail * st.f_frsize


def check_write_target(config: Any) -> None:
    """Before any work: a bucket output's bucket exists, takes our writes, may be replaced.

    Local outputs are checked by the writer (their folder is made then; see
    :meth:`~gridsolve.stages.engine.storage.Location.precheck_output`); a plugin
    writer's config without ``path``/``overwrite`` is left to the plugin.
    """
    if isinstance(config, NetCDFWrite | ZarrWrite):
        storage.at(config.path, config.storage_options).precheck_output(
            config.overwrite, folder=isinstance(config, ZarrWrite), stage=f"write/{config.impl}"
        )


def _unchanged(facts: Mapping[str, Any]) -> bool:
    return storage.at(facts["path"], facts.get("storage_options")).unchanged(facts)


def still_valid(meta: Mapping[str, Any]) -> bool:
    """Whether the files a stored write artifact describes are still there, unchanged."""
    return _unchanged(meta) and sides_unchanged(meta)


def side_facts(
    output: str | Path, suffixes: Iterable[str], options: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """The write meta's ``side_files`` entry: facts of each ``<output><suffix>`` ({} if none).

    Each is identified as :meth:`Location.facts
    <gridsolve.stages.engine.storage.Location.facts>` does (``options``: a bucket's
    storage options).
    """
    facts = {s: storage.at(f"{output}{s}", options).facts() for s in suffixes}
    return {"side_files": facts} if facts else {}


def sides_unchanged(meta: Mapping[str, Any]) -> bool:
    """Whether the files a stored write artifact describes beside its output are unchanged."""
    return all(_unchanged(facts) for facts in WriteMeta.of(meta).side_files.values())
