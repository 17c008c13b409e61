"""Each kind's metadata is one typed model, and nothing reads a kind's metadata by string key."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from pydantic import ValidationError

from gridsolve.schemas import metadata
from gridsolve.schemas.metadata import DesignMeta, LoadMeta, Meta

ROOT = Path(__file__).resolve().parents[2]
#: where stage metadata is consumed: the stages, the flows, the Python API, the test plugins
#: (the "add a kind" walk-through follows them)
SCANNED = ("stages", "flows", "gridsolve", "tests/plugins")


#: names that hold stage metadata by convention (``pixel_bytes(prepared)`` gets a mapping)
META_NAMES = {"meta", "prepared"}


def _aliases(tree: ast.AST) -> set[str]:
    """Names bound to an ``x.meta`` expression (``m = ctx.own.meta``), which hold it too."""
    found = set()
    for node in ast.walk(tree):
        value = node.value if isinstance(node, ast.Assign) else None
        if isinstance(value, ast.Attribute) and value.attr == "meta":
            found |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    return found


def string_keyed_reads(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, key) of every ``meta["key"]`` read and ``meta.get("key")`` call in ``tree``.

    Metadata is what an ``x.meta`` attribute, a name ``meta``/``prepared``/``*_meta``, or
    a name bound to an ``x.meta`` holds. Keys with a leading underscore are the engine's
    own bookkeeping (``_stage_key``), not a kind's metadata; writing a key (building the
    metadata) is not a read.
    """
    names = META_NAMES | _aliases(tree)

    def _is_meta(node: ast.expr) -> bool:
        if isinstance(node, ast.Attribute):
            return node.attr == "meta" or node.attr.endswith("_meta")
        name = getattr(node, "id", "")
        return name in names or name.endswith("_meta")

    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        key: object = None
        if (
            isinstance(node, ast.Subscript)
            and isinstance(node.ctx, ast.Load)
            and _is_meta(node.value)
            and isinstance(node.slice, ast.Constant)
        ):
            key = node.slice.value
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in ("get", "pop", "setdefault")
            and _is_meta(node.func.value)
            and node.args
            and isinstance(node.args[0], ast.Constant)
        ):
            key = node.args[0].value
        if isinstance(key, str) and not key.startswith("_"):
            found.append((node.lineno, key))
    return found


def test_the_scan_finds_string_keyed_reads() -> None:
    src = 'a = load.meta["y_dim"]\nb = design.meta.get("trend")\nc = load_meta["ny"]\n'
    src += 'meta["built"] = 1\nd = prepared.meta["_stage_key"]\ne = row["meta"]\n'
    src += 'm = ctx.own.meta\nf = m.get("objective")\ng = prepared["obs"]\n'
    assert string_keyed_reads(ast.parse(src)) == [
        (1, "y_dim"),
        (2, "trend"),
        (3, "ny"),
        (8, "objective"),
        (9, "obs"),
    ]


def test_no_string_keyed_reads_of_stage_metadata() -> None:
    offenders = []
    for top in SCANNED:
        for path in sorted((ROOT / top).rglob("*.py")):
            if path.is_symlink() or any(p.is_symlink() for p in path.parents):
                continue  # gridsolve/stages etc. link to the top-level folders, scanned once
            for line, key in string_keyed_reads(ast.parse(path.read_text(), str(path))):
                offenders.append(f"{path.relative_to(ROOT)}:{line}: {key!r}")
    assert not offenders, "read these through the kind's model (schemas/metadata.py):\n" + (
        "\n".join(offenders)
    )
    assert (ROOT / "stages/write/layout.py").exists(), "the scan looked at the tree"


def test_every_kind_declares_its_metadata_with_a_model_from_schemas() -> None:
    import gridsolve.stages  # noqa: F401  (registers every kind's contract)
    from gridsolve.stages.engine.contract import contracts

    found = contracts()
    assert {"load", "design", "normal_equations", "solve", "model", "train", "write"} <= set(found)
    for kind, contract in found.items():
        for part, spec in contract.parts.items():
            assert issubclass(spec.meta, Meta), (kind, part)
            assert spec.meta is not Meta, f"{kind}/{part} declares no metadata model"
            assert spec.meta.__module__ == metadata.__name__, (kind, part, spec.meta)


def _load_meta(**extra: object) -> dict[str, object]:
    return {
        "variable": "t",
        "dims": ["time", "lat", "lon"],
        "obs_dim": "time",
        "y_dim": "lat",
        "x_dim": "lon",
        "n_obs": 3,
        "ny": 2,
        "nx": 4,
        "dtype": "<f4",
        "aux": {"weights": {"name": "w", "dims": ["time"], "shared": True}},
        "content_hash": "abc",
        **extra,
    }


def test_models_read_artifacts_and_mappings_typed() -> None:
    class Art:
        meta = _load_meta(plugin_key=1)

    typed = LoadMeta.of(Art())
    assert (typed.y_dim, typed.aux["weights"].shared, typed.lead_dims) == ("lat", True, [])
    assert typed.model_extra == {"plugin_key": 1}  # an implementation's own keys are kept
    assert LoadMeta.of(typed) is typed
    assert LoadMeta.of(_load_meta()).grid_shape() == (2, 4)
    with pytest.raises(ValidationError, match="ny"):
        LoadMeta.of(_load_meta(ny="two"))


def test_design_meta_types_the_trend_and_harmonics() -> None:
    meta = DesignMeta.of(
        {
            "coef": 4,
            "rank": 4,
            "cond": 2.5,
            "columns": ["1", "t", "cos1", "sin1"],
            "trend": {"column": 1, "scale": 182.5, "per": "day"},
            "harmonics": [{"k": 1, "cos": 2, "sin": 3}],
            "period": 365.25,
        }
    )
    assert meta.trend is not None and meta.trend.column == 1 and meta.trend.per == "day"
    assert [(h.k, h.cos, h.sin) for h in meta.harmonics] == [(1, 2, 3)]
    assert "t_centre" not in meta.model_fields_set and meta.t_centre is None
    assert meta.describe() == "4 coefficients, rank 4, condition number 2.5"


def test_harmonics_without_a_period_break_the_design_contract() -> None:
    # the writer's amplitude and peak time need the period: a design that gives harmonics
    # without one is refused where it is made, not written without those variables
    with pytest.raises(ValidationError, match="period"):
        DesignMeta.of(
            {"coef": 3, "rank": 3, "cond": 1.0, "columns": ["1", "cos1", "sin1"]}
            | {"harmonics": [{"k": 1, "cos": 1, "sin": 2}]}
        )
