"""The one generic stage runner: key, reuse or run, check, persist.

Whole stages go through :func:`run_stage`; tiled stages through
:func:`prepare_stage` once and :func:`run_tile` per tile. Each computes the
cache key, reuses a verified artifact when there is one, otherwise opens the
inputs, runs the declared function, checks its outputs against the contract
and stores them atomically. Prefect's tasks (``flows/``) call these and
nothing else; :func:`cache_key` is what their cache policy uses, so Prefect's
cache and the store agree on every key.

A key covers the stage's config, its inputs' keys, the content of the outside
files it reads, the source of the code it runs (:func:`code_version`) and the
versions of the libraries that can change numbers. Where a stage read its
files this run (paths, file identity) is per-run metadata attached to its ref
(:func:`source_meta`), never part of a key or of the stored artifact: a touched
or copied input with the same content is a hit, and the run still knows, and
records, the path it used.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from gridsolve.schemas.artifacts import ArtifactRef, StageRun, Tile, TiledRef
from gridsolve.schemas.base import StageConfig
from gridsolve.schemas.contracts import check_arrays
from gridsolve.schemas.errors import GridsolveError, StageError
from gridsolve.stages.engine.context import StageContext
from gridsolve.stages.engine.contract import check as check_contract
from gridsolve.stages.engine.contract import contract_of
from gridsolve.stages.engine.hashing import canonical_json, stage_key, tile_key
from gridsolve.stages.engine.registry import SOURCE, Lazy, StageDecl, decl_for
from gridsolve.stages.engine.store import Artifact, StageOutput, Store, TiledArtifact
from gridsolve.stages.engine.timing import Clock
from gridsolve.stages.engine.versions import code_digest, package_versions

Ref = ArtifactRef | TiledRef
PREPARE = ("prepare",)


def _name(decl: StageDecl) -> str:
    return f"{decl.kind}/{decl.impl}"


def code_roots(decl: StageDecl) -> set[str]:
    """The modules whose code (with what they import) a stage implementation's key covers.

    The modules defining its functions (tile reads included) and config, and the
    runner; for a writer, also those describing its inputs' outputs.
    """
    # A writer's: how the kinds it reads describe their results in the output file (the
    # file depends on it; their arrays, hence their own keys, do not).
    read = (*decl.inputs, *decl.optional_inputs) if decl.writes_outputs else ()
    described = [c for c in map(contract_of, read) if c is not None]
    fns = (
        decl.run,
        decl.prepare,
        decl.fingerprint,
        decl.verify,
        decl.locate,
        decl.read_block,
        decl.config,
        decl.variables,
        *(c.variables for c in described),
        *(c.extends for c in described),
    )
    roots = {getattr(f, "__module__", None) for f in fns if f is not None}
    return {__name__, *(r for r in roots if r)}


def code_version(decl: StageDecl) -> str:
    """Digest of the source of the code a stage implementation runs.

    The modules of :func:`code_roots`, with what they import (see
    ``stages/engine/versions.py``). Read from disk when a file's size or mtime
    changed, so an edited stage gets new keys.
    """
    return code_digest(code_roots(decl))


def reads(decl: StageDecl, refs: Mapping[str, Ref]) -> tuple[str, ...]:
    """The kinds a stage reads given the refs at hand: its inputs, and its optional ones present."""
    return (*decl.inputs, *(k for k in decl.optional_inputs if k in refs))


def _peer_parts(decl: StageDecl, ctx: StageContext) -> dict[str, str]:
    """Key entries for the configs of other kinds the stage reads (``StageDecl.peers``)."""
    out: dict[str, str] = {}
    for k in decl.peers:
        peer = ctx.peers.get(k)
        if peer is None:
            raise StageError(
                f"stage {_name(decl)} reads the {k} config, and none was given",
                stage=_name(decl),
                fix="run it through the plan (build_plan), which passes the peers",
            )
        peer_decl = decl_for(peer)
        fp = dict(peer_decl.fingerprint(peer, ctx)) if peer_decl.fingerprint else {}
        out[f"peer:{k}"] = canonical_json(
            {"impl": peer.impl, "config": peer.peer_payload(), "fingerprint": fp}
        )
    return out


def _sources(ref: Ref) -> dict[str, Any]:
    meta = ref.prepared.meta if isinstance(ref, TiledRef) else ref.meta
    return dict(meta.get(SOURCE) or {})


def whole_key(config: StageConfig, refs: Mapping[str, Ref], ctx: StageContext) -> str:
    """Key of a stage: kind, impl, version, config, input keys, outside content, code, libraries."""
    return _key_and_code(config, refs, ctx)[0]


def _key_and_code(
    config: StageConfig, refs: Mapping[str, Ref], ctx: StageContext
) -> tuple[str, str]:
    """The stage's key and the digest of its code (which the key covers)."""
    decl = decl_for(config)
    missing = [k for k in decl.inputs if k not in refs]
    if missing:
        raise StageError(f"stage {_name(decl)} was given no input {missing}", stage=_name(decl))
    try:
        extra = dict(decl.fingerprint(config, ctx)) if decl.fingerprint else {}
        extra.update(_peer_parts(decl, ctx))
    except GridsolveError as exc:
        raise exc.with_stage(_name(decl)) from None
    if decl.records_sources:
        # Its output names the files its inputs were read from this run.
        for k in reads(decl, refs):
            paths = _sources(refs[k]).get("paths")
            if paths:
                extra[f"{SOURCE}:{k}"] = canonical_json(paths)
    code = code_version(decl)
    key = stage_key(
        decl.kind,
        decl.impl,
        decl.version,
        config.key_payload(),
        {k: refs[k].key for k in reads(decl, refs)},
        extra,
        code=code,
        libraries=package_versions(),
    )
    return key, code


def source_meta(config: StageConfig, ctx: StageContext) -> dict[str, Any]:
    """Per-run facts about the outside files a stage reads: their paths, and its ``locate``'s."""
    decl = decl_for(config)
    out: dict[str, Any] = {}
    paths = config.input_files()
    if paths:
        out["paths"] = paths
    if decl.locate is not None:
        try:
            out.update(decl.locate(config, ctx))
        except GridsolveError as exc:
            raise exc.with_stage(_name(decl)) from None
    return out


def with_sources(config: StageConfig, run: StageRun, ctx: StageContext) -> StageRun:
    """``run`` with its ref's per-run source facts taken from this run.

    A result that Prefect returns from its cache carries the facts of the run
    that made it (another path, an older mtime); the flow passes every whole
    stage's and prepare step's result through this before later stages use it.
    """
    src = source_meta(config, ctx)
    meta = {k: v for k, v in run.ref.meta.items() if k != SOURCE}
    if src:
        meta[SOURCE] = src
    return run.model_copy(update={"ref": run.ref.model_copy(update={"meta": meta})})


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


def _with_source(art: Artifact, ref: ArtifactRef) -> Artifact:
    """The stored artifact plus this run's source facts from its ref (stored meta has none)."""
    src = ref.meta.get(SOURCE)
    if src:
        art.meta = {**art.meta, SOURCE: src}
    return art


def _open(ref: Ref, store: Store) -> Artifact | TiledArtifact:
    if isinstance(ref, TiledRef):
        return TiledArtifact(
            key=ref.key,
            prepared=_with_source(store.get(ref.prepared.key), ref.prepared),
            tiles=[(t.tile, store.get(t.key)) for t in ref.tiles if t.tile is not None],
        )
    return _with_source(store.get(ref.key), ref)


def _work(decl: StageDecl) -> str:
    """The phase a stage's own function is counted in: reading the cube, writing, computing."""
    if decl.read_block is not None:
        return "read"
    return "write" if decl.writes_outputs else "compute"


def _call(decl: StageDecl, fn: Any, *args: Any, clock: Clock | None = None) -> StageOutput:
    clock = clock or Clock()
    try:
        if isinstance(fn, Lazy):
            with clock.phase("setup"):  # importing the implementation's modules
                fn = fn.resolve()
        with clock.phase(_work(decl)):
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


def _check(
    decl: StageDecl, part: str, out: StageOutput, sizes: Mapping[str, int] | None = None
) -> None:
    """The kind's contract, then the implementation's own declared outputs."""
    contract = contract_of(decl.kind)
    if contract is not None:
        check_contract(_name(decl), contract, part, out.arrays, out.meta, sizes)
    if decl.outputs and part != "prepare":
        check_arrays(_name(decl), out.arrays, decl.outputs, sizes)


def _info(
    decl: StageDecl, config: StageConfig, refs: Mapping[str, Ref], part: str, code: str = ""
) -> dict[str, Any]:
    info = {
        "kind": decl.kind,
        "impl": decl.impl,
        "version": decl.version,
        "part": part,
        "config": config.key_payload(),
        "inputs": {k: refs[k].key for k in reads(decl, refs)},
    }
    if part != "tile":  # a tile's stage key already covers them
        info["code"] = code
        info["libraries"] = package_versions()
    return info


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
    clock: Clock | None = None,
) -> StageRun:
    ref = ArtifactRef(
        kind=decl.kind,
        impl=decl.impl,
        key=key,
        root=store.location,
        tile=tile,
        meta={**art.meta, **(extra_meta or {})},
    )
    return StageRun(
        ref=ref,
        hit=hit,
        seconds=time.perf_counter() - t0,
        pixels=pixels,
        phases=clock.rounded() if clock is not None else {},
    )


def run_stage(
    config: StageConfig, refs: Mapping[str, Ref], ctx: StageContext, *, use_cache: bool = True
) -> StageRun:
    """Run (or reuse) a whole, untiled stage."""
    t0 = time.perf_counter()
    clock = Clock()
    decl = decl_for(config)
    with clock.phase("key"):
        key, code = _key_and_code(config, refs, ctx)
        src = source_meta(config, ctx)
    run_meta = {SOURCE: src} if src else None
    with clock.phase("lookup"):
        art = reusable(ctx.store, key, decl) if use_cache else None
    if art is not None:
        return _result(decl, key, art, ctx.store, t0, True, extra_meta=run_meta, clock=clock)
    with clock.phase("open"):
        inputs = {k: _open(refs[k], ctx.store) for k in reads(decl, refs)}
    ctx.key = key
    out = _call(decl, decl.run, config, inputs, ctx, clock=clock)
    with clock.phase("check"):
        _check(decl, "whole", out)
    with clock.phase("store"):
        art = ctx.store.put(key, out, _info(decl, config, refs, "whole", code))
    return _result(decl, key, art, ctx.store, t0, False, extra_meta=run_meta, clock=clock)


def prepare_stage(
    config: StageConfig, refs: Mapping[str, Ref], ctx: StageContext, *, use_cache: bool = True
) -> StageRun:
    """Run (or reuse) the once-per-stage part of a tiled stage."""
    t0 = time.perf_counter()
    clock = Clock()
    decl = decl_for(config)
    if not decl.tiled or decl.prepare is None:
        raise StageError(f"{_name(decl)} is not a tiled stage", stage=_name(decl))
    with clock.phase("key"):
        stage, code = _key_and_code(config, refs, ctx)
        key = tile_key(stage, PREPARE)
    with clock.phase("lookup"):
        art = reusable(ctx.store, key, decl) if use_cache else None
    hit = art is not None
    if art is None:
        with clock.phase("open"):
            inputs = {k: _open(refs[k], ctx.store) for k in reads(decl, refs)}
        ctx.key = key
        # counted, like the stage's tiles, as its role's phase (read, compute or write)
        out = _call(decl, decl.prepare, config, inputs, ctx, clock=clock)
        with clock.phase("check"):
            _check(decl, "prepare", out)
        with clock.phase("store"):
            art = ctx.store.put(key, out, _info(decl, config, refs, "prepare", code))
    with clock.phase("key"):
        src = source_meta(config, ctx)
    extra: dict[str, Any] = {"_stage_key": stage, **({SOURCE: src} if src else {})}
    return _result(decl, key, art, ctx.store, t0, hit, extra_meta=extra, clock=clock)


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
    clock = Clock()
    decl = decl_for(config)
    with clock.phase("key"):
        key = cache_key(config, refs, ctx, prepared=prepared, tile=tile)
    with clock.phase("lookup"):
        art = reusable(ctx.store, key, decl) if use_cache else None
    if art is not None:
        return _result(
            decl, key, art, ctx.store, t0, True, tile=tile, pixels=tile.pixels, clock=clock
        )
    with clock.phase("open"):
        inputs = {k: _open(refs[k], ctx.store) for k in reads(decl, refs)}
        prepared_art = ctx.store.get(prepared.key)
    ctx.key = key
    with ctx.store.staging() as staged:
        ctx.staging = staged
        try:
            out = _call(decl, decl.run, config, inputs, prepared_art, tile, ctx, clock=clock)
            ny, nx = tile.shape
            with clock.phase("check"):
                _check(decl, "tile", out, {"y": ny, "x": nx})
            with clock.phase("store"):
                info = {**_info(decl, config, refs, "tile"), "tile": list(tile.bounds())}
                art = ctx.store.put(key, out, info, staged)
        finally:
            ctx.staging = None
    return _result(decl, key, art, ctx.store, t0, False, tile=tile, pixels=tile.pixels, clock=clock)
