"""The stage plan from declarations, the flow's independence from kinds, one-way imports."""

from __future__ import annotations

import ast
import json
from pathlib import Path
from typing import Any, Literal

import numpy as np
import pytest
import xarray as xr

from gridsolve.schemas.errors import ConfigError
from gridsolve.schemas.kinds.design import DesignConfig
from gridsolve.schemas.pipeline import STAGE_KINDS, build_config
from gridsolve.stages.engine.plan import build_plan
from gridsolve.stages.engine.registry import StageDecl, register, unregister
from gridsolve.stages.engine.store import StageOutput

from testkit import make_ds, run_plan

REPO = Path(__file__).resolve().parents[2]


def configs(tmp_path: Path, cube: Path, **sections: Any) -> dict[str, Any]:
    cfg = build_config(
        {
            "load": {"path": str(cube)},
            "design": {"impl": "polynomial", "degree": 2},
            "model": {"impl": "multidim_linear", "input_dim": 3, "hidden_dim": 1, "output_dim": 2},
            "write": {"path": str(tmp_path / "out.nc")},
            **sections,
        }
    )
    return cfg.stage_configs()


def test_order_and_phases_come_from_the_declarations(tmp_path: Path, cube_path: Path) -> None:
    plan = build_plan(configs(tmp_path, cube_path))
    order = [s.kind for s in plan.steps]
    assert order == ["load", "design", "normal_equations", "solve", "model", "write"]
    segments = [(seg.tiled, [s.kind for s in seg.steps]) for seg in plan.segments]
    assert segments == [
        (False, ["load"]),
        (False, ["design"]),
        (False, ["normal_equations"]),
        (True, ["solve", "model"]),
        (False, ["write"]),
    ]
    # train: none is left out of the plan, and nobody reads it
    assert "train" not in order and all("train" not in s.inputs for s in plan.steps)
    # every stage comes after every stage it reads
    for i, s in enumerate(plan.steps):
        assert set(s.decl.inputs) <= set(order[:i])
    # the order does not depend on the order the configs are given in
    shuffled = dict(reversed(list(configs(tmp_path, cube_path).items())))
    assert [s.kind for s in build_plan(shuffled).steps] == order


def test_run_locally_writes_the_contract_and_solves_right(
    tmp_path: Path, write_cube: Any, ctx: Any
) -> None:
    cube = write_cube(make_ds(n_obs=15, ny=7, nx=9, nan_fraction=0.1))
    refs = run_plan(configs(tmp_path, cube), ctx, tile_pixels=20)  # several tiles
    assert len(refs["solve"].tiles) > 1
    out = Path(refs["write"].meta["path"])
    with xr.open_dataset(out) as ds, xr.open_dataset(cube) as src:
        A = ds["design"].values
        coef = ds["coefficients"].values
        data = src["signal"].values
    for j, i in [(0, 0), (3, 4), (6, 8)]:
        ok = np.isfinite(data[:, j, i])
        expected = np.linalg.lstsq(A[ok], data[ok, j, i], rcond=None)[0]
        np.testing.assert_allclose(coef[:, j, i], expected, rtol=1e-4, atol=1e-5)


class LoopDesign(DesignConfig):
    impl: Literal["reads_solve"] = "reads_solve"


def _never(*args: Any) -> StageOutput:
    raise AssertionError("never runs")


@pytest.fixture
def cyclic_design() -> Any:
    register(
        StageDecl(
            kind="design",
            impl="reads_solve",
            version="1",
            config=LoopDesign,
            run=_never,
            inputs=("load", "solve"),
        )
    )
    yield
    unregister("design", "reads_solve")


def test_a_cycle_is_refused_when_the_plan_is_built(
    tmp_path: Path, cube_path: Path, cyclic_design: Any
) -> None:
    stages = configs(tmp_path, cube_path)
    stages["design"] = LoopDesign()
    with pytest.raises(ConfigError, match="cycle"):
        build_plan(stages)


def test_an_input_nobody_provides_is_refused(tmp_path: Path, cube_path: Path) -> None:
    stages = configs(tmp_path, cube_path)
    del stages["normal_equations"]
    with pytest.raises(ConfigError) as err:
        build_plan(stages)
    assert "'normal_equations', which no stage of the run provides" in str(err.value)


# ---------------------------------------------------------------- imports and wiring
def _modules(folder: str) -> dict[str, ast.Module]:
    return {
        str(p.relative_to(REPO)): ast.parse(p.read_text())
        for p in (REPO / folder).rglob("*.py")
        if "__pycache__" not in p.parts
    }


@pytest.mark.parametrize("folder", ["stages", "schemas"])
def test_no_prefect_under_stages_or_schemas(folder: str) -> None:
    offenders = []
    for name, tree in _modules(folder).items():
        for node in ast.walk(tree):
            mods = []
            if isinstance(node, ast.Import):
                mods = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                mods = [node.module]
            offenders += [f"{name}: {m}" for m in mods if m.split(".")[0] == "prefect"]
    assert not offenders


def test_flows_hold_no_stage_specific_logic() -> None:
    # No comparison with a kind's name and no indexing of results by one; the flow's
    # per-stage parameters (and the demo config's sections) may name the kinds.
    kinds = set(STAGE_KINDS)
    offenders = []
    for name, tree in _modules("flows").items():
        for node in ast.walk(tree):
            if isinstance(node, ast.Compare):
                for c in [node.left, *node.comparators]:
                    if isinstance(c, ast.Constant) and c.value in kinds:
                        offenders.append(f"{name}:{node.lineno} compares with {c.value!r}")
            if isinstance(node, ast.Subscript):
                s = node.slice
                if isinstance(s, ast.Constant) and s.value in kinds:
                    offenders.append(f"{name}:{node.lineno} indexes by {s.value!r}")
            if isinstance(node, ast.Name) and node.id in ("WHOLE", "TILED"):
                offenders.append(f"{name}:{node.lineno} hard-codes the stage order")
    assert not offenders, "\n".join(offenders)


def _path_of(module: str) -> str:
    parts = module.split(".")[1:]
    folder = Path(*parts)
    return str(folder / "__init__.py") if (REPO / folder).is_dir() else str(folder) + ".py"


def _imports_of(folder: str) -> dict[str, set[str]]:
    """gridsolve module → the gridsolve modules it imports anywhere (module or function level)."""
    graph: dict[str, set[str]] = {}
    for name, tree in _modules(folder).items():
        module = "gridsolve." + name.removesuffix(".py").replace("/", ".").removesuffix(".__init__")
        deps: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                deps |= {a.name for a in node.names if a.name.startswith("gridsolve.")}
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("gridsolve."):
                assert node.module is not None
                # ``from package import submodule`` imports the submodule
                subs = {f"{node.module}.{a.name}" for a in node.names}
                found = {s for s in subs if (REPO / _path_of(s)).exists()}
                deps |= found or {node.module}
        graph[module] = deps
    return graph


def test_imports_go_one_way_and_form_no_cycle() -> None:
    graph: dict[str, set[str]] = {}
    for folder in ("schemas", "stages", "flows"):
        graph.update(_imports_of(folder))
    layer = {"schemas": 0, "stages": 1, "flows": 2}
    upward = [
        f"{m} imports {d}"
        for m, deps in graph.items()
        for d in deps
        if d.split(".")[1] in layer and layer[d.split(".")[1]] > layer[m.split(".")[1]]
    ]
    assert not upward, "\n".join(upward)

    # no cycle among modules (an import of a package counts as one of its __init__)
    state: dict[str, int] = {}

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for d in sorted(graph.get(m, ())):
            if d not in graph:
                continue
            if state.get(d) == 1:
                raise AssertionError("import cycle: " + " → ".join([*path, m, d]))
            if d not in state:
                visit(d, [*path, m])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [])


def test_the_writers_know_no_kind() -> None:
    # Each kind describes its own output variables (KindContract.variables): the writers
    # import no kind's package, and the Zarr writer does not build on the NetCDF one.
    from gridsolve.schemas.pipeline import STAGE_KINDS

    graph = _imports_of("stages")
    kinds = {f"gridsolve.stages.{k}" for k in STAGE_KINDS if k != "write"}
    offenders = [
        f"{m} imports {d}"
        for m, deps in graph.items()
        if m.startswith("gridsolve.stages.write")
        for d in deps
        if any(d == k or d.startswith(f"{k}.") for k in kinds)
    ]
    assert not offenders, "\n".join(offenders)
    assert "gridsolve.stages.write.netcdf" not in graph["gridsolve.stages.write.zarr"]
    assert kinds, "the kinds are listed"


def test_the_flow_takes_one_parameter_per_config_section() -> None:
    # Prefect builds the UI form (and prefect deploy the schema) from the flow's own
    # signature, read from its source: a new kind's field must appear there too.
    import inspect

    from gridsolve.flows.pipeline import pipeline
    from gridsolve.schemas.pipeline import PipelineConfig

    params = inspect.signature(pipeline.fn).parameters
    assert list(params) == list(PipelineConfig.model_fields)
    # every parameter has a default, and together they are a valid config (the demo)
    cfg = build_config({name: p.default for name, p in params.items()})
    assert cfg.stage_configs()["design"].impl == "random"
    # and the form Prefect builds from it offers every kind, the train section included
    from prefect.utilities.callables import parameter_schema

    schema = parameter_schema(pipeline.fn).model_dump()
    assert list(schema["properties"]) == list(PipelineConfig.model_fields)
    train = json.dumps(schema["properties"]["train"])
    assert all(impl in train for impl in ('"none"', '"sgd"', '"adam"'))
