"""The one generic stage runner: key, reuse or run, check, persist.

Whole stages go through :func:`run_stage`; tiled stages through
:func:`prepare_stage` once and :func:`run_tile` per tile. Each computes the
cache key, reuses a verified artifact when there is one, otherwise opens the
inputs, runs the declared function, checks its outputs against the contract
and stores them atomically. Prefect's tasks (``flows/``) call these and
nothing else; :func:`cache_key` is what their cache policy uses, so Prefect's
cache and the store agree on every key.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from schemas.artifacts import ArtifactRef, StageRun, Tile, TiledRef
from schemas.config import StageConfig
from schemas.contracts import check_arrays
from schemas.errors import GridsolveError, StageError
from stages.context import StageContext
from stages.hashing import stage_key, tile_key
from stages.registry import StageDecl, decl_for
from stages.store import Artifact, StageOutput, Store, TiledArtifact

Ref = ArtifactRef | TiledRef
PREPARE = ("prepare",)


def _name(decl: StageDecl) -> str:
    return f"{decl.kind}/{decl.impl}"


def whole_key(config: StageConfig, refs: Mapping[str, Ref], ctx: StageContext) -> str:
    """Key of a stage: kind, impl, version, result-affecting config, input keys, outside content."""
    decl = decl_for(config)
    missing = [k for k in decl.inputs if k not in refs]
    if missing:
        raise StageError(f"stage {_name(decl)} was given no input {missing}", stage=_name(decl))
    try:
        extra = dict(decl.fingerprint(config, ctx)) if decl.fingerprint else {}
    except GridsolveError as exc:
        raise exc.with_stage(_name(decl)) from None
    return stage_key(
        decl.kind,
        decl.impl,
        decl.version,
        config.key_payload(),
        {k: refs[k].key for k in decl.inputs},
        extra,
    )


def cache_key(
    config: StageConfig,
    refs: Mapping[str, Ref],
    ctx: StageContext,
    *,
    prepared: ArtifactRef | None = None,
    tile: Tile | None = None,
    prepare: bool = False,
) -> str:
    """The store key of a whole stage, a tiled stage's prepare step, or one tile."""
    if tile is not None:
        assert prepared is not None
        return tile_key(prepared.meta["_stage_key"], tile.bounds())
    key = whole_key(config, refs, ctx)
    return tile_key(key, PREPARE) if prepare else key


def reusable(store: Store, key: str, decl: StageDecl) -> Artifact | None:
    """The stored artifact for ``key`` if it is whole (and its outside output intact)."""
    status, _ = store.lookup(key)
    if status != "hit":
        return None
    art = store.get(key)
    if decl.verify is not None and not decl.verify(art.meta):
        return None
    return art


def _open(ref: Ref, store: Store) -> Artifact | TiledArtifact:
    if isinstance(ref, TiledRef):
        return TiledArtifact(
            key=ref.key,
            prepared=store.get(ref.prepared.key),
            tiles=[(t.tile, store.get(t.key)) for t in ref.tiles if t.tile is not None],
        )
    return store.get(ref.key)


def _call(decl: StageDecl, fn: Any, *args: Any) -> StageOutput:
    try:
        out = fn(*args)
    except GridsolveError as exc:
        raise exc.with_stage(_name(decl)) from None
    except OSError as exc:
        raise StageError(
            f"input/output failed: {type(exc).__name__}: {exc}",
            stage=_name(decl),
            fix="check the files and folders the run uses; the task is retried once",
            transient=True,
        ) from exc
    except MemoryError as exc:
        raise StageError(
            "ran out of memory",
            stage=_name(decl),
            fix="lower execution.memory_budget (smaller tiles) or the stage's chunk_pixels",
        ) from exc
    except Exception as exc:
        raise StageError(
            f"failed unexpectedly: {type(exc).__name__}: {exc}",
            stage=_name(decl),
            fix="this is likely a bug in the stage; rerun with `gridsolve --debug run …` "
            "for the traceback and report it",
        ) from exc
    if not isinstance(out, StageOutput):
        raise StageError(f"returned {type(out).__name__}, not a StageOutput", stage=_name(decl))
    return out


def _info(
    decl: StageDecl, config: StageConfig, refs: Mapping[str, Ref], part: str
) -> dict[str, Any]:
    return {
        "kind": decl.kind,
        "impl": decl.impl,
        "version": decl.version,
        "part": part,
        "config": config.key_payload(),
        "inputs": {k: refs[k].key for k in decl.inputs if k in refs},
    }


def _result(
    decl: StageDecl,
    key: str,
    art: Artifact,
    store: Store,
    t0: float,
    hit: bool,
    *,
    tile: Tile | None = None,
    extra_meta: Mapping[str, Any] | None = None,
    pixels: int = 0,
) -> StageRun:
    ref = ArtifactRef(
        kind=decl.kind,
        impl=decl.impl,
        key=key,
        root=str(store.root),
        tile=tile,
        meta={**art.meta, **(extra_meta or {})},
    )
    return StageRun(ref=ref, hit=hit, seconds=time.perf_counter() - t0, pixels=pixels)


def run_stage(
    config: StageConfig, refs: Mapping[str, Ref], ctx: StageContext, *, use_cache: bool = True
) -> StageRun:
    """Run (or reuse) a whole, untiled stage."""
    t0 = time.perf_counter()
    decl = decl_for(config)
    key = cache_key(config, refs, ctx)
    art = reusable(ctx.store, key, decl) if use_cache else None
    if art is not None:
        return _result(decl, key, art, ctx.store, t0, True)
    inputs = {k: _open(refs[k], ctx.store) for k in decl.inputs}
    ctx.key = key
    out = _call(decl, decl.run, config, inputs, ctx)
    if decl.outputs:
        check_arrays(_name(decl), out.arrays, decl.outputs)
    art = ctx.store.put(key, out, _info(decl, config, refs, "whole"))
    return _result(decl, key, art, ctx.store, t0, False)


def prepare_stage(
    config: StageConfig, refs: Mapping[str, Ref], ctx: StageContext, *, use_cache: bool = True
) -> StageRun:
    """Run (or reuse) the once-per-stage part of a tiled stage."""
    t0 = time.perf_counter()
    decl = decl_for(config)
    if not decl.tiled or decl.prepare is None:
        raise StageError(f"{_name(decl)} is not a tiled stage", stage=_name(decl))
    stage = whole_key(config, refs, ctx)
    key = tile_key(stage, PREPARE)
    art = reusable(ctx.store, key, decl) if use_cache else None
    hit = art is not None
    if art is None:
        inputs = {k: _open(refs[k], ctx.store) for k in decl.inputs}
        ctx.key = key
        out = _call(decl, decl.prepare, config, inputs, ctx)
        art = ctx.store.put(key, out, _info(decl, config, refs, "prepare"))
    return _result(decl, key, art, ctx.store, t0, hit, extra_meta={"_stage_key": stage})


def run_tile(
    config: StageConfig,
    refs: Mapping[str, Ref],
    prepared: ArtifactRef,
    tile: Tile,
    ctx: StageContext,
    *,
    use_cache: bool = True,
) -> StageRun:
    """Run (or reuse) one tile of a tiled stage; tiled inputs are given as this tile's refs."""
    t0 = time.perf_counter()
    decl = decl_for(config)
    key = cache_key(config, refs, ctx, prepared=prepared, tile=tile)
    art = reusable(ctx.store, key, decl) if use_cache else None
    if art is not None:
        return _result(decl, key, art, ctx.store, t0, True, tile=tile, pixels=tile.pixels)
    inputs = {k: _open(refs[k], ctx.store) for k in decl.inputs}
    ctx.key = key
    out = _call(decl, decl.run, config, inputs, ctx.store.get(prepared.key), tile, ctx)
    if decl.outputs:
        ny, nx = tile.shape
        check_arrays(_name(decl), out.arrays, decl.outputs, {"y": ny, "x": nx})
    art = ctx.store.put(
        key, out, {**_info(decl, config, refs, "tile"), "tile": list(tile.bounds())}
    )
    return _result(decl, key, art, ctx.store, t0, False, tile=tile, pixels=tile.pixels)
