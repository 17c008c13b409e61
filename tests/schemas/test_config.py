"""Config validation: every problem at once, by name, with fixes; keys ignore speed-only fields."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from gridsolve.schemas.errors import ConfigError
from gridsolve.schemas.execution import parse_size
from gridsolve.schemas.kinds.solve import LstsqSolve
from gridsolve.schemas.kinds.write import NetCDFWrite
from gridsolve.schemas.pipeline import DEMO, DEMO_DEFAULTS, PipelineConfig, build_config
from gridsolve.schemas.reading import apply_overrides, load_config
from gridsolve.stages.engine.hashing import canonical_json


def _write(tmp_path: Path, raw: dict) -> Path:
    p = tmp_path / "cfg.yaml"
    p.write_text(yaml.safe_dump(raw))
    return p


def test_demo_defaults_validate_and_round_trip() -> None:
    cfg = build_config(DEMO_DEFAULTS)
    again = build_config(json.loads(cfg.model_dump_json()))
    assert again == cfg
    assert cfg.solve.impl == "lstsq" and cfg.model.impl == "multidim_linear"


def test_every_violation_is_reported_at_once() -> None:
    raw = {
        **DEMO_DEFAULTS,
        "solve": {"policy": "ridge", "ridge": -1.0, "dtipe": "float32"},
        "write": {"complevel": 12},
    }
    with pytest.raises(ConfigError) as err:
        build_config(raw)
    text = str(err.value)
    assert "solve.ridge" in text and "greater than or equal to 0" in text
    assert "solve.dtipe: unknown key" in text
    assert "write.complevel" in text and "12" in text
    assert "gridsolve schema" in text  # the fix


def test_unknown_impl_lists_known_and_suggests() -> None:
    with pytest.raises(ConfigError) as err:
        build_config({**DEMO_DEFAULTS, "design": {"impl": "polynomal"}})
    text = str(err.value)
    assert "unknown design implementation 'polynomal'" in text
    assert "Did you mean 'polynomial'?" in text
    for known in ("harmonic", "polynomial", "random", "variable"):
        assert known in text


def test_design_without_impl_asks_for_one() -> None:
    with pytest.raises(ConfigError, match="choose an implementation with impl"):
        build_config({**DEMO_DEFAULTS, "design": {"degree": 2}})


def test_a_demo_load_implies_the_demo_design_and_model_as_the_deployments_do() -> None:
    cfg = build_config({"load": {"impl": "demo"}, "write": {"path": "out.nc"}})
    assert cfg.design == DEMO.design and cfg.model == DEMO.model
    # what the user sets is kept
    cfg = build_config(
        {"load": {"impl": "demo"}, "design": {"impl": "random", "coef": 100, "seed": 3}}
    )
    assert cfg.design.model_dump() == {"impl": "random", "coef": 100, "seed": 3}


def test_real_data_without_a_design_gets_one_message_with_examples(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as err:
        build_config({"load": {"path": str(tmp_path / "x.nc")}, "write": {"path": "o.nc"}})
    assert err.value.violations == [
        "design: required: the linear model fitted at every pixel has no default for your "
        "data — e.g. {impl: polynomial, degree: 1} (a trend) or {impl: harmonic, "
        "harmonics: 1} (a trend and the annual cycle); only a demo load implies the "
        "demo's design"
    ]


def test_no_model_section_runs_no_model_and_a_section_without_impl_is_the_linear_one(
    tmp_path: Path,
) -> None:
    base = {
        "load": {"path": str(tmp_path / "x.nc")},
        "design": {"impl": "polynomial", "degree": 1},
        "write": {"path": "o.nc"},
    }
    cfg = build_config(base)
    assert cfg.model.impl == "none" and not cfg.model.active
    assert build_config({**base, "model": {"impl": "none"}}) == cfg
    linear = build_config({**base, "model": {"input_dim": 2, "hidden_dim": 1}})
    assert linear.model.impl == "multidim_linear" and linear.model.active
    with pytest.raises(ConfigError) as err:
        build_config({**base, "model": {"impl": "none", "seed": 3}})
    assert "model.seed: unknown key" in str(err.value)


def test_training_without_a_model_is_refused_in_one_sentence(tmp_path: Path) -> None:
    raw = {
        "load": {"path": str(tmp_path / "x.nc"), "target": "t"},
        "design": {"impl": "polynomial", "degree": 1},
        "train": {"impl": "adam"},
    }
    with pytest.raises(ConfigError) as err:
        build_config(raw)
    (violation,) = err.value.violations
    assert "train impl 'adam' fits a model's weights, and the run has none" in violation
    assert "add a model section" in violation
    assert "found" not in violation  # the whole config is not echoed back


def test_ridge_policy_needs_positive_lambda() -> None:
    with pytest.raises(ConfigError, match="policy=ridge needs ridge > 0"):
        build_config({**DEMO_DEFAULTS, "solve": {"policy": "ridge"}})


def test_cross_stage_checks() -> None:
    raw = {**DEMO_DEFAULTS, "design": {"impl": "variable"}, "model": {"objective": "mse"}}
    with pytest.raises(ConfigError) as err:
        build_config(raw)
    assert "set load.design" in str(err.value)
    assert "set load.target" in str(err.value)


def test_overrides_parse_yaml_values_and_reject_garbage() -> None:
    raw = apply_overrides(
        {"solve": {"policy": "minnorm"}},
        ["solve.ridge=0.5", "solve.policy=ridge", "model.kwargs.a=[1, 2]"],
    )
    assert raw["solve"] == {"policy": "ridge", "ridge": 0.5}
    assert raw["model"]["kwargs"]["a"] == [1, 2]
    with pytest.raises(ConfigError, match="not of the form key=value"):
        apply_overrides({}, ["solve.ridge"])
    with pytest.raises(ConfigError, match="is a value, not a section"):
        apply_overrides({"solve": {"ridge": 1}}, ["solve.ridge.x=1"])


def test_relative_paths_resolve_against_config_folder(tmp_path: Path) -> None:
    p = _write(
        tmp_path,
        {
            "load": {"path": "data/cube.nc"},
            "design": {"impl": "polynomial"},
            "write": {"path": "out.nc"},
            "cache": {"root": "c"},
        },
    )
    cfg = load_config(p)
    assert cfg.load.path == str(tmp_path / "data" / "cube.nc")
    assert cfg.write.path == str(tmp_path / "out.nc")
    assert cfg.cache.root == str(tmp_path / "c")


def test_missing_and_invalid_config_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("load: [unclosed")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    lst = tmp_path / "list.yaml"
    lst.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="must hold a mapping"):
        load_config(lst)


def test_speed_fields_do_not_change_key_payload_but_result_fields_do() -> None:
    a = LstsqSolve()
    assert canonical_json(a.key_payload()) == canonical_json(
        LstsqSolve(device="cpu", chunk_pixels=7).key_payload()
    )
    assert canonical_json(a.key_payload()) != canonical_json(
        LstsqSolve(dtype="float64").key_payload()
    )
    assert LstsqSolve.speed_fields() == {"device", "chunk_pixels"}


def test_templated_paths_accept_known_placeholders_only() -> None:
    NetCDFWrite(path="out-{scheduled_date}-{flow_run_name}.nc")
    with pytest.raises(ValueError, match="unknown placeholder"):
        NetCDFWrite(path="out-{user}.nc")


def test_json_schema_lists_every_impl_with_bounds() -> None:
    schema = PipelineConfig.model_json_schema()
    text = json.dumps(schema)
    for impl in (
        "netcdf",
        "demo",
        "polynomial",
        "harmonic",
        "random",
        "variable",
        "lstsq",
        "curvefit",
        "none",
        "multidim_linear",
        "module",
    ):
        assert f'"enum": ["{impl}"]' in text
    (solve,) = (
        v
        for v in schema["properties"]["solve"]["anyOf"]
        if v["properties"]["impl"]["enum"] == ["lstsq"]
    )
    # Prefect's form shows a const as "Impl is a const": a described one-value enum instead
    assert '"const"' not in text
    assert solve["properties"]["impl"]["title"] == "Implementation"
    assert "selector above" in solve["properties"]["impl"]["description"]
    assert solve["properties"]["ridge"]["minimum"] == 0


@pytest.mark.parametrize(
    ("text", "n"), [("2GiB", 2 * 2**30), ("512MB", 512 * 10**6), ("1000", 1000), ("1.5KiB", 1536)]
)
def test_parse_size(text: str, n: int) -> None:
    assert parse_size(text) == n
