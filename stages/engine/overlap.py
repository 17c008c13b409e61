"""Outputs never replace what a run reads.

:func:`refuse_destructive_outputs` compares what a run writes (``write.path``
and the files beside it) with everything it reads (its inputs, the config
file, ``model.weights``, the cache and any input store) through links, hard
links, ``..`` and letter case, before any work; :func:`run_reads` lists the
reads for retention (``write.keep_last``), which never deletes one of them.
It sits above the storage layer (:mod:`~gridsolve.stages.engine.storage`),
which it asks to compare paths and URLs.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from gridsolve.schemas.errors import ConfigError, InputError
from gridsolve.schemas.templating import render_template
from gridsolve.stages.engine.paths import LOSS_SUFFIX, QUICKLOOK_SUFFIX, WEIGHTS_SUFFIX
from gridsolve.stages.engine.provenance import is_gridsolve_output, is_gridsolve_side_file
from gridsolve.stages.engine.storage import Location, at

if TYPE_CHECKING:
    from gridsolve.schemas.pipeline import PipelineConfig


@dataclass(frozen=True)
class Place:
    """A path a run reads or writes, with the config field it comes from (for messages)."""

    label: str
    path: str
    #: a glob pattern (local, or an object-store one that was not listed): matched, not compared
    pattern: bool = False


def run_outputs(cfg: PipelineConfig, values: Mapping[str, str] | None = None) -> list[Place]:
    """What a run of ``cfg`` writes: ``write.path`` and the files beside it.

    The quick-look picture always; the trained weights and the loss picture when
    training runs. ``values`` fill ``{placeholders}`` as the run would. A plugin
    writer without a ``path`` field writes nothing gridsolve knows of.
    """
    path = getattr(cfg.write, "path", None)
    if not isinstance(path, str):
        return []
    path = _absolute(render_template(path, values) if values else path)
    out = [Place("write.path", path)]
    if cfg.train.active:
        out.append(
            Place("the trained weights (write.path + .weights.safetensors)", path + WEIGHTS_SUFFIX)
        )
        out.append(Place("the loss picture (write.path + .loss.png)", path + LOSS_SUFFIX))
    out.append(
        Place("the quick-look picture (write.path + .quicklook.png)", path + QUICKLOOK_SUFFIX)
    )
    return out


def run_reads(
    cfg: PipelineConfig,
    config_file: str | Path | None = None,
    values: Mapping[str, str] | None = None,
) -> list[Place]:
    """What a run of ``cfg`` reads or keeps, which its outputs must never replace.

    Every input file each stage names (``load.path``, ``model.weights``, …),
    local globs expanded to the files they match now and templates filled with
    ``values``; the config file; the cache root. A local glob is also kept as
    a pattern (an output it matches would be read by the next run); an
    object-store glob stays a pattern only (listing a bucket here would cost a
    request per check).
    """
    places: list[Place] = []
    for kind, conf in cfg.stage_configs().items():
        for field, value in conf.input_files().items():
            label = f"{kind}.{field}"
            for item in [value] if isinstance(value, str) else value:
                item = render_template(item, values) if values else item
                where = _at(item)
                if not where.lists_globs:
                    places.append(Place(label, item, pattern=any(c in item for c in "*?[")))
                elif where.is_pattern():  # a folder may be named "exp[2]"
                    places += [Place(label, m) for m in where.glob(("input", InputError, None))]
                    # and the pattern: an output it does not match yet, it would next run
                    places.append(Place(label, _absolute(item), pattern=True))
                else:
                    places.append(Place(label, item))
    if config_file is not None:
        places.append(Place("the config file", _absolute(str(config_file))))
    places.append(Place("cache.root", _absolute(cfg.cache.root)))
    return places


def _at(path: str) -> Location:
    return at(path)


def _absolute(path: str) -> str:
    return _at(path).absolute()


def _above(path: str) -> list[tuple[int, int]]:
    """Identities of the existing folders above ``path`` (none for an object)."""
    return _at(path).folders_above(parent=True)


def _relation(out: Place, read: Place, above: list[tuple[int, int]]) -> str | None:
    """How ``out`` would destroy ``read`` (it resolves to, lies inside, contains it), or None.

    ``above``: the identities of the existing folders above ``out``.
    """
    mine, other = _at(out.path), _at(read.path)
    if not mine.same_kind(other):
        return None
    if read.pattern:
        return "is matched by" if mine.matched_by(other) else None
    if mine.normal() == other.normal():
        return "resolves to"
    if mine.inside(other):
        return "lies inside"
    if other.inside(mine):
        return "contains"
    # The same file under another name: a hard link, another case on a
    # case-insensitive disk, a bind mount. Only existing local files have an identity.
    here, theirs = mine.file_id(), other.file_id()
    if theirs is not None and here == theirs:
        return "is the same file as"
    if theirs is not None and theirs in above:
        return "lies inside"
    inside_out = here is not None and os.path.isdir(out.path)
    if inside_out and here in _at(os.path.dirname(os.path.abspath(read.path))).folders_above():
        return "contains"
    return None


def read_by_run(path: str, reads: Sequence[Place]) -> Place | None:
    """The first of ``reads`` that ``path`` resolves to, lies inside or contains; None if none.

    The same comparison :func:`refuse_destructive_outputs` makes (links, ``..``,
    letter case, hard links): what must survive a deletion of ``path``.
    """
    here = Place("", _absolute(path))
    above = _above(here.path)
    return next((r for r in reads if _relation(here, r, above)), None)


def _refuse_cache_in_reads(cfg: PipelineConfig, reads: Sequence[Place]) -> None:
    """ConfigError when ``cache.root`` is an input, the config file, or lies inside an input store.

    A cache root that holds an input (its parent folder) is allowed: the cache
    writes only its own entries.
    """
    cache = next(r for r in reads if r.label == "cache.root")
    here = Place("cache.root", cache.path)
    above = _above(here.path)
    for read in reads:
        if read is cache:
            continue
        rel = _relation(here, read, above)
        if rel in ("resolves to", "is the same file as", "lies inside", "is matched by"):
            raise ConfigError(
                f"cache.root {cache.path} {rel} {read.label} {read.path}: the cache would "
                "write its artifacts into what the run reads",
                stage="cache",
                fix=f"set cache.root to a folder outside {read.label} ({read.path}), e.g. "
                "a folder beside it: the cache must not be an input, the config file or lie "
                "inside an input store",
            )


def _refuse_foreign_output(cfg: PipelineConfig, outputs: list[Place]) -> None:
    """ConfigError if ``write.path``, or a file beside it the run writes, is not gridsolve's.

    The writers refuse a foreign output too, but only after every stage ran. Local
    paths only: an object store's output is checked by its writer.
    """
    main = outputs[0]
    target = _at(main.path).local
    if target is None:
        return
    ours = is_gridsolve_output(target)
    occupied = (target.is_file() and target.stat().st_size > 0) or (
        target.is_dir() and any(target.iterdir())
    )
    if occupied and not ours:
        # the writers refuse it too, but only after the stages ran: say so before any work
        raise ConfigError(
            f"write.path {main.path} exists and is not a gridsolve output (its attributes "
            "carry no gridsolve provenance): the run would replace it",
            stage=f"write/{cfg.write.impl}",
            fix="move that file or store away, or set write.path to another name",
        )
    # A side file (picture, weights) is replaced only when gridsolve wrote it: beside its
    # own output (written with it, also by versions before the mark), or carrying the
    # mark every one now has (a PNG text key, safetensors metadata), so a rerun after
    # the user deleted the output still replaces gridsolve's own pictures, and a user's
    # file at one of those names (a review found mine.nc.quicklook.png replaced) is not.
    foreign = [
        o
        for o in outputs[1:]
        if not ours and os.path.lexists(o.path) and not is_gridsolve_side_file(Path(o.path))
    ]
    if foreign:
        side = foreign[0]
        raise ConfigError(
            f"{side.label} {side.path} exists and gridsolve did not write it (it carries "
            "no gridsolve mark): the run would replace it",
            stage=f"write/{cfg.write.impl}",
            violations=[f"{o.label} {o.path} exists" for o in foreign[1:]],
            fix="move that file away, or set write.path to another name (a loss picture "
            "or weights file that gridsolve wrote before version 0.1.0's marks carries "
            "none either: delete it if it is gridsolve's)",
        )


def refuse_destructive_outputs(
    cfg: PipelineConfig,
    config_file: str | Path | None = None,
    values: Mapping[str, str] | None = None,
) -> None:
    """ConfigError, before any work, when a run of ``cfg`` would write over what it reads.

    An output (``write.path`` and the files written beside it) must not resolve
    — through symbolic or hard links, ``..`` or letter case — to an input file
    or store, the config file or a weights file the run reads, nor lie inside
    the cache root or an input store, nor contain any of them (a Zarr store is
    replaced as a whole folder); nor may ``cache.root`` be an input or the
    config file or lie inside an input store. Object-store URLs are compared as normalised
    text. Called by ``gridsolve run`` and ``validate`` and by the flow itself
    (a run triggered in the UI), so every way in is refused alike.
    """
    reads = run_reads(cfg, config_file, values)
    _refuse_cache_in_reads(cfg, reads)
    outputs = run_outputs(cfg, values)
    if not outputs:
        return
    clashes = []
    for o in outputs:
        above = _above(o.path)
        clashes += [(o, r, rel) for r in reads if (rel := _relation(o, r, above))]
    if not clashes:
        # after the clashes: a side file that is an input is named as such
        _refuse_foreign_output(cfg, outputs)
        return
    out, read, rel = clashes[0]
    what = "the run would replace it" if rel != "contains" else "the run would delete it"
    if read.label == "cache.root":
        what = "the cache's artifacts would be overwritten or deleted"
    shown = f"{out.label} {out.path}"
    if out.label != "write.path":
        shown += f" (from write.path {outputs[0].path})"
    raise ConfigError(
        f"{shown} {rel} {read.label} {read.path}: {what}",
        stage=f"write/{cfg.write.impl}",
        violations=[f"{o.label} {o.path} {x} {r.label} {r.path}" for o, r, x in clashes[1:]],
        fix=f"set write.path to another name: write.path must differ from {read.label} "
        f"({read.path}) and every other file the run reads (inputs, the config file, "
        "model.weights), and lie outside cache.root and any input Zarr store",
    )
